"""The signatures an image was accepted with, kept beside a copy of it, as containers/image's copy
stores the source's signatures with the image it writes (copy/single.go: PutSignaturesWithFormat),
so a later use of the copy is checked against them without asking the registry.

    <directory>/sha256-<hex>.json    {"signedBy": [base64 blob, ...],
                                      "sigstoreSigned": [{"mediaType", "payload" (base64), "annotations"}, ...]}

Kept signatures are data, never a verdict: every use runs the policy in force over them again
(keys, digest, identity), so a changed policy decides afresh, and a file someone altered can only
hold signatures that fail. Reads are bounded and follow no link.
"""

from __future__ import annotations

import base64
import json
import os
import re
import stat
from pathlib import Path

from diskkit.signing.lookaside import MAX_SIGNATURES
from diskkit.streams.fsutil import write_atomic

# Signatures are a few KiB each; a set this large is not kept (its next use asks the registry again).
MAX_FILE_BYTES = 16 << 20
_DIGEST = re.compile(r"^sha256:([0-9a-f]{64})$")


class Kept:
    """One directory of kept signatures. `first`: offered before the registry's (a copy the node
    already holds); otherwise only written, after the registry's were accepted."""

    def __init__(self, directory: Path, first: bool = False):
        self.directory = Path(directory)
        self.first = first

    def _path(self, digest: str) -> Path | None:
        match = _DIGEST.match(digest)
        return self.directory / f"sha256-{match.group(1)}.json" if match else None

    def get(self, digest: str) -> dict[str, list] | None:
        """The signatures kept for `digest`, by kind (signedBy: blobs; sigstoreSigned: attachments);
        None when none are kept or the file is not one this module wrote."""
        path = self._path(digest)
        if path is None:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            with os.fdopen(os.dup(fd), "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        finally:
            os.close(fd)
        if len(data) > MAX_FILE_BYTES:
            return None
        try:
            doc = json.loads(data)
            simple = [base64.b64decode(blob, validate=True) for blob in doc.get("signedBy", [])][:MAX_SIGNATURES]
            attached = doc.get("sigstoreSigned", [])[:MAX_SIGNATURES]
            if attached:
                from diskkit.signing.sigstore import Attached  # only a sigstore policy needs it, and has loaded its keys' code

                attached = [Attached(str(a["mediaType"]), base64.b64decode(a["payload"], validate=True), dict(a["annotations"])) for a in attached]
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        return {"signedBy": simple, "sigstoreSigned": attached}

    def put(self, digest: str, found: dict[str, list]) -> None:
        """Keep what the registry gave for `digest` (by kind), in place of what was kept."""
        path = self._path(digest)
        if path is None:
            return
        doc = {"signedBy": [base64.b64encode(blob).decode() for blob in found.get("signedBy", [])],
               "sigstoreSigned": [{"mediaType": a.media_type, "payload": base64.b64encode(a.payload).decode(), "annotations": a.annotations}
                                  for a in found.get("sigstoreSigned", [])]}
        data = json.dumps(doc, sort_keys=True).encode()
        if len(data) > MAX_FILE_BYTES:
            return
        self.directory.mkdir(mode=0o700, exist_ok=True)
        write_atomic(path, data, mode=0o600)

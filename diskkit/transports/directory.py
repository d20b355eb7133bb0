"""`dir:DIR`: skopeo's directory transport (containers/image directory/): every blob a file named by
its sha256 hex, the image's manifest (or index) in manifest.json, an index's child manifests in
HEX.manifest.json, and a `version` file that marks the directory as one skopeo may overwrite.

Written under a temporary name beside DIR and swapped in at commit, so an interrupted copy leaves
the old image (or nothing) behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from pathlib import Path
from typing import BinaryIO

from diskkit.errors import DiskkitError
from diskkit.oci.image import Descriptor, check_digest, sha256_digest
from diskkit.oci.reference import ImageRef
from diskkit.streams import fsutil
from diskkit.transports.base import Destination, Source
from diskkit.transports.layout import DirStore, PendingFile, pending_blob

VERSION = b"Directory Transport Version: 1.1\n"


class DirSource(Source):
    def __init__(self, ref: ImageRef):
        self.where = str(ref)
        self.root = Path(ref.path)
        if not (self.root / "manifest.json").is_file():
            raise DiskkitError(ref.path, "is not a dir: image (no manifest.json)")
        self.store = DirStore(self.root)

    def top_manifest(self):
        return self.store.read("manifest.json"), None, None

    def read_manifest(self, desc: Descriptor) -> bytes:
        data = self.store.read(f"{check_digest(desc.digest, self.where)}.manifest.json")
        if sha256_digest(data) != desc.digest:
            raise DiskkitError(self.where, f"manifest {desc.digest} does not match its digest")
        return data

    def open_blob(self, desc: Descriptor) -> BinaryIO:
        return self.store.open(check_digest(desc.digest, self.where))


class DirDestination(Destination):
    def __init__(self, ref: ImageRef):
        self.ref = ref
        self.final = Path(ref.path)
        if self.final.exists() or self.final.is_symlink():
            if not self.final.is_dir() or self.final.is_symlink():
                raise DiskkitError(ref.path, "exists and is not a directory; dir: needs a directory")
            if any(self.final.iterdir()) and _version(self.final) != VERSION:
                # skopeo's words (containers/image directory/directory_dest.go).
                raise DiskkitError(ref.path, "not a containers image directory, don't want to overwrite important data")
        fsutil.check_writable(self.final.parent)
        self.blobs = self.final.parent / f".{self.final.name}.diskkit-{secrets.token_hex(4)}"
        self.added: list[Path] = []
        self.top: bytes | None = None
        self.signatures: list[bytes] = []  # the top manifest's, written as signature-N at commit

    def begin(self) -> None:
        self.blobs.mkdir()

    def blob_writer(self, media_type: str) -> contextlib.AbstractContextManager[PendingFile]:
        return pending_blob(self)

    def has_blob(self, desc: Descriptor) -> bool:
        return (self.blobs / check_digest(desc.digest, str(self.final))).is_file()

    def put_manifest(self, data: bytes, media_type: str, platform: dict | None = None, child: bool = False) -> Descriptor:
        digest = sha256_digest(data)
        if self.before_manifest is not None:
            self.before_manifest(self, digest, child)
        if child:
            fsutil.write_atomic(self.blobs / f"{digest.split(':')[1]}.manifest.json", data)
        else:
            self.top = data
        return Descriptor(media_type, digest, len(data))

    def commit(self) -> None:
        if self.top is None:
            raise DiskkitError(self.final, "no manifest was written")
        fsutil.write_atomic(self.blobs / "manifest.json", self.top)
        fsutil.write_atomic(self.blobs / "version", VERSION)
        for i, blob in enumerate(self.signatures, 1):
            fsutil.write_atomic(self.blobs / f"signature-{i}", blob)
        fsutil.fsync_tree(self.blobs)
        old = None
        if self.final.exists():
            old = self.final.parent / f".{self.final.name}.diskkit-old-{secrets.token_hex(4)}"
            os.rename(self.final, old)
        try:
            os.rename(self.blobs, self.final)
        except OSError as exc:
            if old is not None:
                os.rename(old, self.final)
            self.abort()
            raise DiskkitError(self.final, f"cannot be created ({exc.strerror})") from None
        fsutil.fsync_dir(self.final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        shutil.rmtree(self.blobs, ignore_errors=True)


def _version(root: Path) -> bytes | None:
    try:
        return (root / "version").read_bytes()
    except OSError:
        return None

"""GPG simple signatures kept beside an image: a registries.d lookaside store
(`<base>/<repo>@sha256=<hex>/signature-N`, containers/image docker/docker_image_src.go and
docker_image_dest.go), and the `signature-N` files of a dir: image (directory/directory_src.go).

file:// is read and written, http(s):// only read (skopeo writes there only through a
lookaside-staging file:// location), over the registry's own TLS settings when the caller gives
its session, as containers/image does. A registry that offers the signature API
(X-Registry-Supports-Signatures) keeps them itself instead: sigapi.py.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

from diskkit.errors import DiskkitError
from diskkit.limits import MAX_SIGNATURE_BYTES, MAX_SIGNATURES, check_signature_count, read_regular
from diskkit.streams.fsutil import fsync_dir, write_atomic

TIMEOUT = 60.0  # seconds an http(s) lookaside may stay silent, when the registry's options give none
_DIGEST = re.compile(r"^(sha256|sha512):([0-9a-f]+)$")
# The first byte of a binary OpenPGP message: compressed data, one-pass signature or signature
# packet, old or new format (internal/signature/signature.go FromBlob).
_OPENPGP_FIRST = {0xA0, 0xA1, 0xA2, 0xA3, 0xC8, 0x90, 0x91, 0x92, 0x3D, 0xC4, 0x88, 0x89, 0x8A, 0x8B, 0xC2}
_PREFIX = b"\x00simple-signing\n"


def from_blob(blob: bytes, where: str) -> bytes:
    """The OpenPGP message of a stored simple signature, refused as FromBlob refuses anything else
    (ASCII armour included: it starts with "-")."""
    if not blob:
        raise DiskkitError(where, "parsing signature: empty signature blob")
    if blob.startswith(_PREFIX):
        return blob[len(_PREFIX):]
    if blob[0] == 0:
        raise DiskkitError(where, "parsing signature: not a simple signature (another format)")
    if blob[0] not in _OPENPGP_FIRST:
        raise DiskkitError(where, f"parsing signature: unrecognized signature format, starting with binary {blob[0]:#x}")
    return blob


def signature_url(base: str, digest: str, index: int) -> str:
    """`<base>@<algorithm>=<hex>/signature-<index+1>` (lookasideStorageURL)."""
    match = _DIGEST.match(digest)
    if not match:
        raise DiskkitError(digest, "invalid manifest digest for a signature location")
    return f"{base}@{match.group(1)}={match.group(2)}/signature-{index + 1}"


def _file_path(url: str) -> Path:
    return Path(unquote(urlsplit(url).path))


def _read_file(path: Path, shown: str) -> bytes | None:
    """A stored signature's bytes (None: there is none), as bounded as a downloaded one: a FIFO or a
    device in its place is refused unread (diskkit.limits)."""
    try:
        return read_regular(path, MAX_SIGNATURE_BYTES, shown, "the signature")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DiskkitError(path, f"cannot read the signature: {exc.strerror}") from None


def _get(url: str, session=None, timeout: float = TIMEOUT) -> bytes | None:
    scheme = urlsplit(url).scheme
    if scheme == "file":
        return _read_file(_file_path(url), url)
    if scheme not in ("http", "https"):
        raise DiskkitError(url, "Unsupported scheme when reading signature")
    import requests
    import urllib3

    from diskkit.registry.client import read_body, refusal

    try:
        # The registry's own client when given, as containers/image reads a lookaside with the
        # registry's (docker_image_src.go getOneSignature: s.c.client): its certs.d / --cert-dir
        # CAs and client certificate, and --tls-verify, hold for the lookaside too.
        get = session.get if session is not None else requests.get
        extra = {"verify": session.verify} if session is not None else {}  # REQUESTS_CA_BUNDLE must not override it
        response = get(url, timeout=timeout, stream=True, **extra)
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
        raise DiskkitError(url, f"reading signature: {refusal(exc)}") from None
    if response.status_code == 404:
        response.close()
        return None
    if response.status_code != 200:
        response.close()
        raise DiskkitError(url, f"reading signature: HTTP {response.status_code}")
    # Bounded and in one line whatever happens mid-body (a server that stalls, a connection cut).
    return read_body(response, MAX_SIGNATURE_BYTES, url, "the signature")


def read(base: str, digest: str, session=None, timeout: float = TIMEOUT) -> list[bytes]:
    """signature-1, -2, ... until the first missing one (their OpenPGP messages, untrusted);
    http(s) ones through `session` (a requests.Session, the registry's) when given, each answer
    awaited at most `timeout` seconds at a time."""
    found = []
    for i in range(MAX_SIGNATURES + 1):
        if i == MAX_SIGNATURES:
            raise DiskkitError(base, f"server provided {MAX_SIGNATURES} signatures, assuming that's unreasonable and a server error")
        url = signature_url(base, digest, i)
        blob = _get(url, session, timeout)
        if blob is None:
            break
        found.append(from_blob(blob, url))
    return found


def writable_dir(base: str, digest: str) -> Path:
    """The directory the signatures of `digest` are written to; refused before anything moves unless file://."""
    url = signature_url(base, digest, 0)
    scheme = urlsplit(url).scheme
    if scheme in ("http", "https"):
        raise DiskkitError(base, f"Writing directly to a {scheme} lookaside is not supported. Configure a lookaside-staging: location")
    if scheme != "file":
        raise DiskkitError(base, "Unsupported scheme when writing signature")
    return _file_path(url).parent


def append(base: str, digest: str, signatures: list[bytes]) -> list[Path]:
    """Store signatures after the ones already there (signature-N+1, ...), each written atomically."""
    directory = writable_dir(base, digest)
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o755)
        count = len(read(base, digest))
        written = []
        for offset, blob in enumerate(signatures):
            path = directory / f"signature-{count + offset + 1}"
            write_atomic(path, blob)
            written.append(path)
        fsync_dir(directory)
    except OSError as exc:
        raise DiskkitError(directory, f"cannot store the signature: {exc.strerror}") from None
    return written


def read_dir(root: Path, where: str, instance: str | None = None) -> list[bytes]:
    """A dir: image's signature-1, -2, ... (directory_src.go reads until the first missing), or
    those of one instance of its index, `<hex>.signature-N`."""
    found = []
    prefix = ""
    if instance is not None:
        match = _DIGEST.match(instance)
        if not match:
            raise DiskkitError(instance, "invalid manifest digest for a signature location")
        prefix = match.group(2) + "."
    for i in range(1, MAX_SIGNATURES + 2):
        path, shown = root / f"{prefix}signature-{i}", f"{where}/{prefix}signature-{i}"
        if i > MAX_SIGNATURES:
            if os.path.lexists(path):
                check_signature_count(i, where)
            break
        data = _read_file(path, shown)
        if data is None:
            break
        found.append(from_blob(data, shown))
    return found

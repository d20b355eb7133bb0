"""How much outside data may make this process allocate or write: the one table of bounds, and the
checks readers of registry answers, image contents and local files call before they allocate a
buffer or write a byte. A length, a size or a count that comes from outside is checked here first;
what arrives is kept in buffers that grow with it, never in one sized by what was announced.

The small answers' limits are containers/image's (internal/iolimits/iolimits.go), the signature
count its lookaside's (docker/docker_image_src.go maxLookasideSignatures); the rest are ours, each
documented in docs/security.md ("Bounded inputs").
"""

from __future__ import annotations

import fcntl
import io
import os
import stat
from typing import BinaryIO

from diskkit.errors import DiskkitError

# containers/image internal/iolimits/iolimits.go (ReadAtMost): what one answer may hold.
MAX_MANIFEST_BYTES = 4 << 20  # MaxManifestBodySize, the limit distribution itself puts on a manifest
MAX_CONFIG_BYTES = 4 << 20  # MaxConfigBodySize
MAX_SIGNATURE_BYTES = 4 << 20  # MaxSignatureBodySize: one signature, from a lookaside, a dir: image or an attachment
MAX_SIGNATURE_LIST_BYTES = 4 << 20  # MaxSignatureListBodySize: the registry signature API's list
MAX_TOKEN_BYTES = 1 << 20  # MaxAuthTokenBodySize
MAX_ERROR_BYTES = 1 << 20  # MaxErrorBodySize: every other answer (errors, upload status, /v2/) is read up to this

# docker/docker_image_src.go maxLookasideSignatures, there for a lookaside only. Applied here to every
# store (the signature API's 4 MiB list holds ~60,000 small entries, sigstore attachments as many
# layers): each signature costs a verification, a gpg process for simple signing.
MAX_SIGNATURES = 128

# A lazy TOC's chunk: diskkit writes 1 MiB chunks, doubled while a disk has more than 16384 of them
# (diskkit.layers.lazytoc.chunk_size_for), so 64 MiB is a 1 TiB disk's. One chunk (one gzip member)
# is what a reader holds in memory at a time, so this bounds what a TOC can make it allocate.
MAX_CHUNK = 64 << 20


# A boot's read trace (diskkit.oci.readtrace), a registry's input to the node's prefetch order. A
# recorded boot of the real Debian guest reads 151 MiB in a few thousand runs; 32768 runs of the
# trace's JSON, base64 inside its DSSE envelope, stay under 1 MiB, and a layer over 2 MiB is not
# fetched at all. The referrers index may list many: only the newest few are tried (each costs a
# fetch and a signature check).
MAX_TRACE_READS = 32768
MAX_TRACE_BYTES = 2 << 20
MAX_TRACE_CANDIDATES = 4


class TooLarge(DiskkitError):
    """Outside data asked for more than its bound: refused before it was allocated or written."""


def member_limit(chunk_size: int) -> int:
    """The longest gzip member a chunk can take: deflate's stored blocks add 5 bytes per 64 KiB, gzip
    18 bytes of header and trailer; anything longer is not a chunk diskkit wrote, and is not read."""
    return chunk_size + chunk_size // 1024 + 4096


def check(size: int, limit: int, where: object, what: str) -> int:
    """`size` when it is at most `limit`; else TooLarge, one line naming `what` and the bound."""
    if size > limit:
        raise TooLarge(where, f"{what} is {size} bytes, more than {limit}; refused")
    return size


def check_signature_count(count: int, where: object) -> None:
    """containers/image's words for a store that offers more signatures than anyone verifies."""
    if count > MAX_SIGNATURES:
        raise TooLarge(where, f"server provided {count} signatures, more than {MAX_SIGNATURES}; assuming that's unreasonable and a server error")


class AtMost(io.RawIOBase):
    """A reader of `raw` that gives at most `limit` bytes and raises TooLarge (`rule`) at the first
    byte beyond: a decompressor behind it inflates no more than the limit and one byte."""

    def __init__(self, raw: BinaryIO, limit: int, where: object, rule: str):
        self._raw, self.limit, self._where, self._rule = raw, limit, where, rule
        self.count = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        room = self.limit + 1 - self.count
        data = self._raw.read(room if size is None or size < 0 else min(size, room))
        self.count += len(data)
        if self.count > self.limit:
            raise TooLarge(self._where, self._rule)
        return data

    def readinto(self, buf) -> int:
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)


def open_regular(path: str | os.PathLike, where: object | None = None) -> BinaryIO:
    """`path` opened for reading when it is a regular file. A FIFO is opened without waiting for a
    writer and refused, as are devices (/dev/zero reads without end) and sockets: one line naming it."""
    shown = where if where is not None else path
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise DiskkitError(shown, f"is not a regular file ({_kind(mode)}); refused")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, limit: int, where: object | None = None, what: str = "the file") -> bytes:
    """A regular file's bytes, at most `limit` of them (one more is read to see a larger file, which
    is refused): a link to /dev/zero or a FIFO is refused before anything is read. OSError (missing,
    unreadable) is the caller's to word."""
    shown = where if where is not None else path
    with open_regular(path, shown) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise TooLarge(shown, f"{what} is larger than {limit} bytes; refused")
    return data


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a file"


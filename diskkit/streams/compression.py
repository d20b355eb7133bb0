"""Streaming compressors and decompressors for layer blobs: gzip through ISA-L, zstd, or none.

Output is deterministic for a given input and level (gzip header mtime 0, and ISA-L's first bytes
kept from its body, see _Gzip; zstd always in multi-threaded mode, whose output does not depend on
the thread count), so builds are reproducible.
"""

from __future__ import annotations

import io
from typing import BinaryIO, Protocol

from isal import igzip, isal_zlib

from diskkit.errors import DiskkitError

KINDS = ("gzip", "zstd", "none")
DEFAULT_LEVEL = {"gzip": 1, "zstd": 3, "none": 0}


class Compressor(Protocol):
    def compress(self, data: bytes | memoryview) -> bytes: ...
    def flush(self) -> bytes: ...


# ISA-L (2.32.1, also its master) levels 1 and 2 hash a fresh stream's third byte from a register
# holding the stream's address instead of from the data (igzip_icf_body_h1_gr_bt.asm,
# .write_first_byte, reads `tmp2` = rcx before setting it). Which earlier position a later match
# finds then hung on where the stream struct lay in memory: on a compressing thread's stack, moved
# by ASLR. About 1 build in 10 of a 700 MB disk made a different (valid) layer digest. The body
# takes that path only when it starts a stream; input of at most PROLOGUE bytes under a flush it
# leaves to the finish routine, which starts a stream correctly. So a stream's first PROLOGUE
# bytes go alone, closed by a sync flush (an empty stored block, 5 bytes), and the body only ever
# continues a stream.
PROLOGUE = 16


def _open_stream(z, head: bytes | memoryview) -> bytes:
    """A stream's first PROLOGUE bytes, alone and flushed, so ISA-L's body only continues it."""
    return z.compress(head) + z.flush(isal_zlib.Z_SYNC_FLUSH)


class _Gzip:
    def __init__(self, level: int):
        self._z = isal_zlib.compressobj(level, isal_zlib.DEFLATED, 31)
        self._head = b""
        self._started = False

    def compress(self, data: bytes | memoryview) -> bytes:
        if self._started:
            return self._z.compress(data)
        need = PROLOGUE - len(self._head)
        self._head += bytes(data[:need])
        if len(self._head) < PROLOGUE:
            return b""
        self._started = True
        out = _open_stream(self._z, self._head)
        return out + self._z.compress(data[need:]) if len(data) > need else out

    def flush(self) -> bytes:
        if not self._started:  # PROLOGUE bytes or fewer in all: the finish routine takes them whole
            self._started = True
            return self._z.compress(self._head) + self._z.flush()
        return self._z.flush()


class _Identity:
    def compress(self, data):
        return data

    def flush(self):
        return b""


def compressor(kind: str, level: int | None = None) -> Compressor:
    if level is None:
        level = DEFAULT_LEVEL[kind]
    if kind == "gzip":
        _check_gzip_level(level)
        return _Gzip(level)
    if kind == "zstd":
        if not 1 <= level <= 19:
            raise DiskkitError("--level", "zstd levels are 1-19")
        import zstandard  # 11 ms to load with cold caches; gzip layers do without it

        # 4 MiB jobs keep the two workers' buffers near 60 MiB instead of about 100 MiB.
        params = zstandard.ZstdCompressionParameters.from_level(level, threads=2, job_size=4 << 20)
        return zstandard.ZstdCompressor(compression_params=params).compressobj()
    if kind == "none":
        return _Identity()
    raise DiskkitError(kind, f"unknown compression; use one of {', '.join(KINDS)}")


def _check_gzip_level(level: int) -> None:
    if not 0 <= level <= 3:
        raise DiskkitError("--level", "gzip levels are 0-3 (ISA-L); 1 matches gzip's BestSpeed")


def gzip_member(data: bytes | memoryview, level: int | None = None) -> bytes:
    """One complete gzip member (header mtime 0). Members concatenate into one gzip stream, and
    ISA-L releases the GIL while compressing, so threads compress members on every core."""
    return b"".join(gzip_member_parts(data, level))


def gzip_member_parts(data: bytes | memoryview, level: int | None = None) -> tuple[bytes, ...]:
    """gzip_member's bytes as the compressor gave them, unjoined: a caller that puts many members
    side by side joins them all at once, copying each byte once."""
    level = DEFAULT_LEVEL["gzip"] if level is None else level
    _check_gzip_level(level)
    z = isal_zlib.compressobj(level, isal_zlib.DEFLATED, 31)
    if len(data) <= PROLOGUE:
        return z.compress(data), z.flush()
    # _Gzip's parts: the prologue alone, closed by a sync flush (_open_stream), then the rest
    return z.compress(data[:PROLOGUE]), z.flush(isal_zlib.Z_SYNC_FLUSH), z.compress(data[PROLOGUE:]), z.flush()


def sniff(head: bytes) -> str:
    """Which compression a blob really uses, from its first bytes (Docker archives do not say)."""
    if head.startswith(b"\x1f\x8b"):
        return "gzip"
    if head.startswith(b"\x28\xb5\x2f\xfd"):
        return "zstd"
    return "none"


def decompressing_reader(raw: BinaryIO, kind: str, where: str = "layer") -> BinaryIO:
    """A readable stream of the uncompressed bytes; multi-member gzip and multi-frame zstd included.
    A corrupt stream ends in one DiskkitError naming `where`, whichever library found it."""
    if kind == "gzip":
        return _Checked(igzip.IGzipFile(fileobj=raw, mode="rb"), kind, where, (isal_zlib.error,))
    if kind == "zstd":
        import zstandard

        return _Checked(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True, closefd=False), kind, where, (zstandard.ZstdError,))
    if kind == "xz":  # disk sources only (cloud images ship as .xz and .bz2); never a layer
        import lzma

        return _Checked(lzma.LZMAFile(raw), kind, where, (lzma.LZMAError,))
    if kind == "bzip2":
        import bz2

        return _Checked(bz2.BZ2File(raw), kind, where, ())
    if kind == "none":
        return raw
    raise DiskkitError(kind, "unknown layer compression")


class _Checked(io.RawIOBase):
    """The decompressor's own errors (ISA-L's IsalError, zstandard's ZstdError, gzip's
    BadGzipFile, a stream ending early) as the one-line error users read; errors of the stream
    under it (a digest or a registry failure) pass unchanged."""

    def __init__(self, inner, kind: str, where: str, errors: tuple[type[BaseException], ...]):
        self._inner, self._kind, self._where = inner, kind, where
        self._errors = (*errors, OSError, EOFError, ValueError)

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        return self._checked(self._inner.read, size)

    def readinto(self, buf) -> int:
        # Straight into the caller's buffer, as the decompressor would without this wrapper: no copy added.
        return self._checked(self._inner.readinto, buf)

    def _checked(self, call, arg):
        try:
            return call(arg)
        except DiskkitError:
            raise
        except self._errors as exc:
            raise DiskkitError(self._where, f"{self._kind} stream cannot be decompressed ({exc or type(exc).__name__}); refused") from None

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            super().close()

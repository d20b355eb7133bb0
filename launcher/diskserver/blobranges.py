"""Byte ranges of a registry blob, the source every lazy export's chunks come from: fetched with HTTP
range requests through the registry client (auth, TLS, retries, resumed after dropped connections),
pieces the node already holds read from the cache, and small blobs remembered for the next export
of the same image. What the bytes must hash to is the chunk source's business (launcher.diskserver.registrychunks),
not this module's."""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from pathlib import Path

from diskkit.registry.ranges import BlobRanges
from launcher.diskserver import imagewalk


class KnownRanges:
    """A blob's ranges, some already in the node cache (an export's head and tail): those, and the
    ranges inside them (the TOC is read out of the tail), are read from there, not fetched again."""

    def __init__(self, ranges: BlobRanges, known: dict[tuple[int, int], Path]):
        self.ranges, self.size, self.known = ranges, ranges.size, known

    def read(self, start: int, length: int) -> bytes:
        for (at, size), path in self.known.items():
            if at <= start and start + length <= at + size:
                data = _read_piece(path, size, start - at, length)
                if data is not None:
                    return data
        return self.ranges.read(start, length)


def _read_piece(path: Path, size: int, offset: int, length: int) -> bytes | None:
    """`length` bytes at `offset` of a `size`-byte file; None when it is gone (installed meanwhile:
    its head and tail are removed), not that size, or not a regular file of its own (no link is
    followed: the bytes are checked by their readers, but the server reads nothing it did not write)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size:
            return None
        data = os.pread(fd, length, offset)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) == length else None


class SmallBlobs:
    """The last small blobs read whole (the layers imagewalk verifies and uses at once), so that a VM's
    disk and its kernelBoot files, looked up one after the other in the same image, fetch them once.
    Only blobs that match their digest are kept; whoever uses them checks digest and diffID again."""

    def __init__(self, limit: int = imagewalk.MAX_SMALL_LAYER // 2):
        self.limit = limit
        self.blobs: dict[str, bytes] = {}  # insertion order: the oldest goes first
        self.lock = threading.Lock()

    def ranges(self, ranges: BlobRanges | KnownRanges) -> "RememberedRanges":
        return RememberedRanges(ranges, self)

    def get(self, digest: str) -> bytes | None:
        with self.lock:
            return self.blobs.get(digest)

    def put(self, digest: str, data: bytes) -> None:
        if len(data) > self.limit:
            return
        with self.lock:
            self.blobs.pop(digest, None)
            self.blobs[digest] = data
            while sum(map(len, self.blobs.values())) > self.limit:
                del self.blobs[next(iter(self.blobs))]


class RememberedRanges:
    """A blob's ranges where a read of the whole blob is answered from, and kept in, SmallBlobs."""

    def __init__(self, ranges: BlobRanges | KnownRanges, small: SmallBlobs):
        self.ranges, self.small, self.size = ranges, small, ranges.size
        self.digest = ranges.ranges.digest if isinstance(ranges, KnownRanges) else ranges.digest

    def read(self, start: int, length: int) -> bytes:
        if (start, length) != (0, self.size):
            return self.ranges.read(start, length)
        data = self.small.get(self.digest)
        if data is None or len(data) != length:
            data = self.ranges.read(start, length)
            # Kept only when it is the blob its digest names: what one image's registry answered
            # under another image's layer digest must not be what that image is then answered with.
            if "sha256:" + hashlib.sha256(data).hexdigest() == self.digest:
                self.small.put(self.digest, data)
        return data


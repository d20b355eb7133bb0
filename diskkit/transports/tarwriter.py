"""Append entries to a tar file whose names and sizes are known only after their content is written.

A blob's name in an archive is its digest, which is known only once the blob has streamed
through. Each entry reserves a 512-byte header, streams its data, then goes back and fills the
header in: one pass, no temporary copy. GNU headers keep every header exactly 512 bytes (sizes
over 8 GiB are stored base-256, which Go's archive/tar and Python's tarfile both read).
"""

from __future__ import annotations

import os
import tarfile
from typing import BinaryIO

from diskkit.errors import DiskkitError

BLOCK = 512


def _header(name: str, size: int, mtime: int, mode: int = 0o644, kind: bytes = tarfile.REGTYPE) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = mtime
    info.mode = mode
    info.type = kind
    data = info.tobuf(format=tarfile.GNU_FORMAT)
    if len(data) != BLOCK:
        raise DiskkitError(name, "archive member name is too long for a single tar header")
    return data


class TarStreamWriter:
    def __init__(self, f: BinaryIO, mtime: int = 0):
        self.f = f
        self.mtime = mtime
        self._open_at: int | None = None

    def add_dir(self, name: str) -> None:
        self.f.write(_header(name.rstrip("/") + "/", 0, self.mtime, 0o755, tarfile.DIRTYPE))

    def add_bytes(self, name: str, data: bytes) -> None:
        self.f.write(_header(name, len(data), self.mtime))
        self.f.write(data)
        self._pad(len(data))

    def begin(self) -> None:
        if self._open_at is not None:
            raise RuntimeError("one entry at a time")
        self._open_at = self.f.tell()
        self.f.write(bytes(BLOCK))

    def write(self, data) -> None:
        self.f.write(data)

    def end(self, name: str) -> int:
        start = self._open_at
        assert start is not None
        size = self.f.tell() - start - BLOCK
        self._pad(size)
        here = self.f.tell()
        self.f.seek(start)
        self.f.write(_header(name, size, self.mtime))
        self.f.seek(here)
        self._open_at = None
        return size

    def cancel(self) -> None:
        """Drop the entry being written, as if it had never begun."""
        if self._open_at is not None:
            self.f.seek(self._open_at)
            self.f.truncate()
            self._open_at = None

    def close(self) -> None:
        self.f.write(bytes(2 * BLOCK))
        self.f.flush()
        os.fsync(self.f.fileno())

    def _pad(self, size: int) -> None:
        if size % BLOCK:
            self.f.write(bytes(BLOCK - size % BLOCK))

"""Chunks of a wanted disk, verified before anyone gets them: the interface every chunk source
offers (the node's cache here; the registry's ranges beside it in the disk server), and the source
that reads them from files the cache already holds."""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import stat
from functools import lru_cache
from pathlib import Path
from typing import Protocol

from diskkit.layers import lazytoc
from launcher.chunks.index import ChunkIndex, Place

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # NONBLOCK: a FIFO planted there never blocks the open


class ChunkSource(Protocol):
    def get(self, index: int) -> bytes | None:
        """Chunk `index` of the wanted disk, already checked against the TOC's content hash; None
        when this source cannot give it."""


@lru_cache(maxsize=64)
def zero_hash(hash_name: str, length: int) -> str:
    """The content hash of `length` zero bytes: such a chunk (a sparse disk's holes) needs no file."""
    return lazytoc.content_hash(hash_name, bytes(length))


def open_beneath(root: Path, relpath: str) -> int:
    """A regular file under `root` opened one component at a time, no link followed; OSError if not."""
    parts = Path(relpath).parts
    if not parts or Path(relpath).is_absolute() or ".." in parts:
        raise OSError(errno.EINVAL, f"{relpath}: not a path inside the cache")
    fd = os.open(root, _DIR)
    try:
        for part in parts[:-1]:
            next_fd = os.open(part, _DIR, dir_fd=fd)
            os.close(fd)
            fd = next_fd
        file_fd = os.open(parts[-1], _FILE, dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(file_fd).st_mode):
        os.close(file_fd)
        raise OSError(errno.EINVAL, f"{relpath}: not a regular file")
    return file_fd


class LocalChunks:
    """Chunks of the disk `toc` describes, from whatever files of the cache the index says hold
    them: each one read, hashed and given only when it matches the TOC (a file changed or corrupted
    on disk gives nothing, and its stale place leaves the index). All-zero chunks need no file."""

    def __init__(self, index: ChunkIndex, cache, toc: lazytoc.Toc):
        hashes = toc.content_hashes
        self.index, self.root, self.toc = index, Path(cache.root), toc
        self.hash_name, self.hexes = hashes if hashes is not None else (None, ())
        self.reused = 0  # bytes given
        self.stale = 0  # places whose bytes did not match

    def get(self, index: int) -> bytes | None:
        if self.hash_name is None or not 0 <= index < len(self.hexes):
            return None
        start, end = self.toc.chunk_range(index)
        length, want = end - start, self.hexes[index]
        if lazytoc.may_be_zeros(self.toc.members, index, length) and want == zero_hash(self.hash_name, length):
            self.reused += length
            return bytes(length)
        try:
            places = self.index.lookup(self.hash_name, want)
        except sqlite3.Error:  # the index is a hint: unreadable, it offers nothing
            return None
        for place in places:
            if place.length != length:
                continue
            data = self._read(place)
            if data is not None and lazytoc.content_hash(self.hash_name, data) == want:
                self.reused += length
                return data
            self.stale += 1
            with contextlib.suppress(Exception):  # a hint lost costs a fetch, never the chunk
                self.index.forget_place(self.hash_name, want, place)
        return None

    def _read(self, place: Place) -> bytes | None:
        try:
            fd = open_beneath(self.root, place.path)
        except OSError:
            return None
        try:
            data = os.pread(fd, place.length, place.offset)
        except OSError:
            return None
        finally:
            os.close(fd)
        return data if len(data) == place.length else None

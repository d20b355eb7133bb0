"""What a blob download has received so far, kept on disk so a download killed half way (even with
SIGKILL) resumes from there with one range request instead of starting over.

    <dir>/<hex>.part     the blob's first bytes, as received
    <dir>/<hex>.synced   how many of them are on disk (written after fdatasync): the resume point,
                         moved every few seconds and on every failure (by time, not bytes: a fast
                         pull does not pay for syncing data it deletes a moment later)

hashlib's state cannot be saved, so the bytes kept are not trusted on their own: they are read
back into the reader's stream, and the consumer's digest check covers them with the rest. A
download read to its end drops its partial file, whether the digest then matched or not, so bad
bytes are never offered twice. One process at a time holds a partial file (flock); gc takes those
no one holds.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

from diskkit.streams.fsutil import write_atomic

SYNC_INTERVAL = 5.0  # seconds of downloading between two resume points: what a kill can cost
MIN_SIZE = 8 << 20  # smaller blobs cost less to fetch again than to keep


class Busy(Exception):
    """Another download of the same blob holds its partial file."""


class PartialBlob:
    def __init__(self, directory: Path, digest: str):
        directory.mkdir(parents=True, exist_ok=True)
        name = digest.replace(":", "-")
        self.path = directory / f"{name}.part"
        self.mark = directory / f"{name}.synced"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise Busy(self.path) from None
        try:
            synced = int(self.mark.read_text())
        except (OSError, ValueError):
            synced = 0
        # Bytes after the resume point may be torn by the kill: they are fetched again.
        self.length = self.synced = max(0, min(synced, os.fstat(self.fd).st_size))
        os.ftruncate(self.fd, self.length)
        self.synced_at = time.monotonic()

    def read(self, offset: int, size: int) -> bytes:
        return os.pread(self.fd, min(size, self.length - offset), offset)

    def append(self, data: bytes) -> None:
        os.pwrite(self.fd, data, self.length)
        self.length += len(data)
        if time.monotonic() - self.synced_at >= SYNC_INTERVAL:
            self.sync()

    def sync(self) -> None:
        self.synced_at = time.monotonic()
        if self.length != self.synced:
            os.fdatasync(self.fd)
            write_atomic(self.mark, str(self.length).encode())
            self.synced = self.length

    def keep(self) -> None:
        """The download stopped early: what arrived is the next one's head start."""
        with contextlib.suppress(OSError):
            self.sync()
        os.close(self.fd)

    def drop(self) -> None:
        self.mark.unlink(missing_ok=True)
        self.path.unlink(missing_ok=True)
        os.close(self.fd)


def abandoned(directory: Path) -> list[Path]:
    """Files of downloads no process holds (it died or gave up), the temporary names of a mark
    written when it was killed included: gc may take them."""
    if not directory.is_dir():
        return []
    held: dict[str, bool] = {}
    found = []
    for path in sorted(directory.iterdir()):
        base = path.name.lstrip(".").split(".", 1)[0]
        if base not in held:
            held[base] = _held(directory / f"{base}.part")
        if not held[base]:
            found.append(path)
    return found


def _held(part: Path) -> bool:
    try:
        fd = os.open(part, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)

"""What a blob download has received so far, kept on disk so a download killed half way (even with
SIGKILL) resumes from there with range requests instead of starting over.

    <dir>/<hex>.part     the blob's bytes from the first kept one on, each at its own offset (the
                         bytes before it are a hole)
    <dir>/<hex>.synced   "START END": which bytes are on disk (written after fdatasync): the resume
                         point, moved every few seconds and on every failure (by time, not bytes: a
                         fast pull does not pay for syncing data it deletes a moment later); an
                         older launcher's single number is END with START 0
    <dir>/<hex>.source   where the bytes came from: registry, repository, digest and size

Keeping begins KEEP_AFTER seconds into a download, or at its first failure: a download that ends
sooner costs less to fetch again than to copy (the copy, and unlinking it once the blob is
verified, took 0.2 s of a 2 s pull of 286 MB). A resumed download fetches the bytes before the
kept ones with one range request and the rest after them with another, so a kill costs at most
KEEP_AFTER + SYNC_INTERVAL seconds of downloading.

The copy is a second write of every byte kept, so a thread of its own makes it (and its
fdatasyncs) while the download goes on; the queue between them is bounded, so memory stays flat
and a disk slower than the link holds the download back rather than falling behind. Keeping is
best effort: a failed write ends the copy (the resume point stays where it was), not the download.

hashlib's state cannot be saved, so the bytes kept are not trusted on their own: they are read
back into the reader's stream, and the consumer's digest check covers them with the rest. Nor
is a digest in the name enough to share them: a registry that lied about a digest (and cut its
answer short) would have its bytes served to the pull of the genuine image. So a partial file is
resumed only by a download from the same source; any other starts it afresh. A download read to
its end drops its partial file, whether the digest then matched or not, and one whose resumed
bytes failed (discard) too, so bad bytes are never offered twice. One process at a time holds a
partial file (flock); gc takes those no one holds.
"""

from __future__ import annotations

import fcntl
import os
import queue
import secrets
import threading
import time
from pathlib import Path

from diskkit.streams.fsutil import write_atomic

SYNC_INTERVAL = 5.0  # seconds of downloading between two resume points: what a kill can cost
KEEP_AFTER = 2.0  # seconds into a download before its bytes are kept (or its first failure)
MIN_SIZE = 8 << 20  # smaller blobs cost less to fetch again than to keep
QUEUE_DEPTH = 16  # pieces (of up to 1 MiB) received but not yet written
_SYNC, _STOP = object(), object()


class Busy(Exception):
    """Another download of the same blob holds its partial file."""


class PartialBlob:
    def __init__(self, directory: Path, digest: str, source: str, keep_after: float = KEEP_AFTER):
        """`source` names where the bytes come from (registry, repository, digest, size): kept
        bytes from any other source are not resumed from."""
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        name = digest.replace(":", "-")
        self.path = directory / f"{name}.part"
        self.mark = directory / f"{name}.synced"
        self.origin = directory / f"{name}.source"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise Busy(self.path) from None
        start, synced = _read_mark(self.mark) if _same_source(self.origin, source) else (0, 0)
        # Bytes after the resume point may be torn by the kill: they are fetched again.
        synced = min(synced, os.fstat(self.fd).st_size)
        if synced <= start:
            start = synced = 0
            # Recorded before any byte is kept: a kill at any point leaves the bytes with their source.
            self.mark.unlink(missing_ok=True)
            write_atomic(self.origin, source.encode())
        os.ftruncate(self.fd, synced)
        self.start = start  # the first byte kept
        self.length = self.synced = self.written = synced  # the end of what is kept, synced, written
        self.synced_at = self._began = time.monotonic()
        self._keep_after = keep_after
        self._due = synced > start  # appends are kept: the kept bytes go on, or keeping has begun
        self._pending: queue.Queue = queue.Queue(QUEUE_DEPTH)
        self._keeping = True
        self._marking = threading.Lock()  # no resume point is recorded once drop() has begun
        self._writer = threading.Thread(target=self._write_all, daemon=True)
        self._writer.start()

    @property
    def kept(self) -> int:
        """How many bytes an earlier download left (from `start` on)."""
        return self.length - self.start

    def read(self, offset: int, size: int) -> bytes:
        return os.pread(self.fd, min(size, self.length - offset), offset)

    def append(self, offset: int, data: bytes) -> None:
        """The blob's bytes at `offset`, as they arrived: queued to be kept (the bytes object, not a
        copy; waits while the queue is full) once keeping has begun and they follow what is kept.
        The bytes before kept ones, fetched again, are not."""
        if offset != self.length:
            if self.length > self.start:
                return
            self.start = self.length = offset  # nothing kept yet: keeping, when it begins, starts here
        if not self._due:
            if time.monotonic() - self._began < self._keep_after:
                self.start = self.length = offset + len(data)
                return
            self._due = True
            self.synced_at = time.monotonic()
        self.length += len(data)
        self._pending.put((offset, data))

    def sync(self) -> None:
        """Everything appended so far on disk and recorded as the resume point, before returning;
        when nothing is kept yet, keeping begins with the next byte (the download failed once)."""
        self._due = True
        self._pending.put(_SYNC)
        self._pending.join()

    def _write_all(self) -> None:
        while True:
            item = self._pending.get()
            try:
                if item is _STOP:
                    return
                if not self._keeping:
                    continue
                if item is _SYNC:
                    self._sync()
                    continue
                offset, data = item
                view = memoryview(data)
                while view:
                    view = view[os.pwrite(self.fd, view, offset + len(data) - len(view)):]
                self.written = offset + len(data)
                if time.monotonic() - self.synced_at >= SYNC_INTERVAL:
                    self._sync()
            except Exception:  # noqa: BLE001 - whatever failed, the queue must keep moving
                self._keeping = False  # e.g. the disk is full: the download goes on without a copy
            finally:
                self._pending.task_done()

    def _sync(self) -> None:
        self.synced_at = time.monotonic()
        if self.written != self.synced:
            os.fdatasync(self.fd)
            with self._marking:
                if not self._keeping:
                    return  # dropped meanwhile: these bytes are no one's resume point
                write_atomic(self.mark, f"{self.start} {self.written}".encode())
            self.synced = self.written

    def _stop(self, keep: bool) -> None:
        self._keeping = self._keeping and keep
        if keep:
            self._pending.put(_SYNC)
        self._pending.put(_STOP)
        self._writer.join()
        os.close(self.fd)

    def keep(self) -> None:
        """The download stopped early: what arrived is the next one's head start."""
        self._stop(keep=True)

    def drop(self) -> None:
        with self._marking:
            self._keeping = False  # what is still queued is not written, and no resume point recorded
        self.mark.unlink(missing_ok=True)  # first: nothing is resumed from what follows
        self.origin.unlink(missing_ok=True)
        # The copy's writer may be inside a write or a periodic fdatasync (0.04-0.2 s here under load),
        # and unlinking a few hundred MB of page cache took 0.1-0.6 s, waiting on the filesystem's
        # journal like the disk's fsync that follows: both are waited for beside what follows, not
        # before it, the bytes under a name no later download of the blob opens (gc takes it if the
        # process dies first: `abandoned`). Not a daemon: the interpreter waits for it at exit, so
        # the copy never outlives the download.
        gone = self.path.with_name(f".{self.path.name}.dropped-{secrets.token_hex(4)}")
        try:
            self.path.rename(gone)
        except FileNotFoundError:
            gone = None
        threading.Thread(target=self._finish_dropped, args=(gone,), name="partial-unlink").start()

    def _finish_dropped(self, gone: Path | None) -> None:
        self._stop(keep=False)
        if gone is not None:
            gone.unlink(missing_ok=True)


def _read_mark(mark: Path) -> tuple[int, int]:
    try:
        numbers = [int(n) for n in mark.read_text().split()]
    except (OSError, ValueError):
        return 0, 0
    if len(numbers) == 1:
        numbers.insert(0, 0)
    if len(numbers) != 2 or not 0 <= numbers[0] <= numbers[1]:
        return 0, 0
    return numbers[0], numbers[1]


def _same_source(origin: Path, source: str) -> bool:
    try:
        return origin.read_text() == source
    except OSError:
        return False


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

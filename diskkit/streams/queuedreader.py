"""A reader whose pieces a thread makes ahead of it, through a bounded queue.

The shared shape of the pull's threaded stages (ReadAhead, MemberInflater): a producer thread puts
pieces (bytes, or Futures of bytes a pool is still making) into a queue of `depth` at most, so
memory stays bounded; the reader takes them in order, whole pieces passing through `read` without
a copy; the producer's failure, or a Future's, is raised in the reader's thread; closing stops the
producer wherever it waits and joins it.
"""

from __future__ import annotations

import io
import queue
import threading
from concurrent.futures import Future

_END = object()


class Stopped(Exception):
    """The reader closed: the producer stops where it is."""


class QueuedReader(io.RawIOBase):
    """Subclasses set their own state, then call this __init__ (it starts the thread), and write
    `_produce`, which makes the pieces in order through `_put`."""

    def __init__(self, depth: int):
        self._queue: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._current = memoryview(b"")
        self._done = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        raise NotImplementedError

    # --- the producing thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._produce()
            self._put(_END)
        except Stopped:
            pass
        except BaseException as exc:  # handed to the reader, raised in its thread
            try:
                self._put(exc)
            except Stopped:
                pass

    def _put(self, item) -> None:
        """Waits for room, polling the stop so a closed reader never leaves this thread stuck."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue
        if isinstance(item, Future):
            item.cancel()
        raise Stopped

    # --- the reading side -------------------------------------------------------------------

    def _next(self) -> bytes | None:
        """The next piece, None at the end; a failure anywhere is raised here."""
        if self._done:
            return None
        item = self._queue.get()
        if isinstance(item, Future):
            try:
                return item.result()
            except BaseException:
                self._done = True
                raise
        if item is _END:
            self._done = True
            return None
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        # Whole pieces pass through without a copy when the caller asks for at least one.
        if size is not None and size >= 0 and not self._current:
            piece = self._next()
            if piece is None:
                return b""
            if len(piece) <= size:
                return piece
            self._current = memoryview(piece)
        return super().read(size)

    def readinto(self, buf) -> int:
        while not self._current:
            piece = self._next()
            if piece is None:
                return 0
            self._current = memoryview(piece)
        n = min(len(buf), len(self._current))
        buf[:n] = self._current[:n]
        self._current = self._current[n:]
        return n

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        super().close()

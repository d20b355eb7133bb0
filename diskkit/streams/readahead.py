"""A reader that runs its source in a thread, so the stages of a pull use both cores.

Reading a layer is three kinds of work: fetch and hash the blob, decompress and hash the tar,
parse the tar and write the disk. hashlib and ISA-L release the GIL, so each stage behind a
ReadAhead overlaps the next. Memory stays bounded: `depth` chunks of `chunk` bytes at most.
"""

from __future__ import annotations

import io
import queue
import threading
from typing import BinaryIO

_END = object()


class ReadAhead(io.RawIOBase):
    def __init__(self, source: BinaryIO, chunk: int = 1 << 20, depth: int = 4):
        self._source = source
        self._chunk = chunk
        self._queue: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._current = memoryview(b"")
        self._done = False
        self._thread = threading.Thread(target=self._fill, daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                data = self._source.read(self._chunk)
                if not data:
                    break
                self._put(data)
            self._put(_END)
        except BaseException as exc:  # handed to the reader, raised in its thread
            self._put(exc)

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self._current:
            if self._done:
                return 0
            item = self._queue.get()
            if item is _END:
                self._done = True
                return 0
            if isinstance(item, BaseException):
                self._done = True
                raise item
            self._current = memoryview(item)
        n = min(len(buf), len(self._current))
        buf[:n] = self._current[:n]
        self._current = self._current[n:]
        return n

    def read(self, size: int = -1) -> bytes:
        # Whole chunks pass through without a copy when the caller asks for at least one.
        if size is not None and size >= 0 and not self._current and not self._done:
            item = self._queue.get()
            if item is _END:
                self._done = True
                return b""
            if isinstance(item, BaseException):
                self._done = True
                raise item
            if len(item) <= size:
                return item
            self._current = memoryview(item)
        return super().read(size)

    def drain(self) -> None:
        while self.read(self._chunk):
            pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        super().close()

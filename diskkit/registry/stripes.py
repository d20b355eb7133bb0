"""A large blob fetched as consecutive byte ranges over several connections at once, read in order.

One connection carries one TCP window and, on the registry's side, one sequential file read: far
from a device or a link's throughput when the storage is cold or the registry far away. The
ranges are claimed in order by a few workers and handed to the reader in order, so the digest is
still computed as the bytes stream; at most `streams` ranges are held, whatever the blob's size.
Each range is retried where it stopped by the fetch function; a range that keeps failing fails
the read when the reader reaches it, and not before.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable

STREAMS = 3  # connections at once
STRIPE = 4 << 20  # bytes per range request: memory is STREAMS * STRIPE at most

# fetch(first, end, response) -> the pieces of bytes [first, end); `response` is an answer to that
# range already received (the probe that found the registry honours Range), or None.
Fetch = Callable[[int, int, object], list[bytes]]


class Stripes:
    def __init__(self, start: int, size: int, fetch: Fetch, first_response=None, streams: int = STREAMS, stripe: int = STRIPE):
        self.size = size
        self.stripe = stripe
        self.window = streams * stripe
        self._fetch = fetch
        self._first = first_response
        self._cond = threading.Condition()
        self._claimed = start  # where the next range no worker has taken yet starts
        self._reading = start  # where the range the reader is in starts: the window counts from here
        self._done: dict[int, list[bytes] | BaseException] = {}
        self._stopped = False
        self._at = start
        self._current: deque[bytes] = deque()
        self._workers = [threading.Thread(target=self._work, daemon=True) for _ in range(streams)]
        for worker in self._workers:
            worker.start()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and self._claimed < self.size and self._claimed - self._reading >= self.window:
                    self._cond.wait()
                if self._stopped or self._claimed >= self.size:
                    return
                first = self._claimed
                end = self._claimed = min(first + self.stripe, self.size)
                response, self._first = self._first, None  # only the first range has been asked for already
            try:
                result: list[bytes] | BaseException = self._fetch(first, end, response)
            except BaseException as exc:  # handed to the reader when it reaches this range
                result = exc
            with self._cond:
                self._done[first] = result
                self._cond.notify_all()

    def read(self, limit: int) -> bytes:
        """The next bytes in order (at most `limit`), b"" at the end of the blob."""
        if not self._current:
            if self._at >= self.size:
                return b""
            with self._cond:
                self._reading = self._at  # the ranges before are consumed: room for more
                self._cond.notify_all()
                while self._at not in self._done:
                    self._cond.wait()
                result = self._done.pop(self._at)
            if isinstance(result, BaseException):
                raise result
            self._current.extend(result)
        piece = self._current.popleft()
        if len(piece) > limit:
            self._current.appendleft(piece[limit:])
            piece = piece[:limit]
        self._at += len(piece)
        return piece

    def close(self) -> None:
        """No range is started after this; those under way end with their connections (closed by the owner)."""
        with self._cond:
            self._stopped = True
            self._done.clear()
            self._cond.notify_all()

"""The node's link to its registries, one for every lazy export of a disk server: a read a VM waits
for never queues behind prefetch.

- A demand fetch (a guest's read, the header check of an open) is sent at once; while one is in
  flight anywhere on the node, no export starts a prefetch request.
- Prefetch asks for pieces the link carries in about PIECE_TIME, measured from the bodies of the
  requests so far (each request's own share of the link: two at once each see half), so a demand
  fetch that starts meanwhile shares the link with little: on a 100 Mbit/s link about 1.2 MiB per
  piece, on loopback the largest span.
- While a guest on any export of the node boots or reads, one prefetch request at a time is in
  flight on the node: a guest's next read shares the link with one piece at most. Otherwise each
  export's prefetch threads may all fetch.
- On a slow link (below SLOW_LINK, measured) prefetch goes on past the head and read-ahead while a
  guest boots, one request at a time: the link is what a lazy boot waits for there, not the CPU,
  and the seconds a kernel boots without reading fill the disk before its init reads it.
- A prefetch request gives up its place once what is left of its answer takes the link about as
  long as a request takes to be answered (a round trip, measured): the next piece is asked for
  then, and its first bytes follow the last of the one before. Asked only once the answer was
  complete and checked, each piece left the link idle for a round trip and the checking of its
  last chunks: over 20 ms and 100 Mbit/s the head of a booting guest, which waited for it, came
  at 45 % of the link.
- What a reader waits for inside a prefetched piece is handed over when its own bytes have arrived
  (launcher.diskserver.registrychunks), not when the piece has.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

PIECE_TIME = 0.1  # seconds of the link one prefetch request holds
FIRST_SPAN = 2 << 20  # before anything was measured
MIN_SPAN = 256 << 10  # below this a request's round trip costs more than its bytes
MAX_SPAN = 8 << 20
SMOOTHING = 0.3  # weight of the newest measurement (of throughput: the fading of the older per sample)
MIN_SAMPLE = 128 << 10  # bodies shorter than this say more about latency than about the link
AHEAD_LATENCIES = 2
MAX_LATENCY = 1.0  # asked ahead for a wait this long at most: a registry slower to answer is having trouble
# A link this slow carries the rest of a disk during a boot at a CPU cost the boot does not feel:
# its checking and writing at 24 MiB/s is under half of what slowed a TCG boot on 2 cores (64 MiB/s,
# launcher.diskserver.lazydisk READ_AHEAD); a 100 Mbit/s link is 12 MiB/s.
SLOW_LINK = 24 << 20
BUSY_FOR = 1.0  # an export that said its guest is busy this recently still counts as busy


class LinkShare:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.demands = 0
        self.prefetches = 0  # prefetch requests holding a place on the link
        self.unfinished = 0  # and those that gave it up but are still coming: one more at most
        self.busy_at: dict[str, float] = {}  # export -> when its prefetcher last saw its guest busy
        self.carried = 0.0  # body bytes measured, the older fading
        self.took = 0.0  # the seconds they took, fading alike
        self.latency: float | None = None  # seconds from asking to the first bytes of the answer, smoothed

    @contextlib.contextmanager
    def demand(self) -> Iterator[None]:
        """Around a fetch a reader waits for: prefetching stands back meanwhile."""
        with self.cond:
            self.demands += 1
        try:
            yield
        finally:
            with self.cond:
                self.demands -= 1
                self.cond.notify_all()

    @contextlib.contextmanager
    def prefetch(self, export: str, busy: bool, threads: int, closing: threading.Event) -> Iterator["Place | None"]:
        """Waits until `export` may send a prefetch request: no demand fetch in flight, and fewer
        prefetch requests than `threads` (1 while a guest of any export is `busy`); yields the
        request's place on the link (given up when the block ends, or before by `Place.leave`), or
        None when `closing` was set first. Of the requests that gave up their place early, one at
        most is still coming when another is sent."""
        with self.cond:
            if busy:
                self.busy_at[export] = time.monotonic()
            else:
                self.busy_at.pop(export, None)
            while not closing.is_set() and (self.demands or self.prefetches >= (limit := self._limit(threads))
                                            or self.unfinished > limit):
                self.cond.wait(0.05)
            place = None if closing.is_set() else Place(self)
            if place is not None:
                self.prefetches += 1
                self.unfinished += 1
        try:
            yield place
        finally:
            if place is not None:
                place.leave()
                with self.cond:
                    self.unfinished -= 1
                    self.cond.notify_all()

    def _limit(self, threads: int) -> int:
        now = time.monotonic()
        for export, at in list(self.busy_at.items()):
            if now - at >= BUSY_FOR:
                del self.busy_at[export]
        return 1 if self.busy_at else max(1, threads)

    @property
    def throughput(self) -> float | None:
        """Body bytes a second one request got, smoothed (None before any was measured)."""
        return self.carried / self.took if self.took else None

    def span(self) -> int:
        """Bytes the next prefetch request asks for."""
        if self.throughput is None:
            return FIRST_SPAN
        return int(min(MAX_SPAN, max(MIN_SPAN, self.throughput * PIECE_TIME)))

    def slow(self) -> bool:
        """The link, as measured so far, is slower than SLOW_LINK (unmeasured: not)."""
        return self.throughput is not None and self.throughput < SLOW_LINK

    def ahead(self) -> int:
        """Bytes of a prefetch answer still to come when the next request may be sent: what the link
        carries while a request waits for its first bytes, twice (0 before both were measured). Once
        for the request's way, once for this host's: the thread that sends the next one has to wake
        and claim it, which on a host busy booting VMs took as long as a 20 ms round trip."""
        if self.throughput is None or self.latency is None:
            return 0
        return int(self.throughput * min(AHEAD_LATENCIES * self.latency, MAX_LATENCY))

    def measured(self, nbytes: int, seconds: float, latency: float | None = None) -> None:
        """A response body of `nbytes` that took `seconds` from its first byte to its last, asked for
        `latency` seconds before its first bytes came."""
        with self.cond:
            if latency is not None and latency >= 0:
                self.latency = latency if self.latency is None else (1 - SMOOTHING) * self.latency + SMOOTHING * latency
            if nbytes < MIN_SAMPLE or seconds <= 0:
                return
            # Each body weighs the seconds it took: one that came in a burst (a link idle a moment,
            # the bytes already in its buffers: 150 KiB in 2 ms on an 8 MiB/s link) says little of
            # its rate, and as a sample of its own it made a slow link fast until prefetch, held for
            # a fast link, measured again; that waited for the guest to stop reading.
            keep = 1 - SMOOTHING
            self.carried = keep * self.carried + nbytes
            self.took = keep * self.took + seconds


class Place:
    """A prefetch request's place on the link."""

    def __init__(self, link: LinkShare):
        self.link = link
        self.left = False

    def leave(self) -> None:
        """The answer's last bytes are on their way: another prefetch request may be sent (once)."""
        with self.link.cond:
            if self.left:
                return
            self.left = True
            self.link.prefetches -= 1
            self.link.cond.notify_all()

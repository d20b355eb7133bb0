"""Where a lazy layer's disk chunks end (TOC v3): content-defined cut points, so a run of bytes that
is unchanged keeps its chunks wherever an update moved it.

A fixed grid of chunks loses every chunk after the first inserted or removed byte: `qemu-img convert
-c` packs compressed clusters at byte offsets, so one changed cluster shifts all later ones and a
rebuilt qcow2 shared almost no 1 MiB window with its previous build. Here a chunk ends where a
rolling hash of the last bytes read says so, as casync and restic cut theirs: FastCDC 2020 (Xia et
al., gear hash, cut-point skipping), as pyfastcdc 0.3 implements it in C (its gear table is the
paper's reference code's, normalized chunking level 1). The hash starts afresh at every chunk
start, `min` bytes in; a cut follows the first position whose hash has its `min.bit_length() - 2`
masked bits clear, or `max` bytes, so chunks average about 1.5 `min`. `avg` is pyfastcdc's centre
of normalization, set to `min`: then the skipped bytes are never hashed (twice the speed of
avg = 2 min, for the same reuse on the rebuilt pairs bench/delta.py measures).

The parameters follow the disk's size: every chunk but the last is at least `min` bytes, so a TOC
never lists more than lazytoc.MAX_CHUNKS chunks (and stays under its size bound) whatever the
content; `min` doubles from 128 KiB until that holds. pyfastcdc cuts no more than 1 MiB minimum,
so a disk over 16 GiB keeps fixed chunks (TOC v2).

`Cutter` cuts a stream given as pieces of recycled buffers (diskkit.streams.pieceread) in one pass:
a chunk inside a piece is handed on as a view of it, uncopied, and the piece goes back to its
reader once every chunk cut from it has been released; only a chunk that spans two pieces is
copied.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pyfastcdc.cy import FastCDC  # the compiled one: pyfastcdc's pure-Python fallback is a hundred times slower

from diskkit.layers import lazytoc

MIN_CUT = 128 << 10  # chunks of ~190 KiB: 4.7 MiB fetched for bench/delta.py's rebuilt Debian pair, 7.7 MiB at 256 KiB
MAX_FACTOR = 8  # a chunk ends at 8 * min at the latest: 1 MiB, the fixed chunks' size, for disks up to 2 GiB
LARGEST_MIN = 1 << 20  # pyfastcdc's bound on min

Release = Callable[[], None]


@dataclass(frozen=True)
class Params:
    min: int
    max: int

    def chunker(self) -> FastCDC:
        return FastCDC(self.min, min_size=self.min, max_size=self.max, normalized_chunking=1)


def params_for(size: int) -> Params | None:
    """The cut parameters for a disk of `size` bytes; None when it must keep fixed chunks."""
    low = MIN_CUT
    while -(-size // low) > lazytoc.MAX_CHUNKS:
        low *= 2
    return Params(low, low * MAX_FACTOR) if low <= LARGEST_MIN else None


class _Lent:
    """One piece lent to the chunks cut from it: handed back once the cutter and every chunk let go."""

    def __init__(self, release: Release):
        self._release = release
        self._holders = 1  # the cutter's own, until it has cut the piece
        self._lock = threading.Lock()

    def hold(self) -> Release:
        with self._lock:
            self._holders += 1
        return self.drop

    def drop(self) -> None:
        with self._lock:
            self._holders -= 1
            done = self._holders == 0
        if done:
            self._release()


class Cutter:
    """A stream's chunks from its pieces, in order: `feed` each piece, then `finish`. Each chunk comes
    as (a view, release): the release (None for a chunk copied out of two pieces) hands the view's
    piece back once called, from any thread."""

    def __init__(self, params: Params):
        self.params = params
        self._cdc = params.chunker()
        self._carry: list[memoryview] = []  # the bytes after the last cut, the start of the next chunk,
        self._holds: list[Release] = []  # ... kept as views of their pieces until that chunk is cut
        self._carried = 0

    def feed(self, piece: memoryview, release: Release | None = None) -> Iterator[tuple[memoryview, Release | None]]:
        lent = _Lent(release or (lambda: None))
        try:
            at = 0  # the piece's bytes cut or carried so far
            while self._carried:
                # A chunk began in an earlier piece: its end is found with as few bytes after it as
                # tell, copied out with it (a chunk's whole length at most).
                carried, most = self._carried, min(len(piece) - at, self.params.max - self._carried)
                take = min(most, max(self.params.min + self.params.min // 2 - carried, 4096))
                while True:
                    joined = memoryview(b"".join([*self._carry, piece[at : at + take]]))
                    first = next(iter(self._cdc.cut_buf(joined))).length
                    if first < len(joined) or first == self.params.max or take == most:
                        break
                    take = min(most, 2 * take)
                if first == len(joined) and first < self.params.max:
                    self._keep(piece[at:], lent.hold())  # no cut before the piece's end
                    return
                yield joined[:first], None
                self._drop()
                if first < carried:  # a cut the end of an earlier piece hid (the cutter steps two bytes at a time)
                    self._keep(joined[first:carried], None)
                else:
                    at += first - carried
            rest = piece[at:]
            for chunk in self._cdc.cut_buf(rest):
                if chunk.offset + chunk.length == len(rest) and chunk.length < self.params.max:
                    self._keep(chunk.data, lent.hold())  # cut by the piece's end, not the content
                    return
                yield chunk.data, lent.hold()
        finally:
            lent.drop()

    def _keep(self, view: memoryview, hold: Release | None) -> None:
        self._carry.append(view)
        self._carried += len(view)
        if hold is not None:
            self._holds.append(hold)

    def _drop(self) -> None:
        holds, self._carry, self._holds, self._carried = self._holds, [], [], 0
        for hold in holds:
            hold()

    def finish(self) -> Iterator[tuple[memoryview, Release | None]]:
        """The chunks of the bytes after the last cut: the stream's end is a cut."""
        if not self._carried:
            return
        carry = memoryview(b"".join(self._carry))
        self._drop()
        for chunk in self._cdc.cut_buf(carry):
            yield chunk.data, None

    def close(self) -> None:
        """Hands back the pieces a stream given up half-way still holds."""
        self._drop()


def cut(pieces, params: Params) -> Iterator[tuple[memoryview, Release | None]]:
    """Every chunk of a stream of (piece, release) pairs."""
    cutter = Cutter(params)
    for piece, release in pieces:
        yield from cutter.feed(piece, release)
    yield from cutter.finish()

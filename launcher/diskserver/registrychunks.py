"""The registry's ranges as a chunk source: one range request per run of chunks, each chunk cut out
of it and checked against the TOC before anyone can read it. A v2 TOC pins each chunk's gzip
member as stored (memberBlake3s, or memberDigests): the member's bytes are checked before they are
inflated, then its inflated length; TOCs written before that pin the uncompressed chunk, checked
once inflated. A layer without a TOC gives its chunks unchecked (the blob digest at the end is all).

Chunks are handed on as their bytes arrive, not when the whole range has: a reader waiting for the
first chunk of a prefetched run gets it after that chunk's bytes, not the run's. Blob bytes an open
fetched before the export existed (launcher.diskserver.firstbytes: the disk's first members, its
last ones before the TOC) are not asked for again: a run that begins or ends in them asks only for
the rest, and they are checked as any fetched byte is."""

from __future__ import annotations

import hashlib
import time
from typing import Callable, Sequence

from diskkit.errors import DiskkitError
from diskkit.layers import lazytoc
from launcher.diskserver.blobranges import BlobRanges
from launcher.diskserver.chunksources import Chunk, Sink, Taken
from launcher.diskserver.firstbytes import held_ends
from launcher.diskserver.layout import Layout
from launcher.diskserver.linkshare import LinkShare


class RegistryChunks:
    reused = False

    def __init__(self, layout: Layout, ranges: BlobRanges, held: Sequence[tuple[int, bytes]] = (),
                 link: LinkShare | None = None):
        """`held`: blob bytes already fetched, as (offset, bytes).
        `link`: told how long each answer took to begin and how fast its body came; says when the
        rest of an answer is what the link carries in that wait."""
        self.layout = layout
        self.ranges = ranges
        self.held = list(held)
        self.link = link

    def _blob_span(self, first: int, end: int) -> tuple[int, int]:
        lay = self.layout
        if lay.members is None:
            return lay.offset + lay.chunk_range(first)[0], lay.offset + lay.chunk_range(end - 1)[1]
        return lay.members[first][0], sum(lay.members[end - 1])

    def take(self, first: int, end: int, sink: Sink | None = None, ending: Callable[[], None] | None = None) -> Taken:
        """Chunks [first, end); `sink(index, chunk)` is called for each good one as soon as it is checked,
        `ending()` once what is left of the answer takes the link about as long as an answer takes
        to begin (launcher.diskserver.linkshare: the next piece is asked for then)."""
        taken = Taken()
        start, stop = self._blob_span(first, end)
        front, back = held_ends(self.held, start, stop)
        middle = (start + len(front), stop - len(back))
        parts: list[tuple[int, bytes | bytearray]] = [(start, front)]
        done = [first]

        def ready(have: int) -> None:
            """Each chunk whose bytes are all here (up to blob offset `have`) is cut, checked and handed on."""
            while done[0] < end and self._blob_span(done[0], done[0] + 1)[1] <= have:
                self._cut(_bytes(parts, *self._blob_span(done[0], done[0] + 1)), done[0], taken, sink)
                done[0] += 1

        try:
            ready(middle[0])
            if middle[1] > middle[0]:
                buf = bytearray()
                parts.append((middle[0], buf))
                first_piece: list[tuple[float, int]] = []
                wanted = middle[1] - middle[0]
                ahead = self.link.ahead() if self.link is not None and ending is not None else 0

                def arrived(grown: bytearray) -> None:
                    if not first_piece:
                        first_piece.append((time.monotonic(), len(grown)))
                    buf[len(buf):] = grown[len(buf):]
                    if ahead and wanted - len(buf) <= ahead:
                        ending()  # before the chunks are checked: the next request is on its way meanwhile
                    ready(middle[0] + len(buf))

                asked = time.monotonic()
                data = self.ranges.read(middle[0], wanted, arrived if sink is not None else None)
                buf[len(buf):] = data[len(buf):]
                if first_piece and self.link is not None:
                    at, nbytes = first_piece[0]
                    self.link.measured(len(data) - nbytes, time.monotonic() - at, at - asked)
            parts.append((middle[1], back))
            ready(stop)
        except _SinkFailed as failed:
            raise failed.error from None
        taken.nbytes += middle[1] - middle[0]  # the held bytes were counted when the export took them
        if taken.bad and (front or back):
            self.held = []  # what came before may be what failed: asked of the registry from now on
        return taken

    def _cut(self, stored: bytes | memoryview, index: int, taken: Taken, sink: Sink | None) -> None:
        chunk = self._chunk(stored, index)
        if chunk is None:
            taken.bad.append(index)
            return
        if sink is not None:
            try:
                sink(index, chunk)
            except OSError as exc:  # the export's file, not the registry: never retried as a dropped connection
                raise _SinkFailed(exc) from None
        taken.chunks[index] = chunk

    def get(self, index: int) -> bytes | None:
        try:
            chunk = self.take(index, index + 1).chunks.get(index)
        except DiskkitError:
            return None
        return bytes(chunk.data) if chunk is not None else None

    def _chunk(self, stored: bytes | memoryview, index: int) -> Chunk | None:
        """Chunk `index` from its bytes in the blob (v2: its member as stored); None for one that does
        not match its pins or inflate to exactly the chunk's length."""
        lay = self.layout
        low, high = lay.chunk_range(index)
        if lay.members is None:
            piece, stored = stored, None
        else:
            if lay.member_digests is not None and lazytoc.member_pin(lay.member_hash, stored) != lay.member_digests[index]:
                return None  # never inflated: zlib sees only bytes the TOC vouches for
            try:
                piece = lazytoc.inflate(stored, high - low, f"chunk {index}")
            except DiskkitError:
                return None
            if len(piece) != high - low:
                return None
        if lay.chunks is not None and hashlib.sha256(piece).hexdigest() != lay.chunks[index]:
            return None
        return Chunk(piece, stored)


def _bytes(parts: list[tuple[int, bytes | bytearray]], low: int, high: int) -> bytes:
    """Blob bytes [low, high) out of consecutive parts (offset, bytes), copied: a part still growing moves."""
    out = bytearray()
    for at, data in parts:
        lo, hi = max(low, at), min(high, at + len(data))
        if lo < hi:
            out += data[lo - at : hi - at]
    return bytes(out)


class _SinkFailed(Exception):
    def __init__(self, error: OSError):
        super().__init__(str(error))
        self.error = error

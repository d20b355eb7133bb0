"""The registry's ranges as a chunk source: one range request per run of chunks, each chunk cut out
of it and checked against the TOC before anyone can read it. A v2 TOC pins each chunk's gzip
member as stored (memberBlake3s, or memberDigests): the member's bytes are checked before they are
inflated, then its inflated length; TOCs written before that pin the uncompressed chunk, checked
once inflated. A layer without a TOC gives its chunks unchecked (the blob digest at the end is all)."""

from __future__ import annotations

import hashlib

from diskkit.errors import DiskkitError
from diskkit.layers import lazytoc
from launcher.diskserver.blobranges import BlobRanges
from launcher.diskserver.chunksources import Chunk, Taken
from launcher.diskserver.layout import Layout


class RegistryChunks:
    reused = False

    def __init__(self, layout: Layout, ranges: BlobRanges):
        self.layout = layout
        self.ranges = ranges

    def take(self, first: int, end: int) -> Taken:
        lay = self.layout
        if lay.members is None:
            start, stop = lay.offset + lay.chunk_range(first)[0], lay.offset + lay.chunk_range(end - 1)[1]
        else:
            start, stop = lay.members[first][0], sum(lay.members[end - 1])
        data = self.ranges.read(start, stop - start)
        view = memoryview(data)
        taken = Taken(nbytes=len(data))
        for index in range(first, end):
            chunk = self._chunk(view, start, index)
            if chunk is None:
                taken.bad.append(index)
            else:
                taken.chunks[index] = chunk
        return taken

    def get(self, index: int) -> bytes | None:
        try:
            chunk = self.take(index, index + 1).chunks.get(index)
        except DiskkitError:
            return None
        return bytes(chunk.data) if chunk is not None else None

    def _chunk(self, view: memoryview, start: int, index: int) -> Chunk | None:
        """Chunk `index` out of the blob bytes fetched from `start`, with (v2) its member as stored;
        None for one that does not match its pins or inflate to exactly the chunk's length."""
        lay = self.layout
        low, high = lay.chunk_range(index)
        if lay.members is None:
            piece = view[low + lay.offset - start : high + lay.offset - start]
            stored = None
        else:
            at, length = lay.members[index]
            stored = view[at - start : at - start + length]
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

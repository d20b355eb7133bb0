"""A lazy v2 layer (lazytoc) inflated on every core while its blob streams past once.

A gzip stream inflates on one core: each byte's meaning hangs on the bytes before it. A v2 layer
is one gzip member per disk chunk, and its TOC says where each member is, so one thread cuts the
blob into members as it arrives and a small pool inflates them side by side (ISA-L releases the
GIL); their outputs leave in stream order, so the diffID, the tar parser and the sparse writer
behind this reader see what a serial inflater would have given them. The bytes around the chunks
(tar headers, other files, the TOC, the trailer) are gzip members too, inflated here in order.

Each chunk's member is checked against its pin in the TOC before the inflater sees it (or, for
TOCs that pin the uncompressed chunk, its output after), must be exactly one member and inflate
to exactly the chunk's length; a member the TOC places where the stream has no member boundary is
refused. The blob digest and the diffID are checked as before, by the readers around this one.
Memory stays flat: the members in flight are bounded in bytes, whatever the disk's size, and each
member's length was bounded by its chunk's when the TOC was parsed (lazytoc.parse, diskkit.limits).
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, Iterator

from isal import isal_zlib

from diskkit.errors import DiskkitError
from diskkit.layers.lazytoc import Toc, member_pin
from diskkit.streams.queuedreader import QueuedReader

WORKERS = os.cpu_count() or 2
IN_FLIGHT_BYTES = 8 << 20  # chunks inflating or inflated and not yet read, beyond one per worker
PASS = 1 << 20  # the bytes around the chunks are read and inflated in pieces of this size


def _inflate(member: bytes, toc: Toc, index: int, where: str) -> bytes:
    at, length = toc.members[index]
    name = f"chunk {index}'s gzip member at {at}+{length}"
    if toc.member_digests is not None and member_pin(toc.member_hash, member) != toc.member_digests[index]:
        raise DiskkitError(where, f"{name} does not match its digest in the lazy TOC")
    start, end = toc.chunk_range(index)
    inflater = isal_zlib.decompressobj(31)
    try:
        out = inflater.decompress(member, end - start + 1)  # one byte of room: a longer member is seen
    except isal_zlib.error as exc:
        raise DiskkitError(where, f"{name} is not a gzip member ({exc})") from None
    if len(out) != end - start or not inflater.eof or inflater.unused_data or inflater.unconsumed_tail:
        raise DiskkitError(where, f"{name} is not one gzip member of the chunk's {end - start} bytes")
    if toc.member_digests is None and hashlib.sha256(out).hexdigest() != toc.chunks[index]:
        raise DiskkitError(where, f"the lazy TOC's digest of chunk {index} does not match {name}")
    return out


class _Around:
    """The gzip members around the chunks', inflated in order, in pieces of at most PASS bytes."""

    def __init__(self, where: str):
        self._where = where
        self._inflater = None  # the member being inflated; None between members

    @property
    def between_members(self) -> bool:
        return self._inflater is None

    def feed(self, data: bytes) -> Iterator[bytes]:
        while data:
            if self._inflater is None:
                self._inflater = isal_zlib.decompressobj(31)
            try:
                out = self._inflater.decompress(data, PASS)
                # Output held back by the limit comes with the next call, even when all input was taken.
                while len(out) == PASS and not self._inflater.eof and not self._inflater.unconsumed_tail:
                    yield out
                    out = self._inflater.decompress(b"", PASS)
            except isal_zlib.error as exc:
                raise DiskkitError(self._where, f"gzip stream cannot be decompressed ({exc}); refused") from None
            if out:
                yield out
            if self._inflater.eof:
                data = self._inflater.unused_data
                self._inflater = None
            else:
                data = self._inflater.unconsumed_tail


class MemberInflater(QueuedReader):
    """The uncompressed layer, in order, from `raw` (the blob as it streams) and its parsed `toc`."""

    def __init__(self, raw: BinaryIO, toc: Toc, where: str, workers: int = WORKERS):
        if toc.members is None:
            raise ValueError("only a version-2 TOC lists gzip members")
        self._raw, self._toc, self._where = raw, toc, where
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="inflate")
        self._pending = memoryview(b"")  # read from `raw`, not yet cut (the feeding thread's)
        # The queue holds the inflating chunks' Futures and the pieces between them, in stream order.
        super().__init__(workers + max(1, IN_FLIGHT_BYTES // toc.grid.mean))

    # --- the feeding thread: the blob cut into members, in order --------------------------------

    def _produce(self) -> None:
        around = _Around(self._where)
        position = 0
        for index, (at, length) in enumerate(self._toc.members):
            while position < at:
                data = self._read(min(PASS, at - position))
                if not data:
                    raise DiskkitError(self._where, f"the blob ends before chunk {index}'s gzip member at {at}")
                position += len(data)
                for out in around.feed(data):
                    self._put(out)
            if not around.between_members:
                raise DiskkitError(self._where, f"the lazy TOC places chunk {index}'s gzip member at {at}, inside another gzip member of the layer")
            member = self._read(length)
            if len(member) != length:
                raise DiskkitError(self._where, f"the blob ends inside chunk {index}'s gzip member at {at}+{length}")
            position += length
            self._put(self._pool.submit(_inflate, member, self._toc, index, self._where))
        while data := self._read(PASS):
            for out in around.feed(data):
                self._put(out)
        if not around.between_members:
            raise DiskkitError(self._where, "gzip stream cannot be decompressed (it ends inside a member); refused")

    def _read(self, size: int):
        """Up to `size` bytes (fewer only at the end): a view of the stream's own chunk when they lie
        in one, joined only across chunks. Whole chunks are asked for, which readers pass on uncopied."""
        if len(self._pending) >= size:
            out, self._pending = self._pending[:size], self._pending[size:]
            return out
        parts, left = ([self._pending] if self._pending else []), size - len(self._pending)
        self._pending = memoryview(b"")
        while left and (data := self._raw.read(PASS)):
            view = memoryview(data)
            parts.append(view[:left])
            self._pending = view[left:]
            left -= len(parts[-1])
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        super().close()
        self._pool.shutdown(wait=True, cancel_futures=True)

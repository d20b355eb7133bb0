"""A lazy v2 layer's gzip members checked against the TOC's member pins as the blob streams by.

`diskkit verify` reads each blob once; this reader sits between the blob and the inflater and
holds each chunk's member until all of it has arrived and hashes to its pin, so the inflater only
ever sees bytes the TOC vouches for, and a member that differs is named (the blob digest alone
would say only that the layer is wrong, and only at its end).
"""

from __future__ import annotations

import io
from typing import BinaryIO

from diskkit.errors import DiskkitError
from diskkit.layers.lazytoc import Toc, member_pin

PASS = 1 << 20  # bytes outside the members (tar headers, TOC, trailer) pass in pieces of this size


class MemberCheck(io.RawIOBase):
    def __init__(self, raw: BinaryIO, toc: Toc, where: str):
        if toc.members is None or toc.member_digests is None:
            raise ValueError("only a TOC with member pins (memberBlake3s, memberDigests) pins gzip members")
        self._raw, self._toc, self._where = raw, toc, where
        self._position = 0  # in the blob: the next byte read from `raw`
        self._index = 0  # the next member to check
        self._ready = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self._ready:
            data = self._next()
            if not data:
                return 0
            self._ready = memoryview(data)
        n = min(len(buf), len(self._ready))
        buf[:n] = self._ready[:n]
        self._ready = self._ready[n:]
        return n

    def _next(self) -> bytes:
        members = self._toc.members
        if self._index == len(members):
            return self._read(PASS)
        at, length = members[self._index]
        if self._position < at:
            return self._read(min(PASS, at - self._position))
        member = self._read(length)
        if len(member) != length:
            raise DiskkitError(self._where, f"the blob ends inside chunk {self._index}'s gzip member at {at}+{length}")
        if member_pin(self._toc.member_hash, member) != self._toc.member_digests[self._index]:
            raise DiskkitError(self._where, f"chunk {self._index}'s gzip member at {at}+{length} does not match its digest in the lazy TOC")
        self._index += 1
        return member

    def _read(self, size: int) -> bytes:
        parts, left = [], size
        while left:
            piece = self._raw.read(left)
            if not piece:
                break
            parts.append(piece)
            left -= len(piece)
        data = b"".join(parts)
        self._position += len(data)
        return data

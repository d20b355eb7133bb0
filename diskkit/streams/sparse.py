"""Disk images written sparse: aligned zero runs become holes instead of allocated blocks."""

from __future__ import annotations

from typing import BinaryIO

from diskkit.streams.directwrite import PIECE, DirectWriter
from diskkit.streams.fsutil import Writeback

HOLE = 64 << 10  # a multiple of any filesystem's block size, so a skipped run is a whole hole
assert PIECE % HOLE == 0  # a direct write never ends inside a block
_ZEROS = bytes(HOLE)


def write_sparse(out: BinaryIO, data) -> None:
    """Write `data` at out's position, seeking over HOLE-aligned all-zero pieces.

    Pieces are cut at file offsets that are multiples of HOLE, so holes line up with blocks
    whatever the caller's chunking. The caller truncates to the final size, since a trailing hole
    does not extend the file.
    """
    view = memoryview(data)
    at = 0
    first = -out.tell() % HOLE or HOLE
    while at < len(view):
        piece = view[at : at + (first if at == 0 else HOLE)]
        # bytes.startswith compares with memcmp; comparing memoryviews goes byte by byte.
        if _ZEROS.startswith(piece):
            out.seek(len(piece), 1)
        else:
            out.write(piece)
        at += len(piece)


class SparseWriter:
    """A disk image written sparse into `out`, its pages sent to the device as it grows."""

    def __init__(self, out: BinaryIO):
        self._out = out
        self._writeback = Writeback(out)

    def write(self, data) -> None:
        write_sparse(self._out, data)
        self._writeback()


class SparseDirectWriter(DirectWriter):
    """A disk image written once, front to back, with O_DIRECT (DirectWriter: no page-cache copy,
    nothing left to write back at the fsync), each HOLE-aligned block of zeros left a hole as
    write_sparse leaves it. Blocks are judged whole, once assembled in the buffer, so holes line up
    with the filesystem's blocks whatever sizes the data comes in, and every direct write starts
    on a block boundary. `close` sets the file's length."""

    def write(self, data: bytes | memoryview) -> None:
        if self.error is not None:
            raise self.error
        view = memoryview(data).cast("B")
        while view:
            n = min(len(view), HOLE - self._fill % HOLE)
            self._buf[self._fill:self._fill + n] = view[:n]
            self._fill += n
            view = view[n:]
            if self._fill % HOLE:
                continue
            # bytes.startswith compares with memcmp; comparing memoryviews goes byte by byte.
            if _ZEROS.startswith(memoryview(self._buf)[self._fill - HOLE:self._fill]):
                self._fill -= HOLE
                self._skip(HOLE)
            elif self._fill == PIECE:
                self._hand_over(PIECE)

    def close(self) -> None:
        tail = self._fill % HOLE  # a last, partial block: a hole too when it is all zeros
        if tail and _ZEROS.startswith(memoryview(self._buf)[self._fill - tail:self._fill]):
            self._fill -= tail
            self._skip(tail)  # the file's length comes from close's truncate
        super().close()

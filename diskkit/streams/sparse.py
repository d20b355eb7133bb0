"""Disk images written sparse: aligned zero runs become holes instead of allocated blocks."""

from __future__ import annotations

from typing import BinaryIO

from diskkit.streams.fsutil import Writeback

HOLE = 64 << 10  # a multiple of any filesystem's block size, so a skipped run is a whole hole
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

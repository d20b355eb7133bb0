"""The pull's stream pieces: the forward-only cursor tarfile reads through, and sparse writes."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from diskkit.streams.cursor import Cursor
from diskkit.streams.fsutil import WRITEBACK_STEP, Writeback
from diskkit.streams.sparse import HOLE, write_sparse


class Chunked:
    """A source that hands out uneven chunks, as a decompressor does."""

    def __init__(self, data: bytes, sizes: list[int]):
        self.data, self.sizes, self.at = data, sizes, 0

    def read(self, size: int = -1) -> bytes:
        n = min(size, self.sizes[0] if self.sizes else size)
        if self.sizes:
            self.sizes.append(self.sizes.pop(0))
        piece = self.data[self.at : self.at + n]
        self.at += len(piece)
        return piece


def test_cursor_reads_exactly_across_chunks_and_seeks_forward_only():
    data = bytes(range(256)) * 40
    cursor = Cursor(Chunked(data, [7, 300, 1, 4096]), chunk=4096)
    assert cursor.read(512) == data[:512]
    assert cursor.tell() == 512
    assert cursor.seek(2000) == 2000
    views = list(cursor.views(5000))
    assert b"".join(views) == data[2000:7000]
    assert all(isinstance(v, memoryview) for v in views)
    with pytest.raises(io.UnsupportedOperation, match="cannot seek back from 7000 to 100"):
        cursor.seek(100)
    assert cursor.read() == data[7000:]
    assert cursor.read(10) == b""
    assert cursor.seek(len(data) + 99) == len(data)  # past the end stops at the end, as a pipe would


def test_tarfile_reads_an_archive_through_the_cursor(tmp_path):
    # pax headers, a GNU long name and a sparse file: every header tarfile reads with extra blocks
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, body in [("d/" + "x" * 150, b"long"), ("disk/disk.img", os.urandom(70000)), ("é", b"")]:
            info = tarfile.TarInfo(name)
            info.size = len(body)
            info.pax_headers = {"comment": "z" * 900}
            tar.addfile(info, io.BytesIO(body))
    raw = buf.getvalue()
    cursor = Cursor(Chunked(raw, [1000, 3, 65536]), chunk=65536)
    seen = {}
    with tarfile.open(fileobj=cursor, mode="r:") as tar:
        for member in tar:
            assert cursor.tell() == member.offset_data
            if member.name.startswith("disk"):
                seen[member.name] = b"".join(cursor.views(member.size))
            else:
                seen[member.name] = None
    assert seen.keys() == {"d/" + "x" * 150, "disk/disk.img", "é"}
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        assert seen["disk/disk.img"] == tar.extractfile("disk/disk.img").read()


def test_sparse_writes_leave_aligned_zero_runs_as_holes(tmp_path):
    data = b"a" * 1000 + bytes(5 * HOLE) + b"b" * 10 + bytes(3 * HOLE)
    path = tmp_path / "disk.img"
    with open(path, "wb") as out:
        # chunks that never line up with HOLE: the holes must still be cut at file offsets
        for at in range(0, len(data), 50_001):
            write_sparse(out, data[at : at + 50_001])
        out.truncate()
    assert path.read_bytes() == data
    assert os.stat(path).st_size == len(data)
    # Allocated: within the HOLE-aligned pieces holding the a's and the b's, nothing else.
    b_piece = (1000 + 5 * HOLE) // HOLE * HOLE
    with open(path, "rb") as f:
        fd = f.fileno()
        assert os.lseek(fd, 0, os.SEEK_HOLE) <= HOLE
        assert os.lseek(fd, HOLE, os.SEEK_DATA) == b_piece
        assert os.lseek(fd, b_piece, os.SEEK_HOLE) <= b_piece + HOLE
        with pytest.raises(OSError):
            os.lseek(fd, b_piece + HOLE, os.SEEK_DATA)  # no data after the b's


def _dirty_bytes() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("Dirty:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no Dirty in /proc/meminfo")


def test_writeback_starts_before_the_fsync(tmp_path):
    path = tmp_path / "disk.img"
    block = os.urandom(1 << 20)
    os.sync()
    before = _dirty_bytes()
    with open(path, "wb") as out:
        writeback = Writeback(out)
        for _ in range(4 * WRITEBACK_STEP // len(block)):
            out.write(block)
            writeback()
        # Without it all 4 steps would wait in the page cache for the fsync; at most the last
        # step and whatever the rest of the machine dirtied meanwhile may be left.
        dirty = _dirty_bytes() - before
        assert dirty < 2 * WRITEBACK_STEP, f"{dirty >> 20} MiB dirty after writing {4 * WRITEBACK_STEP >> 20} MiB"
        out.flush()
        os.fsync(out.fileno())

"""The pull's stream pieces: the read-ahead thread, the forward-only cursor tarfile reads through, and sparse writes."""

from __future__ import annotations

import io
import os
import tarfile
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from diskkit.errors import DiskkitError
from diskkit.layers import lazygzip
from diskkit.layers.layer import entries_for
from diskkit.streams.cursor import Cursor
from diskkit.streams.directwrite import PIECE, DirectWriter
from diskkit.streams.fsutil import WRITEBACK_STEP, Writeback
from diskkit.streams.pieceread import IN_FLIGHT, PieceReader, resident_fraction
from diskkit.streams.readahead import ReadAhead
from diskkit.streams.sparse import HOLE, SparseDirectWriter, write_sparse


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


class Pieces:
    """A source handing out the given pieces, then failing with `fail` (or ending)."""

    def __init__(self, pieces: list[bytes], fail: Exception | None = None):
        self.pieces, self.fail = list(pieces), fail

    def read(self, size: int = -1) -> bytes:
        if self.pieces:
            return self.pieces.pop(0)
        if self.fail is not None:
            raise self.fail
        return b""


def test_read_ahead_hands_whole_pieces_on_uncopied_and_cuts_them_for_smaller_reads():
    pieces = [bytes([n]) * 1000 for n in range(1, 6)]
    with ReadAhead(Pieces(pieces), chunk=1000, depth=2) as reader:
        assert reader.read(1000) is pieces[0]  # asked for at least a piece: that very object
        assert reader.read(300) == pieces[1][:300]
        buf = bytearray(2000)
        assert reader.readinto(buf) == 700 and buf[:700] == pieces[1][300:]
        assert reader.read() == b"".join(pieces[2:])
        assert reader.read(10) == b""


def test_read_ahead_raises_its_sources_failure_in_the_readers_thread_after_the_pieces_before_it():
    with ReadAhead(Pieces([b"a" * 10, b"b" * 10], OSError("the source broke")), depth=1) as reader:
        assert reader.read(10) == b"a" * 10 and reader.read(10) == b"b" * 10
        with pytest.raises(OSError, match="the source broke"):
            reader.read(10)
        assert reader.read(10) == b""  # the failure is raised once; the reader is at its end


def test_closing_a_read_ahead_stops_a_producer_waiting_for_room():
    class Endless:
        def read(self, size: int = -1) -> bytes:
            return b"x" * size

    before = set(threading.enumerate())
    reader = ReadAhead(Endless(), chunk=4096, depth=1)
    producers = set(threading.enumerate()) - before
    assert reader.read(4096) == b"x" * 4096 and producers
    reader.close()  # the producer is blocked on the full queue: it must see the stop and end
    assert not any(thread.is_alive() for thread in producers)


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


def _evict(path):
    """Drop the file's pages from the page cache (written back first), as a cold disk after a reboot."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _resident(path) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        return resident_fraction(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _read_all(reader) -> bytes:
    out = bytearray()
    for view, release in reader:
        out += view
        release()
    return bytes(out)


def test_piece_reader_reads_a_cold_file_around_the_page_cache_and_a_cached_one_through_it(tmp_path):
    path = tmp_path / "disk.img"
    content = os.urandom((5 << 20) + 1000)  # the last piece ends inside a page
    path.write_bytes(content)
    assert _resident(path) == 1.0
    reader = PieceReader(path, 1 << 20, 4, len(content))
    assert not reader.direct and _read_all(reader) == content
    reader.close()
    _evict(path)
    assert _resident(path) == 0.0
    reader = PieceReader(path, 1 << 20, 4, len(content))
    assert reader.direct and _read_all(reader) == content
    reader.close()
    # O_DIRECT went around the cache: reading the whole file left none of it there.
    assert _resident(path) == 0.0


def test_piece_reader_stops_at_its_length_and_tells_a_grown_or_shrunk_file(tmp_path):
    path = tmp_path / "disk.img"
    content = os.urandom(3 << 20)
    path.write_bytes(content)
    for cold in (False, True):
        if cold:
            _evict(path)
        reader = PieceReader(path, 1 << 20, 4, (2 << 20) + 5)
        assert reader.direct == cold
        assert _read_all(reader) == content[: (2 << 20) + 5]
        assert reader.grew((2 << 20) + 5) and not reader.grew(3 << 20)
        reader.close()
        reader = PieceReader(path, 1 << 20, 4, 4 << 20)
        assert _read_all(reader) == content  # shorter than asked: the caller sees the count
        reader.close()


def test_piece_reader_lends_at_most_its_buffers(tmp_path):
    path = tmp_path / "disk.img"
    path.write_bytes(os.urandom(8 << 20))
    reader = PieceReader(path, 1 << 20, IN_FLIGHT + 1, 8 << 20)
    held = []

    def consume():
        for view, release in reader:
            held.append(release)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive() and len(held) == IN_FLIGHT + 1  # waiting for a buffer back
    held[0]()
    thread.join(0.5)
    assert len(held) == IN_FLIGHT + 2
    for release in held[1:]:
        release()
    thread.join(5)
    assert not thread.is_alive() and len(held) == 8
    reader.close()


def _write_direct(path, content: bytes, sizes: list[int], writer=DirectWriter) -> None:
    with open(path, "wb") as f:
        out = writer(path, f.fileno())
        source = Chunked(content, sizes)
        while piece := source.read(1 << 30):
            out.write(piece)
        out.close()
        os.fsync(f.fileno())


@pytest.mark.parametrize("size", [0, 1, PIECE - 1, PIECE, PIECE + 1, 3 * PIECE + 12345])
def test_direct_writer_writes_every_byte_in_uneven_pieces(tmp_path, size):
    path = tmp_path / "blob"
    content = os.urandom(size)
    _write_direct(path, content, [1, 4096, 333333, 1 << 20, 7])
    assert path.read_bytes() == content


def test_direct_writer_goes_around_the_page_cache_where_it_can(tmp_path):
    content = os.urandom(4 * PIECE + 5000)
    direct, cached = tmp_path / "direct", tmp_path / "cached"
    _write_direct(direct, content, [1 << 20])
    cached.write_bytes(content)
    # The control: written the usual way, the file stays in the cache; written directly, only its
    # tail page (written through the cache when the file is cut back) may be there.
    assert _resident(cached) == 1.0
    assert _resident(direct) <= 1 / 64
    assert direct.read_bytes() == content


def test_direct_writer_falls_back_to_the_cache_where_there_is_no_o_direct():
    # tmpfs refuses O_DIRECT: the same bytes arrive, through the cache.
    shm = Path("/dev/shm")
    assert shm.is_dir(), "the test needs a tmpfs at /dev/shm"
    path = shm / f"diskkit-test-{os.getpid()}"
    try:
        content = os.urandom(2 * PIECE + 99)
        _write_direct(path, content, [1 << 20, 5])
        assert path.read_bytes() == content
    finally:
        path.unlink(missing_ok=True)


def test_direct_writer_abort_stops_its_thread(tmp_path):
    path = tmp_path / "blob"
    before = threading.active_count()
    with open(path, "wb") as f:
        out = DirectWriter(path, f.fileno())
        out.write(os.urandom(2 * PIECE))
        assert threading.active_count() == before + 1
        out.abort()
    assert threading.active_count() == before


def _write_sparse_direct(path, content: bytes, sizes: list[int]) -> None:
    _write_direct(path, content, sizes, SparseDirectWriter)


def _data_runs(path) -> list[tuple[int, int]]:
    """(start, end) of each allocated run, as SEEK_DATA/SEEK_HOLE see them."""
    runs, at = [], 0
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        while at < size:
            try:
                start = os.lseek(f.fileno(), at, os.SEEK_DATA)
            except OSError:
                break
            at = os.lseek(f.fileno(), start, os.SEEK_HOLE)
            runs.append((start, at))
    return runs


@pytest.mark.parametrize("sizes", [[50_001], [1, 4096, 333333, 1 << 20, 7], [HOLE], [3 * PIECE]])
def test_sparse_direct_writer_leaves_whole_zero_blocks_as_holes_whatever_the_pieces(tmp_path, sizes):
    """The pulled disk's writer (imagefs._spool): holes exactly where write_sparse leaves them, on
    HOLE boundaries, whatever sizes the decompressor hands over; every other byte written."""
    # a hole at the start, data, holes between, a block with one byte set, a buffer's worth of data
    # (the writer's PIECE boundary), and a tail shorter than a block
    content = (bytes(2 * HOLE) + os.urandom(HOLE + 10) + bytes(3 * HOLE) + bytes(HOLE - 1) + b"x"
               + os.urandom(PIECE + HOLE) + bytes(HOLE) + os.urandom(1234))
    path = tmp_path / "disk.img"
    _write_sparse_direct(path, content, sizes)
    assert path.read_bytes() == content
    expected = tmp_path / "reference.img"
    with open(expected, "wb") as out:
        write_sparse(out, content)
        out.truncate()
    assert _data_runs(path) == _data_runs(expected)
    # the leading hole, and the three zero blocks after the first data (block 3 holds 10 bytes of it)
    assert _data_runs(path) == [(2 * HOLE, 4 * HOLE), (7 * HOLE, len(content))], _data_runs(path)


@pytest.mark.parametrize("content", [b"", bytes(100), bytes(3 * HOLE + 5), os.urandom(100), bytes(HOLE) + os.urandom(3)],
                         ids=["empty", "zeros-100", "zeros-3-blocks-5", "random-100", "zero-block-random-3"])  # the same ids in every worker
def test_sparse_direct_writer_sizes_small_and_empty_files(tmp_path, content):
    path = tmp_path / "disk.img"
    _write_sparse_direct(path, content, [7, 1 << 20])
    assert path.read_bytes() == content and path.stat().st_size == len(content)
    if content and not any(content):
        assert _data_runs(path) == []  # nothing allocated for a file of zeros


def test_sparse_direct_writer_goes_around_the_page_cache_and_falls_back_on_tmpfs(tmp_path):
    content = os.urandom(2 * PIECE) + bytes(4 * HOLE) + os.urandom(PIECE + 77)
    path = tmp_path / "disk.img"
    _write_sparse_direct(path, content, [1 << 20])
    assert _resident(path) <= 1 / 64  # written past the cache: at most the tail page is there
    assert path.read_bytes() == content
    shm = Path("/dev/shm")
    assert shm.is_dir(), "the test needs a tmpfs at /dev/shm"
    other = shm / f"diskkit-test-sparse-{os.getpid()}"
    try:
        _write_sparse_direct(other, content, [1 << 20, 5])
        assert other.read_bytes() == content
    finally:
        other.unlink(missing_ok=True)


def test_a_disk_read_cold_or_cached_makes_the_same_layer_and_a_changed_one_is_refused(tmp_path):
    disk = tmp_path / "disk.qcow2"
    disk.write_bytes(os.urandom(3 << 20) + bytes(2 << 20) + os.urandom(777))
    results = []
    for cold in (False, True):
        if cold:
            _evict(disk)
        sink = io.BytesIO()
        entries = entries_for([("/disk/disk.qcow2", disk)])
        results.append((lazygzip.write_layer(entries, sink, toc_for="disk/disk.qcow2"), sink.getvalue()))
    assert results[0] == results[1]
    for wrong in (disk.stat().st_size - 1, disk.stat().st_size + 1):
        entries = [replace(e, size=wrong) if e.path == "disk/disk.qcow2" else e for e in entries_for([("/disk/disk.qcow2", disk)])]
        with pytest.raises(DiskkitError, match=r"changed while being read \(\d+ bytes expected, \d+ read\)"):
            lazygzip.write_layer(entries, io.BytesIO(), toc_for="disk/disk.qcow2")

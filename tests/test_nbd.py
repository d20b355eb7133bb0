"""The NBD server (launcher/nbd.py) on its own, with a file as the export: real clients for what they
do (qemu-img, qemu-io, nbdinfo, nbdcopy), and a raw socket for what no real client sends to a
read-only export (writes, the old EXPORT_NAME option, reads past the end)."""

from __future__ import annotations

import errno
import mmap
import os
import socket
import struct
import subprocess
import threading
from pathlib import Path

import pytest

from launcher.diskserver import nbd
from launcher.diskserver.installed import InstalledDisk
from tests.conftest import run
from tests.lazyhost import random_disk, wait_for


HERE = 4 << 20  # the bytes before this are "here": read_ready has them; the rest come through read
BAD_SECTORS = ((1 << 20) + 512, (7 << 20) + 512)  # one in each part, as only a read starting right there sees it


class FileExport:
    def __init__(self, name: str, path: Path):
        self.name, self.description = name, f"file {path.name}"
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self.reads = self.ready_reads = 0
        self.arrived = threading.Event()  # what read() waits for, as a lazy export waits for its registry
        self.arrived.set()
        self.pool_read = threading.Event()  # set once the pool has begun a read

    def read_ready(self, offset: int, length: int) -> bytes | None:
        if offset + length > HERE:
            return None
        self.ready_reads += 1
        return self._pread(offset, length)

    def read(self, offset: int, length: int) -> bytes:
        self.reads += 1
        self.pool_read.set()
        self.arrived.wait(30)
        return self._pread(offset, length)

    def _pread(self, offset: int, length: int) -> bytes:
        if offset in BAD_SECTORS:
            raise nbd.NbdError(errno.EIO, "a bad sector")
        return os.pread(self.fd, length, offset)


class Exports:
    def __init__(self, *exports):
        self.by_name = {e.name: e for e in exports}

    def lookup(self, name):
        return self.by_name.get(name)

    def listing(self):
        return list(self.by_name.values())


@pytest.fixture
def served(tmp_path):
    disk = random_disk(tmp_path / "disk.img", 8 << 20)
    export = FileExport("disk", disk)
    server = nbd.Server(tmp_path / "nbd.sock", Exports(export, FileExport("other", disk)), mode=0o600).start()
    try:
        yield server, export, disk
    finally:
        server.close()


def url(server, name: str = "disk") -> str:
    return f"nbd+unix:///{name}?socket={server.path}"


def test_real_clients_read_the_export(served, tmp_path):
    server, export, disk = served
    assert oct(server.path.stat().st_mode & 0o777) == "0o600"
    listing = run("nbdinfo", "--list", url(server)).stdout
    assert 'export="disk"' in listing and 'export="other"' in listing and "description: file disk.img" in listing
    info = run("nbdinfo", url(server)).stdout
    assert "export-size: 8388608" in info and "is_read_only: true" in info and "can_multi_conn: true" in info
    assert "block_size_maximum: 33554432" in info
    assert run("qemu-img", "compare", "-f", "raw", "-F", "raw", url(server), disk).stdout.strip() == "Images are identical."
    run("nbdcopy", "--requests=16", url(server), tmp_path / "copy.img")
    assert (tmp_path / "copy.img").read_bytes() == disk.read_bytes()
    # Unaligned, odd-sized reads come back byte for byte.
    pattern = disk.read_bytes()[12345 : 12345 + 777]
    out = run("qemu-io", "-r", "-f", "raw", "-c", "read -v 12345 777", url(server)).stdout
    # qemu-io dumps "OFFSET:  hex hex ...  ascii": the hex part ends at the first double space.
    rows = [line.split(":", 1)[1].strip().split("  ")[0] for line in out.splitlines() if line[:8].isalnum() and line[8:9] == ":"]
    dumped = bytes.fromhex("".join(rows).replace(" ", ""))
    assert dumped == pattern


def test_errors_reach_the_client(served):
    server, export, _ = served
    for sector in BAD_SECTORS:  # answered on the connection's thread, then by the pool
        bad = subprocess.run(["qemu-io", "-r", "-f", "raw", "-c", f"read {sector} 4096", url(server)], capture_output=True, text=True)
        assert "Input/output error" in bad.stdout + bad.stderr, sector
    assert export.ready_reads and export.reads
    missing = subprocess.run(["nbdinfo", url(server, "nope")], capture_output=True, text=True)
    assert missing.returncode != 0 and "No such file or directory for export: nope" in missing.stderr  # NBD_REP_ERR_UNKNOWN


def _handshake(path: Path, flags: int = nbd.FLAG_FIXED_NEWSTYLE | nbd.FLAG_NO_ZEROES) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    magic, opt, server_flags = struct.unpack(">QQH", nbd._recv_exact(sock, 18))
    assert (magic, opt, server_flags) == (nbd.NBDMAGIC, nbd.IHAVEOPT, nbd.FLAG_FIXED_NEWSTYLE | nbd.FLAG_NO_ZEROES)
    sock.sendall(struct.pack(">I", flags))
    return sock


def _option(sock: socket.socket, option: int, data: bytes = b"") -> None:
    sock.sendall(struct.pack(">QII", nbd.IHAVEOPT, option, len(data)) + data)


def _reply(sock: socket.socket) -> tuple[int, bytes]:
    magic, _, kind, length = struct.unpack(">QIII", nbd._recv_exact(sock, 20))
    assert magic == nbd.REPLY_MAGIC
    return kind, nbd._recv_exact(sock, length)


def _request(sock: socket.socket, kind: int, cookie: int, offset: int, length: int, payload: bytes = b"") -> tuple[int, int]:
    sock.sendall(struct.pack(">IHHQQI", nbd.REQUEST_MAGIC, 0, kind, cookie, offset, length) + payload)
    magic, error, got = struct.unpack(">IIQ", nbd._recv_exact(sock, 16))
    assert magic == nbd.SIMPLE_REPLY_MAGIC and got == cookie
    return error, got


def test_old_style_export_name_writes_and_bounds(served):
    server, _, disk = served
    data = disk.read_bytes()
    with _handshake(server.path) as sock:
        _option(sock, 8)  # structured replies: unsupported, so simple replies it is
        assert _reply(sock)[0] == nbd.REP_ERR_UNSUP
        _option(sock, nbd.OPT_EXPORT_NAME, b"disk")
        size, flags = struct.unpack(">QH", nbd._recv_exact(sock, 10))  # no 124 zero bytes: NO_ZEROES was agreed
        assert size == len(data) and flags & nbd.TX_READ_ONLY
        assert _request(sock, nbd.CMD_WRITE, 1, 0, 512, bytes(512))[0] == errno.EPERM
        assert _request(sock, nbd.CMD_TRIM, 2, 0, 512)[0] == errno.EPERM
        assert _request(sock, nbd.CMD_READ, 3, len(data) - 4, 8)[0] == errno.EINVAL  # past the end
        assert _request(sock, nbd.CMD_FLUSH, 4, 0, 0)[0] == 0
        assert _request(sock, nbd.CMD_READ, 5, 4096, 100)[0] == 0
        assert nbd._recv_exact(sock, 100) == data[4096:4196]
        sock.sendall(struct.pack(">IHHQQI", nbd.REQUEST_MAGIC, 0, nbd.CMD_DISC, 6, 0, 0))
        assert sock.recv(1) == b""  # closed, with nothing after the disconnect
    with _handshake(server.path, nbd.FLAG_FIXED_NEWSTYLE) as sock:
        _option(sock, nbd.OPT_EXPORT_NAME, b"other")
        nbd._recv_exact(sock, 10 + 124)  # the zeros, for a client that did not agree to drop them
    with _handshake(server.path) as sock:
        _option(sock, nbd.OPT_EXPORT_NAME, b"nope")
        assert sock.recv(1) == b""  # unknown: the spec says close, as there is no way to say why
    with _handshake(server.path) as sock:
        _option(sock, nbd.OPT_ABORT)
        assert _reply(sock) == (nbd.REP_ACK, b"")
    with _handshake(server.path, 1 << 5) as sock:  # a flag the server never offered
        assert sock.recv(1) == b""
    wait_for(lambda: server.connections == 0, 10, "every connection to be let go")


def test_reads_of_bytes_here_pass_reads_that_wait(served):
    """A read whose bytes are here is answered at once, on the connection's thread, even while an
    earlier read on the same connection waits for its bytes; that one's reply follows when they come."""
    server, export, disk = served
    data = disk.read_bytes()
    export.arrived.clear()
    with _handshake(server.path) as sock:
        _option(sock, nbd.OPT_EXPORT_NAME, b"disk")
        nbd._recv_exact(sock, 10)
        sock.sendall(struct.pack(">IHHQQI", nbd.REQUEST_MAGIC, 0, nbd.CMD_READ, 1, 6 << 20, 4096))  # waits
        for cookie in (2, 3):
            assert _request(sock, nbd.CMD_READ, cookie, cookie << 20, 4096) == (0, cookie)
            assert nbd._recv_exact(sock, 4096) == data[cookie << 20 : (cookie << 20) + 4096]
        # the pool thread may not have been scheduled yet: the waiting read is the pool's, whenever it runs
        assert export.pool_read.wait(10)
        assert (export.ready_reads, export.reads) == (2, 1)
        export.arrived.set()
        magic, error, cookie = struct.unpack(">IIQ", nbd._recv_exact(sock, 16))
        assert (magic, error, cookie) == (nbd.SIMPLE_REPLY_MAGIC, 0, 1)
        assert nbd._recv_exact(sock, 4096) == data[6 << 20 : (6 << 20) + 4096]


def uncached_disk(path: Path, size: int) -> Path:
    """Random bytes written with O_DIRECT, so none of them sits in the page cache afterwards.
    fadvise(DONTNEED) alone is not enough: pages still in another CPU's LRU batch stay cached."""
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(size))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        assert os.write(fd, buf) == size
        os.fsync(fd)
    finally:
        os.close(fd)
        buf.close()
    return path


def test_a_complete_disk_answers_here_only_from_the_page_cache(tmp_path):
    """launcher/diskserver/installed.InstalledDisk: bytes the page cache holds are returned by
    read_ready (answered on the connection's thread); bytes that would wait for the device are not
    (preadv RWF_NOWAIT), so the pool reads them and the connection's other reads go on meanwhile."""
    disk = uncached_disk(tmp_path / "disk.img", 8 << 20)
    export = InstalledDisk("disk", disk)
    try:
        assert export.read_ready(4 << 20, 65536) is None
        data = export.read(4 << 20, 65536)  # the pool's read, which waits for the device
        assert data == disk.read_bytes()[4 << 20 : (4 << 20) + 65536]
        assert export.read_ready(4 << 20, 65536) == data  # now cached
    finally:
        export.close()

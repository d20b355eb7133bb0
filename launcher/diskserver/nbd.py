"""A read-only NBD server on a unix socket: the fixed newstyle handshake and simple replies.

Spoken with qemu, qemu-img and libnbd (nbdinfo, nbdcopy). Options: EXPORT_NAME, GO, INFO, LIST and
ABORT (everything else, STARTTLS and structured replies included, is answered "unsupported", which
every client falls back from). Commands: READ, FLUSH and DISC; writes and trims get EPERM, as the
export is advertised read-only.

A read whose bytes are already here (fetched, and in the page cache) is answered on the
connection's own thread. The others are served on a thread pool, so a read waiting for a registry
or a device never holds up one whose data is here; replies may leave out of order, matched by the
client's cookie. Handing every read to a pool thread cost a booting test guest 0.6 s: under TCG
one core runs the guest, and each hand-off waited about 1.4 ms for the scheduler on the other
(traced bench/lazy.py run, 600 reads).

Exports are looked up by name through the `Exports` the caller gives; each export only needs a size,
a `read(offset, length)` that returns the bytes or raises `NbdError` with an errno, and a
`read_ready(offset, length)` that returns them only if no waiting, for a registry or a device, is
needed (else None).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
import queue
from pathlib import Path
from typing import Protocol

log = logging.getLogger("launcher.nbd")

NBDMAGIC = 0x4E42444D41474943
IHAVEOPT = 0x49484156454F5054
REPLY_MAGIC = 0x3E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698

FLAG_FIXED_NEWSTYLE = 1 << 0
FLAG_NO_ZEROES = 1 << 1
CLIENT_FLAGS = FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES

OPT_EXPORT_NAME, OPT_ABORT, OPT_LIST, OPT_STARTTLS, OPT_INFO, OPT_GO = 1, 2, 3, 5, 6, 7
REP_ACK, REP_SERVER, REP_INFO = 1, 2, 3
REP_ERR_UNSUP = (1 << 31) + 1
REP_ERR_POLICY = (1 << 31) + 2
REP_ERR_INVALID = (1 << 31) + 3
REP_ERR_UNKNOWN = (1 << 31) + 6
INFO_EXPORT, INFO_NAME, INFO_DESCRIPTION, INFO_BLOCK_SIZE = 0, 1, 2, 3

TX_HAS_FLAGS = 1 << 0
TX_READ_ONLY = 1 << 1
TX_SEND_FLUSH = 1 << 2
TX_CAN_MULTI_CONN = 1 << 8  # read-only: every connection sees the same bytes
TRANSMISSION_FLAGS = TX_HAS_FLAGS | TX_READ_ONLY | TX_SEND_FLUSH | TX_CAN_MULTI_CONN

CMD_READ, CMD_WRITE, CMD_DISC, CMD_FLUSH, CMD_TRIM, CMD_CACHE, CMD_WRITE_ZEROES = 0, 1, 2, 3, 4, 5, 6
MAX_REQUEST = 32 << 20  # what qemu itself sends at most, and what we advertise
MAX_OPTION = 64 << 10
IN_FLIGHT = 16  # per connection; bounds memory at IN_FLIGHT x the largest read


class NbdError(Exception):
    """A request failed; `errno` goes back to the client in the reply."""

    def __init__(self, code: int, message: str = ""):
        super().__init__(message or os.strerror(code))
        self.errno = code


class Export(Protocol):
    name: str
    description: str
    size: int

    def read(self, offset: int, length: int) -> bytes: ...

    def read_ready(self, offset: int, length: int) -> bytes | bytearray | None: ...


class Exports(Protocol):
    def lookup(self, name: str) -> Export | None: ...

    def listing(self) -> list[Export]: ...


class _Closed(Exception):
    pass


class _ReadPool:
    """Worker threads for reads. Daemons, unlike concurrent.futures' workers (joined at exit): a read
    waiting on an unreachable registry must not keep a stopping server alive."""

    def __init__(self, workers: int):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.closed = False
        for index in range(workers):
            threading.Thread(target=self._work, name=f"nbd-read-{index}", daemon=True).start()

    def submit(self, fn, *args) -> None:
        if self.closed:
            raise RuntimeError("the pool is closed")
        self.jobs.put((fn, args))

    def _work(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, args = job
            try:
                fn(*args)
            except Exception:  # a bug must cost one read, never a worker
                log.exception("NBD read failed")

    def shutdown(self) -> None:
        self.closed = True


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise _Closed()
        got += k
    return bytes(buf)


class Server:
    """Listens on `path` (mode `mode`, owner `owner` and group `group` when given) until close()."""

    def __init__(self, path: Path, exports: Exports, mode: int = 0o600, group: int | None = None, workers: int = 16,
                 owner: int | None = None):
        self.path = Path(path)
        self.exports = exports
        self.pool = _ReadPool(workers)
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._closing = threading.Event()
        self.path.unlink(missing_ok=True)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bound under a private umask, then opened up: the socket is never briefly world-connectable.
        old = os.umask(0o177)
        try:
            self.sock.bind(str(self.path))
        finally:
            os.umask(old)
        if group is not None or owner is not None:
            os.chown(self.path, -1 if owner is None else owner, -1 if group is None else group)
        os.chmod(self.path, mode)
        self.sock.listen(64)
        self._thread = threading.Thread(target=self._accept_loop, name="nbd-accept", daemon=True)

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._connections)

    def start(self) -> "Server":
        self._thread.start()
        return self

    def close(self) -> None:
        self._closing.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        with self._lock:
            conns = list(self._connections)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5)
        self.pool.shutdown()
        self.path.unlink(missing_ok=True)

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="nbd-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            export = _Handshake(conn, self.exports).run()
            if export is not None:
                _Transmission(conn, export, self.pool).run()
        except (_Closed, OSError):
            pass
        except Exception:  # a bug must cost one connection, never the server
            log.exception("NBD connection failed")
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()


class _Handshake:
    def __init__(self, conn: socket.socket, exports: Exports):
        self.conn = conn
        self.exports = exports
        self.no_zeroes = False

    def run(self) -> Export | None:
        conn = self.conn
        conn.sendall(struct.pack(">QQH", NBDMAGIC, IHAVEOPT, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES))
        (client_flags,) = struct.unpack(">I", _recv_exact(conn, 4))
        if client_flags & ~CLIENT_FLAGS:
            return None  # the spec: drop clients that set flags we did not offer
        self.no_zeroes = bool(client_flags & FLAG_NO_ZEROES)
        while True:
            magic, option, length = struct.unpack(">QII", _recv_exact(conn, 16))
            if magic != IHAVEOPT or length > MAX_OPTION:
                return None
            data = _recv_exact(conn, length)
            if option == OPT_EXPORT_NAME:
                export = self.exports.lookup(data.decode("utf-8", "replace"))
                if export is None:
                    return None  # no way to say why: the spec says close
                conn.sendall(struct.pack(">QH", export.size, TRANSMISSION_FLAGS) + (b"" if self.no_zeroes else bytes(124)))
                return export
            if option == OPT_ABORT:
                self._reply(option, REP_ACK)
                return None
            if option == OPT_LIST:
                if data:
                    self._reply(option, REP_ERR_INVALID, b"NBD_OPT_LIST takes no data")
                    continue
                for export in self.exports.listing():
                    name = export.name.encode()
                    self._reply(option, REP_SERVER, struct.pack(">I", len(name)) + name + export.description.encode())
                self._reply(option, REP_ACK)
                continue
            if option in (OPT_INFO, OPT_GO):
                export = self._info(option, data)
                if export is not None and option == OPT_GO:
                    return export
                continue
            if option == OPT_STARTTLS:
                self._reply(option, REP_ERR_POLICY, b"TLS is not offered on a local socket")
                continue
            self._reply(option, REP_ERR_UNSUP)

    def _info(self, option: int, data: bytes) -> Export | None:
        if len(data) < 6:
            self._reply(option, REP_ERR_INVALID, b"short NBD_OPT_INFO/GO request")
            return None
        (name_len,) = struct.unpack_from(">I", data)
        if 4 + name_len + 2 > len(data):
            self._reply(option, REP_ERR_INVALID, b"export name overruns the option")
            return None
        name = data[4 : 4 + name_len].decode("utf-8", "replace")
        (count,) = struct.unpack_from(">H", data, 4 + name_len)
        if len(data) != 4 + name_len + 2 + 2 * count:
            self._reply(option, REP_ERR_INVALID, b"information request list has the wrong length")
            return None
        wanted = set(struct.unpack_from(f">{count}H", data, 4 + name_len + 2))
        export = self.exports.lookup(name)
        if export is None:
            self._reply(option, REP_ERR_UNKNOWN, f"no export named {name!r}".encode())
            return None
        self._reply(option, REP_INFO, struct.pack(">HQH", INFO_EXPORT, export.size, TRANSMISSION_FLAGS))
        if INFO_NAME in wanted:
            self._reply(option, REP_INFO, struct.pack(">H", INFO_NAME) + export.name.encode())
        if INFO_DESCRIPTION in wanted:
            self._reply(option, REP_INFO, struct.pack(">H", INFO_DESCRIPTION) + export.description.encode())
        if INFO_BLOCK_SIZE in wanted:
            self._reply(option, REP_INFO, struct.pack(">HIII", INFO_BLOCK_SIZE, 1, 4096, MAX_REQUEST))
        self._reply(option, REP_ACK)
        return export

    def _reply(self, option: int, kind: int, data: bytes = b"") -> None:
        self.conn.sendall(struct.pack(">QIII", REPLY_MAGIC, option, kind, len(data)) + data)


class _Transmission:
    def __init__(self, conn: socket.socket, export: Export, pool: _ReadPool):
        self.conn = conn
        self.export = export
        self.pool = pool
        self.send_lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(IN_FLIGHT)

    def run(self) -> None:
        conn = self.conn
        while True:
            magic, flags, kind, cookie, offset, length = struct.unpack(">IHHQQI", _recv_exact(conn, 28))
            del flags  # FUA and friends mean nothing on a read-only export
            if magic != REQUEST_MAGIC:
                return  # out of sync: nothing sensible can follow
            if kind == CMD_DISC:
                self._drain()
                return
            if kind == CMD_WRITE:
                _recv_exact_discard(conn, length)
                self._simple(cookie, errno.EPERM)
            elif kind in (CMD_TRIM, CMD_WRITE_ZEROES):
                self._simple(cookie, errno.EPERM)
            elif kind == CMD_FLUSH:
                self._simple(cookie, 0)  # nothing is ever written, so nothing is pending
            elif kind == CMD_READ:
                if length > MAX_REQUEST or offset + length > self.export.size:
                    self._simple(cookie, errno.EINVAL)
                    continue
                if self._answer(cookie, offset, length, self.export.read_ready):
                    continue  # the bytes were here: answered without the pool
                self.slots.acquire()
                try:
                    self.pool.submit(self._read, cookie, offset, length)
                except RuntimeError:  # the pool is shutting down with the server
                    self.slots.release()
                    return
            else:
                self._simple(cookie, errno.EINVAL)

    def _answer(self, cookie: int, offset: int, length: int, read) -> bool:
        """Reply with what `read` returns, or its error; False, and nothing sent, when it returns None."""
        try:
            data = read(offset, length) if length else b""
        except NbdError as exc:
            self._simple(cookie, exc.errno)
            return True
        except Exception:
            log.exception("read of %d bytes at %d from %s failed", length, offset, self.export.name)
            self._simple(cookie, errno.EIO)
            return True
        if data is None:
            return False
        if len(data) != length:
            log.error("export %s returned %d bytes for a %d-byte read at %d", self.export.name, len(data), length, offset)
            self._simple(cookie, errno.EIO)
        else:
            self._simple(cookie, 0, data)
        return True

    def _read(self, cookie: int, offset: int, length: int) -> None:
        try:
            self._answer(cookie, offset, length, self.export.read)
        except OSError:
            pass  # the client went away; its connection thread notices too
        finally:
            self.slots.release()

    def _simple(self, cookie: int, code: int, data: bytes = b"") -> None:
        header = struct.pack(">IIQ", SIMPLE_REPLY_MAGIC, code, cookie)
        with self.send_lock:
            if not data:
                self.conn.sendall(header)
                return
            sent = self.conn.sendmsg([header, data])  # one system call for the usual case, no copy
            if sent < len(header):
                self.conn.sendall(header[sent:])
                sent = len(header)
            if sent - len(header) < len(data):
                self.conn.sendall(memoryview(data)[sent - len(header) :])

    def _drain(self) -> None:
        """Every reply already asked for goes out before the connection closes (the spec's DISC rule)."""
        for _ in range(IN_FLIGHT):
            self.slots.acquire()
        for _ in range(IN_FLIGHT):
            self.slots.release()


def _recv_exact_discard(sock: socket.socket, n: int) -> None:
    while n:
        got = len(_recv_exact(sock, min(n, 1 << 20)))
        n -= got

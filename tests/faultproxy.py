"""A fault-injecting HTTP/1.1 reverse proxy to put in front of a real (plain-HTTP) registry.

Client -> proxy and proxy -> upstream are both plain HTTP.  Every request is forwarded unchanged
(Host header included, so distribution builds Location URLs that point back at the proxy) unless a
registered ``Fault`` matches it.  Bodies are streamed in 64 KiB pieces in both directions.

Actions (``Fault.action``):

``drop``
    Requests without a body (GET, HEAD, DELETE, body-less PUT...): forward, send the status line,
    headers and the first ``arg`` bytes of the response body, then reset the connection.
    Requests with a body (PATCH, PUT with data, POST with data): the whole body is read from the
    client; if the path is an upload URL (``/blobs/uploads/``) and ``arg`` > 0, the first ``arg``
    bytes are sent upstream as a ``PATCH`` to the same URL (so the registry holds a partial upload
    the client must discover with a GET on the upload URL); then the client connection is reset
    without any answer.  Logged with status 0.
``status``      answer ``int(arg)`` with ``{"errors": []}``, not forwarded.
``retry_after`` answer 429 with ``Retry-After: int(arg)``, not forwarded.
``flip``        forward; flip the lowest bit of response-body byte ``int(arg)``.
``truncate``    forward; send only ``int(arg)`` body bytes (Content-Length unchanged), then close.
``stall``       wait ``arg`` seconds, then forward normally.
``cut``         requests with a body: forward the request and the first ``arg`` body bytes, then reset
                the client connection and close the upstream one (the server sees a body cut short,
                as when a connection drops mid-upload). Logged with status 0.
``redirect``    answer 307 with ``Location: arg`` (a string: another scheme, say), not forwarded.
``endless``     answer ``Fault.status`` (200) with a chunked body of ``arg`` bytes of JSON-looking filler
                (0: without end), not forwarded: a manifest, token or error body that never stops.
``rewrite``     forward to ``re.sub(path, to, target)`` instead: a registry that answers one blob
                with another's bytes (a liar naming another image's layer digest).

``pause``       forward; send ``int(arg)`` body bytes (``arg`` may be a function of the request's Range
                header giving that number), then wait until ``Fault.release`` (a threading.Event) is set (at
                most MAX_STALL seconds), then the rest: an answer that stops half way and resumes.

``Fault.hold``: ``(N, SECONDS)``: with ``truncate`` or ``flip``, the body stops for that long after its
first N bytes (a download that has run a while before its fault).

``Fault.stop_at``: with ``flip``, the body also ends after that many bytes, as with ``truncate``
(a liar that serves wrong bytes for a digest and is cut off half way). ``Fault.byte``: with ``flip``,
the byte of the blob to flip instead of ``arg``: the fault matches only a range request whose
``Range: bytes=START-END`` holds it (the first answer that carries that byte, whichever request it is).

Faults are tried in the order added; the first live one whose method (or ``"*"``) equals the
request method and whose ``path`` regex is found (``re.search``) in the request target — path plus
query string — applies and uses up one of its ``times``; with ``skip=N`` the first N requests it
matches pass unharmed (the second PATCH of an upload, say). A fault with ``header=(NAME, REGEX)`` also
needs that request header to match (e.g. ``("Range", r"^bytes=1536-")`` for one range request);
``header=(NAME, None)`` needs it absent (``("Range", None)``: a whole blob's GET, not a lazy TOC's range read).

Extensions a registry may have that distribution lacks: ``FaultProxy.headers`` is a list of
``(PATH_REGEX, NAME, VALUE)`` added to every relayed answer whose target matches; ``FaultProxy.answer``,
when set, is called as ``answer(method, target, read_body)`` when no fault applies and answers the request itself
when it returns ``(status, json_body)`` or ``(status, json_body, headers)`` (a Content-Type there replaces
the JSON one); it calls ``read_body()`` only then (None: not its request, forwarded as usual with its body unread).
``FaultProxy.ignore_range``, when true, forwards requests without their ``Range`` and ``If-Range`` headers:
a registry (or CDN) that answers every range request with the whole blob.

``FaultProxy(upstream, link=Link(rtt, rate))`` models a node's link to its registry (there is no
``tc netem`` here): each new connection waits one round trip (the TCP handshake), each request one more
before it is forwarded, and the response bodies of all connections together pass at ``rate`` bytes a
second, as through one link, in pieces small enough that concurrent answers share it. ``connections``
counts the connections accepted. ``timeline`` holds, in the order they happened, ``("arrived", number,
connection, method, target, Range or None)`` as each request arrives (``number`` counts requests from
0, ``connection`` the connections from 1) and ``("answered", number, ...)`` once a relayed answer's last
byte was sent: an order of events, never a time. ``times`` holds when each of them happened
(time.monotonic()), for a bench's breakdown: tests assert orders.
"""

from __future__ import annotations

import http.client
import http.server
import json
import re
import socket
import socketserver
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable

CHUNK = 64 * 1024
UPSTREAM_TIMEOUT = 60.0
CLIENT_TIMEOUT = 60.0
MAX_CONNECTIONS = 64
MAX_STALL = 120.0

ACTIONS = ("drop", "status", "retry_after", "flip", "truncate", "stall", "cut", "redirect", "endless", "rewrite", "pause")
# Hop-by-hop headers, never forwarded in either direction (RFC 9110 section 7.6.1), plus Expect (answered here).
HOP_BY_HOP = {
    "connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization", "te", "trailer",
    "transfer-encoding", "upgrade", "expect",
}


@dataclass
class Fault:
    method: str
    path: str
    action: str
    times: int = 1
    arg: float | Callable[[str | None], int] = 0
    header: tuple[str, str | None] | None = None
    skip: int = 0
    stop_at: int | None = None
    status: int = 200
    to: str | None = None  # rewrite: the replacement for `path` in the request target
    release: threading.Event | None = None  # pause: set to send the rest
    byte: int | None = None  # flip: this byte of the blob, in the first range answer that holds it
    hold: tuple[int, float] | None = None  # truncate, flip: after that many body bytes, wait that many seconds

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r} (one of {', '.join(ACTIONS)})")
        self._regex = re.compile(self.path)
        self._header = (self.header[0], None if self.header[1] is None else re.compile(self.header[1])) if self.header else None

    def matches(self, method: str, target: str, headers=None) -> bool:
        if self._header is not None:
            value = headers.get(self._header[0]) if headers is not None else None
            if self._header[1] is None:
                if value is not None:
                    return False
            elif value is None or self._header[1].search(value) is None:
                return False
        if self.byte is not None and not self.byte_at(headers.get("Range") if headers is not None else None) >= 0:
            return False
        return self.times > 0 and self.method in ("*", method) and self._regex.search(target) is not None

    def byte_at(self, range_: str | None) -> int:
        """Where `byte` lies in the answer to a request with this Range header; -1 when not in it."""
        found = re.fullmatch(r"bytes=(\d+)-(\d+)", range_ or "")
        if found is None or not int(found[1]) <= self.byte <= int(found[2]):
            return -1
        return self.byte - int(found[1])

    def rewritten(self, target: str) -> str:
        return self._regex.sub(self.to or "", target, count=1)


class Link:
    """One link shared by every connection through the proxy: a round trip per new connection and per
    request, and one rate for all response bodies. Bytes are paid for in the order they are sent: a
    piece waits until the link has carried everything sent before it (a FIFO, as a bottleneck queue)."""

    PIECE = 16 * 1024  # concurrent answers interleave at this grain
    SLACK = 0.02

    def __init__(self, rtt: float = 0.0, rate: float = 0.0):
        self.rtt = rtt
        self.rate = rate  # bytes a second, 0: unlimited
        self._lock = threading.Lock()
        self._free_at = 0.0  # when the link has carried what was sent so far

    def pay(self, nbytes: int, closing: threading.Event) -> None:
        if not self.rate:
            return
        with self._lock:
            now = time.monotonic()
            # A sender that woke late (a loaded host) may catch up on SLACK of idle link, no more.
            self._free_at = max(now - self.SLACK, self._free_at) + nbytes / self.rate
            until = self._free_at
        closing.wait(max(0.0, until - now))

    def wait(self, closing: threading.Event) -> None:
        if self.rtt:
            closing.wait(self.rtt)


class _Abort(Exception):
    """Stop handling this connection (it has been, or must be, closed)."""


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False
    request_queue_size = MAX_CONNECTIONS

    def __init__(self, proxy: "FaultProxy"):
        self.proxy = proxy
        super().__init__(("127.0.0.1", 0), _Handler)

    def process_request(self, request, client_address):
        if not self.proxy._track(request):
            self.shutdown_request(request)  # over the connection limit, or closing
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.proxy._untrack(request)

    def handle_error(self, request, client_address):
        pass  # broken client connections are part of the job


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = CLIENT_TIMEOUT
    server: _Server

    def log_message(self, *args):
        pass

    def handle(self):
        proxy = self.server.proxy
        self.ordinal = proxy._connection_number()
        if proxy.link is not None:
            proxy.link.wait(proxy._closing)  # the connection's handshake
        try:
            super().handle()
        except (_Abort, OSError, http.client.HTTPException):
            self.close_connection = True

    # every method goes through the same path
    def __getattr__(self, name: str):
        if name.startswith("do_"):
            return self._proxy_request
        raise AttributeError(name)

    # --- request body -------------------------------------------------------------------------

    def _body_kind(self) -> tuple[str, int]:
        te = self.headers.get("Transfer-Encoding", "")
        if te:
            if te.strip().lower() != "chunked":
                self._reply(501, {"errors": [{"code": "UNSUPPORTED", "message": f"transfer-encoding {te}"}]}, close=True)
                raise _Abort()
            return "chunked", -1
        length = self.headers.get("Content-Length")
        if length is None:
            return "none", 0
        try:
            n = int(length)
            if n < 0:
                raise ValueError
        except ValueError:
            self._reply(400, {"errors": [{"code": "BAD_REQUEST", "message": "bad Content-Length"}]}, close=True)
            raise _Abort()
        return ("length", n) if n else ("none", 0)

    def _body_pieces(self, kind: str, length: int):
        """Yield the request body from the client in pieces of at most CHUNK bytes."""
        rfile = self.rfile
        if kind == "length":
            left = length
            while left:
                piece = rfile.read(min(CHUNK, left))
                if not piece:
                    raise _Abort()
                left -= len(piece)
                yield piece
        elif kind == "chunked":
            while True:
                line = rfile.readline(1024)
                if not line.endswith(b"\n"):
                    raise _Abort()
                try:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                except ValueError:
                    raise _Abort() from None
                if size == 0:
                    for _ in range(100):  # trailers, up to the empty line
                        trailer = rfile.readline(8192)
                        if trailer in (b"\r\n", b"\n", b""):
                            return
                    raise _Abort()
                while size:
                    piece = rfile.read(min(CHUNK, size))
                    if not piece:
                        raise _Abort()
                    size -= len(piece)
                    yield piece
                if rfile.readline(3) not in (b"\r\n", b"\n"):
                    raise _Abort()

    def _drain(self, kind: str, length: int) -> int:
        return sum(len(p) for p in self._body_pieces(kind, length))

    # --- responses ----------------------------------------------------------------------------

    def _reply(self, status: int, body: dict, headers: dict | None = None, close: bool = False) -> None:
        data = json.dumps(body).encode()
        self.send_response_only(status)
        if not any(k.lower() == "content-type" for k in headers or {}):
            self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Docker-Distribution-Api-Version", "registry/2.0")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.wfile.flush()
        self.server.proxy._log(self.command, self.path, status)

    def _reset(self) -> None:
        """Close the client connection abruptly (RST)."""
        self.close_connection = True
        try:
            self.wfile.flush()
        except OSError:
            pass
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
        try:
            self.connection.close()
        except OSError:
            pass
        raise _Abort()

    # --- forwarding ---------------------------------------------------------------------------

    def _upstream_headers(self) -> list[tuple[str, str]]:
        hop = HOP_BY_HOP | {h.strip().lower() for h in self.headers.get("Connection", "").split(",") if h.strip()}
        if self.server.proxy.ignore_range:
            hop = hop | {"range", "if-range"}
        headers = [(k, v) for k, v in self.headers.items() if k.lower() not in hop and k.lower() != "content-length"]
        if self.headers.get("Host") is None:
            headers.append(("Host", self.server.proxy.host))
        return headers

    def _send_upstream(self, method: str, headers: list[tuple[str, str]], body, length: int | None, chunked: bool,
                       target: str | None = None):
        proxy = self.server.proxy
        conn = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=UPSTREAM_TIMEOUT)
        try:
            conn.putrequest(method, target or self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in headers:
                conn.putheader(k, v)
            if chunked:
                conn.putheader("Transfer-Encoding", "chunked")
            elif length is not None:
                conn.putheader("Content-Length", str(length))
            conn.putheader("Connection", "close")
            conn.endheaders()
            try:
                for piece in body or ():
                    if chunked:
                        conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))
                    else:
                        conn.send(piece)
                if chunked:
                    conn.send(b"0\r\n\r\n")
            except OSError:
                # The upstream stopped reading (it answered early, e.g. 401/404): relay its answer if there
                # is one; the rest of the client's body is unread, so that connection must close afterwards.
                self.close_connection = True
            return conn, conn.getresponse()
        except BaseException:
            conn.close()
            raise

    def _proxy_request(self) -> None:
        proxy = self.server.proxy
        kind, length = self._body_kind()
        event = proxy._event("arrived", None, self.ordinal, self.command, self.path, self.headers.get("Range"))
        if proxy.link is not None:
            proxy.link.wait(proxy._closing)  # the request's way there and the answer's first byte back
        if self.headers.get("Authorization") is not None:
            proxy._credentials(self.path, self.headers["Authorization"])
        if self.headers.get("Range") is not None:
            proxy._range(self.path, self.headers["Range"])
        fault = proxy._take(self.command, self.path, self.headers)
        action = fault.action if fault else None
        if fault is None and proxy.answer is not None:
            local = proxy.answer(self.command, self.path, lambda: b"".join(self._body_pieces(kind, length)) if kind != "none" else b"")
            if local is not None:
                self._reply(*local)
                return

        if action == "status" or action == "retry_after":
            self._drain(kind, length)
            if action == "status":
                self._reply(int(fault.arg), {"errors": []})
            else:
                self._reply(429, {"errors": [{"code": "TOOMANYREQUESTS", "message": "injected", "detail": None}]},
                            {"Retry-After": str(int(fault.arg))})
            return
        if action == "redirect":
            self._drain(kind, length)
            self.send_response_only(307)
            self.send_header("Location", str(fault.arg))
            self.send_header("Content-Length", "0")
            self.end_headers()
            self.wfile.flush()
            self.server.proxy._log(self.command, self.path, 307)
            return
        if action == "endless":
            self._drain(kind, length)
            self._endless(int(fault.arg), fault.status)
            return
        if action == "stall":
            if proxy._closing.wait(min(max(float(fault.arg), 0.0), MAX_STALL)):
                self._reset()
        if action == "drop" and kind != "none":
            keep = int(fault.arg)
            prefix = bytearray()
            for piece in self._body_pieces(kind, length):
                if len(prefix) < keep:
                    prefix += piece[: keep - len(prefix)]
            if prefix and "/blobs/uploads/" in self.path:
                headers = [(k, v) for k, v in self._upstream_headers() if k.lower() not in ("content-range", "content-type")]
                headers.append(("Content-Type", "application/octet-stream"))
                try:
                    conn, resp = self._send_upstream("PATCH", headers, [bytes(prefix)], len(prefix), False)
                    resp.read()
                    conn.close()
                except (OSError, http.client.HTTPException):
                    pass
            proxy._log(self.command, self.path, 0)
            self._reset()

        body = self._body_pieces(kind, length) if kind != "none" else None
        if action == "cut" and body is not None:
            body = self._cut(body, int(fault.arg))
        try:
            conn, resp = self._send_upstream(
                self.command, self._upstream_headers(), body,
                length if kind == "length" else (0 if self.command in ("POST", "PUT", "PATCH") else None),
                kind == "chunked", fault.rewritten(self.path) if action == "rewrite" else None,
            )
        except _Abort:
            raise
        except (OSError, http.client.HTTPException) as e:
            # The client body may be half read: answer, then close.
            self._reply(502, {"errors": [{"code": "BAD_GATEWAY", "message": f"upstream: {e}"}]}, close=True)
            proxy._log(self.command, self.path, 502)  # the upstream was not there: a test may wait for this
            self.close_connection = True
            return
        try:
            self._relay(resp, fault)
        finally:
            conn.close()
        proxy._event("answered", *event[1:])

    def _endless(self, total: int, status: int) -> None:
        self.send_response_only(status)
        self.send_header("Content-Type", "application/vnd.oci.image.manifest.v1+json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.server.proxy._log(self.command, self.path, status)
        filler = b'{"a":"' + b"x" * (CHUNK - 8) + b'",'
        sent = 0
        try:
            while not total or sent < total:
                piece = filler[: total - sent] if total else filler
                self._write(piece, True)
                sent += len(piece)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            raise _Abort() from None  # the client stopped reading: what is tested
        finally:
            self.server.proxy._count(self.path, sent)

    def _cut(self, pieces, keep: int):
        """The body's first `keep` bytes; then both connections go (raising _Abort closes upstream)."""
        sent = 0
        for piece in pieces:
            piece = piece[: keep - sent]
            if piece:
                sent += len(piece)
                yield piece
            if sent >= keep:
                break
        self.server.proxy._log(self.command, self.path, 0)
        self._reset()

    def _relay(self, resp: http.client.HTTPResponse, fault: Fault | None) -> None:
        action = fault.action if fault else None
        upstream_chunked = (resp.getheader("Transfer-Encoding") or "").lower() == "chunked"
        no_body = self.command == "HEAD" or resp.status in (204, 304) or 100 <= resp.status < 200
        hop = HOP_BY_HOP | {h.strip().lower() for h in (resp.getheader("Connection") or "").split(",") if h.strip()}
        self.send_response_only(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in hop:
                self.send_header(k, v)
        for pattern, name, value in self.server.proxy.headers:
            if re.search(pattern, self.path):
                self.send_header(name, value)
        rechunk = upstream_chunked and not no_body
        if self.close_connection:
            self.send_header("Connection", "close")
        if rechunk:
            self.send_header("Transfer-Encoding", "chunked")
        elif not no_body and resp.getheader("Content-Length") is None:
            # Body delimited by upstream EOF: pass it on the same way.
            self.send_header("Connection", "close")
        self.end_headers()
        self.server.proxy._log(self.command, self.path, resp.status)

        limit = None
        if action in ("drop", "truncate"):
            limit = int(fault.arg)
        elif fault is not None and fault.stop_at is not None:
            limit = fault.stop_at
        flip_at = -1
        if action == "flip":
            flip_at = fault.byte_at(self.headers.get("Range")) if fault.byte is not None else int(fault.arg)
        pause_at, hold_for = -1, None
        if action == "pause":
            pause_at = int(fault.arg(self.headers.get("Range")) if callable(fault.arg) else fault.arg)
        elif fault is not None and fault.hold is not None:
            pause_at, hold_for = fault.hold
        sent = 0
        if not no_body:
            while True:
                piece = resp.read(CHUNK if pause_at < sent else min(CHUNK, pause_at - sent) or CHUNK)
                if not piece:
                    break
                if 0 <= flip_at - sent < len(piece):
                    i = flip_at - sent
                    piece = piece[:i] + bytes([piece[i] ^ 0x01]) + piece[i + 1:]
                if limit is not None and sent + len(piece) >= limit:
                    piece = piece[: limit - sent]
                    self._write(piece, rechunk)
                    sent += len(piece)
                    break
                self._write(piece, rechunk)
                sent += len(piece)
                if sent == pause_at:
                    self.wfile.flush()
                    if hold_for is not None:
                        time.sleep(hold_for)
                        continue
                    deadline = time.monotonic() + MAX_STALL
                    while not fault.release.wait(0.1) and not self.server.proxy._closing.is_set() and time.monotonic() < deadline:
                        pass
            if limit is None and rechunk:
                self.wfile.write(b"0\r\n\r\n")
            self.server.proxy._count(self.path, sent)
        if limit is not None:
            if action == "drop":
                self._reset()
            self.close_connection = True
            self.wfile.flush()
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            raise _Abort()
        if resp.getheader("Connection", "").lower() == "close" and not no_body and not rechunk \
                and resp.getheader("Content-Length") is None:
            self.close_connection = True
        self.wfile.flush()

    def _write(self, piece: bytes, chunked: bool) -> None:
        if not piece:
            return
        link = self.server.proxy.link
        if link is not None and link.rate:
            for at in range(0, len(piece), link.PIECE):
                part = piece[at : at + link.PIECE]
                link.pay(len(part), self.server.proxy._closing)
                self._send_piece(part, chunked)
            return
        self._send_piece(piece, chunked)

    def _send_piece(self, piece: bytes, chunked: bool) -> None:
        if chunked:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        else:
            self.wfile.write(piece)


class FaultProxy:
    """``FaultProxy(upstream)`` listens on ``host`` (127.0.0.1, free port) and forwards to ``upstream``."""

    def __init__(self, upstream: str, link: Link | None = None):
        up_host, _, up_port = upstream.rpartition(":")
        if up_host not in ("127.0.0.1", "localhost") or not up_port.isdigit():
            raise ValueError(f"upstream must be a loopback host:port, got {upstream!r}")
        self.upstream = upstream
        self.upstream_host, self.upstream_port = up_host, int(up_port)
        self.log: list[tuple[str, str, int]] = []
        self.credentials: list[tuple[str, str]] = []  # (request target, Authorization) of every request that carried one
        self.sent: dict[str, int] = {}  # body bytes relayed per request path: what a client really fetched
        self.ranges: list[tuple[str, str]] = []  # (request target, Range) of every request that carried one
        self._faults: list[Fault] = []
        self.headers: list[tuple[str, str, str]] = []
        self.answer = None
        self.ignore_range = False
        self.link = link
        self.connections = 0
        self.timeline: list[tuple[str, int, int, str, str, str | None]] = []
        self.times: list[float] = []  # time.monotonic() of each timeline event
        self._request_count = 0
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._connections: set[socket.socket] = set()
        self._server = _Server(self)
        self.host = f"127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"faultproxy-{self.host}", daemon=True)
        self._thread.start()

    def url(self, path: str = "/v2/") -> str:
        return f"http://{self.host}{path}"

    def add(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()

    @property
    def pending(self) -> list[Fault]:
        """Faults not used up yet."""
        with self._lock:
            return [f for f in self._faults if f.times > 0]

    def _take(self, method: str, target: str, headers=None) -> Fault | None:
        with self._lock:
            for fault in self._faults:
                if fault.matches(method, target, headers):
                    if fault.skip:
                        fault.skip -= 1
                        return None
                    fault.times -= 1
                    return fault
        return None

    def _count(self, path: str, sent: int) -> None:
        with self._lock:
            self.sent[path] = self.sent.get(path, 0) + sent

    def _credentials(self, path: str, authorization: str) -> None:
        with self._lock:
            self.credentials.append((path, authorization))

    def _range(self, path: str, value: str) -> None:
        with self._lock:
            self.ranges.append((path, value))

    def _connection_number(self) -> int:
        with self._lock:
            self.connections += 1
            return self.connections

    def _event(self, kind: str, number: int | None, connection: int, method: str, target: str, range_: str | None) -> tuple:
        with self._lock:
            if number is None:
                number = self._request_count
                self._request_count += 1
            event = (kind, number, connection, method, target, range_)
            self.timeline.append(event)
            self.times.append(time.monotonic())
            return event

    def _log(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.log.append((method, path, status))

    def _track(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._closing.is_set() or len(self._connections) >= MAX_CONNECTIONS:
                return False
            self._connections.add(sock)
            return True

    def _untrack(self, sock: socket.socket) -> None:
        with self._lock:
            self._connections.discard(sock)

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            connections = list(self._connections)
        for sock in connections:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout=5)

    def __enter__(self) -> "FaultProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

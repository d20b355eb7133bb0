"""An upstream as distributions publish disks, on 127.0.0.1: files from a directory with ETag and
Last-Modified, single ranges (`Range: bytes=N-` and `N-M`) and If-Range as RFC 9110 has a server
honour them, and a log of each request's Range and If-Range, so tests see how a client resumed.
A dropped connection is the fault proxy's job (tests/faultproxy.py, in front of this server)."""

from __future__ import annotations

import hashlib
import http.server
import re
import threading
from email.utils import formatdate
from pathlib import Path

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_GET(self):
        upstream: Upstream = self.server.upstream
        name = self.path.split("?")[0].lstrip("/")
        upstream.requests.append((name, self.headers.get("Range"), self.headers.get("If-Range")))
        hook = upstream.before.pop(name, None) if self.headers.get("Range") else None
        if hook is not None:
            hook()  # the file changes between a dropped download and its resumption
        path = upstream.directory / name
        if "/" in name or not path.is_file():
            return self._answer(404, b"not found\n")
        data = path.read_bytes()
        st = path.stat()
        etag = f'"{hashlib.sha256(data).hexdigest()[:16]}"'
        modified = formatdate(st.st_mtime, usegmt=True)
        first, last, status = 0, len(data) - 1, 200
        wanted, condition = self.headers.get("Range"), self.headers.get("If-Range")
        if wanted and (condition is None or condition in (etag, modified)):
            match = _RANGE.fullmatch(wanted)
            if match:
                first = int(match.group(1))
                last = min(int(match.group(2)), len(data) - 1) if match.group(2) else len(data) - 1
                if first >= len(data):
                    return self._answer(416, b"", {"Content-Range": f"bytes */{len(data)}"})
                status = 206
        headers = {"ETag": etag, "Last-Modified": modified, "Accept-Ranges": "bytes"}
        if status == 206:
            headers["Content-Range"] = f"bytes {first}-{last}/{len(data)}"
        self._answer(status, data[first : last + 1], headers)

    def _answer(self, status: int, body: bytes, headers: dict | None = None):
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.server.upstream.sent += len(body)
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # clients cut off by the fault proxy


class Upstream:
    def __init__(self, directory: Path):
        self.directory = directory
        self.requests: list[tuple[str, str | None, str | None]] = []  # (file, Range, If-Range)
        self.before: dict[str, object] = {}  # file -> callable run before the next range request for it
        self.sent = 0
        self._httpd = _Server(("127.0.0.1", 0), _Handler)
        self._httpd.upstream = self
        self.host = f"127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def url(self, name: str) -> str:
        return f"http://{self.host}/{name}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "Upstream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

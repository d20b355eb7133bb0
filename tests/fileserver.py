"""A real HTTP(S) server for import tests: Python's ThreadingHTTPServer serving the files of a directory
on 127.0.0.1, optionally behind basic auth (as CDI's http source sends its secretRef) and TLS."""

from __future__ import annotations

import base64
import functools
import http.server
import ssl
import threading
from pathlib import Path


class _Files(http.server.SimpleHTTPRequestHandler):
    credentials: str | None = None

    def log_message(self, *args):
        pass

    def do_GET(self):
        if self.credentials is not None:
            expected = "Basic " + base64.b64encode(self.credentials.encode()).decode()
            if self.headers.get("Authorization") != expected:
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Basic realm="disks"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        super().do_GET()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # clients cut off by the fault proxy


class FileServer:
    def __init__(self, directory: Path, credentials: str | None = None, tls: tuple[Path, Path] | None = None):
        handler = functools.partial(type("Files", (_Files,), {"credentials": credentials}), directory=str(directory))
        self._httpd = _Server(("127.0.0.1", 0), handler)
        scheme = "http"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(tls[0]), str(tls[1]))
            self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
            scheme = "https"
        self.host = f"127.0.0.1:{self._httpd.server_address[1]}"
        self.base = f"{scheme}://{self.host}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> "FileServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

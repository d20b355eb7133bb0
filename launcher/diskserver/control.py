"""Where the node's disk server listens and how it is spoken to: one JSON object per line, each way.

    {"op": "open", "image": REF, "path": P, "platform": "linux/amd64", "registry": {...}, "marked": true,
     "clients": 2}   NBD connections to expect (default 1): a server exiting when idle waits for them
        -> {"ok": true, "export": NAME, "socket": NBD_SOCKET, "url": "nbd+unix:///NAME?socket=...", ...}
        -> {"ok": false, "seekable": false, "reason": "..."}   (pull it whole instead)
        -> {"ok": false, "error": "..."}                       (refused, as a pull would be)
    {"op": "files", "image": REF, "paths": [P, ...], "platform": ..., "registry": {...}, "marked": true}   kernelBoot files
        -> {"ok": true, "files": {P: {"path": FILE_IN_THE_CACHE, ...}}}   (as `launcher pull` records them)
        -> {"ok": false, "seekable": false, "reason": "..."}              (pull them whole instead)
    {"op": "status"} -> {"ok": true, "pid": N, "exports": [...]}
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from diskkit.errors import DiskkitError
from launcher.node.cache import Cache

NBD_SOCKET = "nbd.sock"
CONTROL_SOCKET = "control.sock"
SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL
REQUEST_TIMEOUT = 600.0


def serve_dir(cache: Cache, socket_dir: Path | str | None = None) -> Path:
    return Path(socket_dir) if socket_dir else cache.root / "serve"


def socket_path(directory: Path, name: str) -> Path:
    path = directory / name
    if len(str(path).encode()) > SOCKET_PATH_MAX:
        raise DiskkitError(path, f"is longer than the {SOCKET_PATH_MAX} bytes a unix socket path may have; use --socket-dir")
    return path


def recv_line(sock: socket.socket, limit: int | None = None) -> bytes:
    """One newline-ended JSON message of the control protocol (or what came before the peer hung up)."""
    data = b""
    while not data.endswith(b"\n"):
        piece = sock.recv(65536)
        if not piece:
            break
        data += piece
        if limit is not None and len(data) > limit:
            raise DiskkitError("control", "request too large")
    return data


def request(control: Path, obj: dict, timeout: float = REQUEST_TIMEOUT) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(control))
        sock.sendall(json.dumps(obj).encode() + b"\n")
        data = recv_line(sock)
    if not data:
        raise DiskkitError(control, "the disk server closed the connection without answering")
    return json.loads(data)

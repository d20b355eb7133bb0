"""Where the node's disk server listens and how it is spoken to: one JSON object per line, each way.

    {"op": "open", "image": REF, "path": P, "platform": "linux/amd64", "registry": {...}, "marked": true,
     "credentials": [{"registry": HOST, "username": U, "password": P, "identityToken": T}, ...],
     "clients": 2,   NBD connections to expect (default 1): a server exiting when idle waits for them
     "trace": TOKEN} optional, 16-64 hex digits: record the reads of the VM that connects as "trace"
        -> {"ok": true, "export": NAME, "socket": NBD_SOCKET, "url": "nbd+unix:///NAME?socket=...", ...,
            "trace": "NAME.trace-TOKEN", "traceUrl": "nbd+unix:///NAME.trace-TOKEN?socket=..."}   (with "trace")
        -> {"ok": false, "seekable": false, "reason": "..."}   (pull it whole instead)
        -> {"ok": false, "error": "...", "exit": 8}            (refused, as a pull would be; its exit status)
    {"op": "files", "image": REF, "paths": [P, ...], "platform": ..., "registry": {...}, "marked": true}   kernelBoot files
        -> {"ok": true, "files": {P: {"path": FILE_IN_THE_CACHE, ...}}}   (as `launcher pull` records them)
        -> {"ok": false, "seekable": false, "reason": "..."}              (pull them whole instead)
    {"op": "status"} -> {"ok": true, "pid": N, "exports": [...]}
    {"op": "forget", "uid": N} -> {"ok": true}   (root: uid N's grants and NBD socket go; its uid is given to another VM)
    {"op": "trace", "trace": TOKEN} -> {"ok": true, "traces": [{"image", "digest", "path", "layer", "size", "export",
        "reads": [[OFFSET, LENGTH], ...], "truncated": false}, ...]}   (the opener's alone; recording ends)

`registry` holds the client's options without credentials or auth file paths: a client sends its
own user's credentials for the hosts the image may come from, looked up as a pull would (a VMI's
imagePullSecret when it has one), and its TLS client identity for them,
`"identities": [{"registry": HOST, "cert": PEM, "key": PEM}, ...]`, read from its own `--cert-dir`
or certs.d; a server run by another user uses those or none, never its own
(launcher.diskserver.clientoptions).
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


def credentials_to_wire(found) -> list[dict]:
    """(host, Credentials) pairs as a request carries them."""
    return [{"registry": host, "username": c.username, "password": c.password, "identityToken": c.identity_token} for host, c in found]


def credentials_from_wire(sent) -> tuple:
    """A request's credentials as RegistryOptions.inline_credentials takes them; () when none were sent."""
    from diskkit.registry.authfile import Credentials  # here: `launcher run` imports this module before any registry code

    if sent is None:
        return ()
    if not isinstance(sent, list) or not all(isinstance(c, dict) for c in sent):
        raise DiskkitError("control", "credentials must be a list of {registry, username, password, identityToken}")
    out = []
    for entry in sent:
        host, user, password, token = (entry.get(k) for k in ("registry", "username", "password", "identityToken"))
        if not all(isinstance(v, str) for v in (host, user, password)) or not isinstance(token, (str, type(None))):
            raise DiskkitError("control", "credentials must be a list of {registry, username, password, identityToken}")
        out.append((host, Credentials(user, password, token)))
    return tuple(out)


def identities_to_wire(found) -> list[dict]:
    """(host, tlsfiles.Identity) pairs as a request carries them."""
    return [{"registry": host, "cert": i.cert.decode("ascii", "replace"), "key": i.key.decode("ascii", "replace")} for host, i in found]


def identities_from_wire(sent) -> tuple:
    """A request's TLS client identities as RegistryOptions.inline_identities takes them, each one
    OpenSSL accepts (a key that does not match, or is encrypted, is refused in one line); () when none."""
    from diskkit.registry.tlsfiles import Identity, checked

    if sent is None:
        return ()
    wrong = "identities must be a list of {registry, cert, key} (PEM)"
    if not isinstance(sent, list) or not all(isinstance(i, dict) for i in sent):
        raise DiskkitError("control", wrong)
    out = []
    for entry in sent:
        host, cert, key = (entry.get(k) for k in ("registry", "cert", "key"))
        if not all(isinstance(v, str) and v for v in (host, cert, key)):
            raise DiskkitError("control", wrong)
        out.append((host, checked(Identity(cert.encode(), key.encode(), f"the client's for {host}"))))
    return tuple(out)


def request(control: Path, obj: dict, timeout: float = REQUEST_TIMEOUT) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(control))
        sock.sendall(json.dumps(obj).encode() + b"\n")
        data = recv_line(sock)
    if not data:
        raise DiskkitError(control, "the disk server closed the connection without answering")
    return json.loads(data)

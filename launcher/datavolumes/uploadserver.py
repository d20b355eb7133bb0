"""The upload endpoint of upload DataVolumes: CDI's upload proxy and upload server in one process,
with a resumable protocol on top of CDI's one-shot POST.

Every request carries `Authorization: Bearer TOKEN`, a token `launcher dv token` signs for one
DataVolume (HMAC-SHA256 with the node's key, with an expiry), as CDI's upload proxy checks the
token of an UploadTokenRequest.

    GET    /diskkit/v1/uploads/NS/NAME            {"phase", "offset", "progress", "message"}
    PUT    /diskkit/v1/uploads/NS/NAME            Content-Range: bytes START-END/TOTAL, body = those bytes;
                                                  200 {"offset"}, or 409 {"offset"} when START is not the
                                                  server's offset (the client continues from there)
    POST   /diskkit/v1/uploads/NS/NAME/complete   {"size", "sha256"}: checked, validated and converted
                                                  as an import is; 200 {"phase": "Succeeded", ...}
    DELETE /diskkit/v1/uploads/NS/NAME            discard a partial upload
    POST   /v1beta1/upload                        virtctl's one-shot upload (the token names the DV)

Received bytes go to a part file in the claim directory, fsynced when a request ends however it
ends, so the offset survives a dropped connection and a restart of this server.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import http.server
import json
import os
import re
import secrets
import socketserver
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlsplit

from diskkit.errors import DiskkitError
from diskkit.streams.sparse import SparseWriter
from launcher.datavolumes import archive, dvstate, importer
from launcher.datavolumes.dvstate import Target
from launcher.hostfs import asowner
from launcher.hostfs.dirfd import Dir
from launcher.spec import datavolume as dvm
from launcher.spec.datavolume import DataVolume
from launcher.volumes.files import KUBEVIRT_QEMU
from launcher.volumes.storage import Storage

PREFIX = "/diskkit/v1/uploads/"
CDI_PATHS = ("/v1beta1/upload", "/v1beta1/upload-async")
CHUNK = 1 << 20
LOCK_WAIT = 10.0  # a dropped connection's handler may still be finishing its write
CLIENT_TIMEOUT = 120.0  # a client silent this long is gone; its handler lets go of the DataVolume
DEFAULT_TTL = 3600
BUSY = "another upload to this DataVolume is in progress"  # 503: the client retries
PART = "upload"  # the part's name once moved into the work directory
_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")

Say = Callable[[str], None]


# ---------------------------------------------------------------- tokens

def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def node_key(root: Path) -> bytes:
    """The signing key of this node's upload tokens (created once, readable by its owner only)."""
    path = root / "upload.key"
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    tmp = path.with_name(f".upload.key.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # first writer wins; a concurrent one reads the winner's key
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_bytes()


def issue_token(key: bytes, namespace: str, name: str, ttl: float = DEFAULT_TTL) -> str:
    claims = _b64(json.dumps({"ns": namespace, "name": name, "exp": int(time.time() + ttl)}, separators=(",", ":")).encode())
    return f"{claims}.{_b64(hmac.new(key, claims.encode(), hashlib.sha256).digest())}"


def token_subject(key: bytes, token: str) -> tuple[str, str] | None:
    """(namespace, name) a valid, unexpired token was issued for; None for anything else."""
    claims, _, signature = token.partition(".")
    try:
        expected = hmac.new(key, claims.encode(), hashlib.sha256).digest()
        if not hmac.compare_digest(expected, _unb64(signature)):
            return None
        body = json.loads(_unb64(claims))
        if not isinstance(body, dict) or not isinstance(body.get("exp"), int) or body["exp"] < time.time():
            return None
        return str(body["ns"]), str(body["name"])
    except (ValueError, KeyError, TypeError):
        return None


# ---------------------------------------------------------------- the server

class _Refused(Exception):
    def __init__(self, status: int, message: str, **extra):
        super().__init__(message)
        self.status, self.message, self.extra = status, message, extra


@dataclass
class _Upload:
    dv: DataVolume
    target: Target


class UploadServer:
    """Serves the upload DataVolumes among `datavolumes` until closed."""

    def __init__(self, listen: str, store: Storage, datavolumes: list[DataVolume], key: bytes, say: Say,
                 tls: tuple[str, str] | None = None):
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise DiskkitError(f"--upload-listen {listen}", "must be HOST:PORT")
        self.store, self.key, self.say = store, key, say
        self.uploads = {(dv.namespace, dv.name): dv for dv in datavolumes if dv.source.kind == "upload"}
        self._httpd = _HTTPServer((host.strip("[]"), int(port)), _Handler)
        self._httpd.app = self
        scheme = "http"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*tls)
            self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
            scheme = "https"
        bound_host, bound_port = self._httpd.server_address[:2]
        self.url = f"{scheme}://{bound_host}:{bound_port}"
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        for dv in self.uploads.values():
            try:
                target = dvstate.resolve(dv, self.store)
                self._ready(target)
                self.say(f"DataVolume {dv.key}: {dvstate.current_phase(target)}")
            except DiskkitError as exc:
                self.say(f"note: {exc.line()}")
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="upload-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def wait(self) -> None:
        """Serve until interrupted (SIGTERM and Ctrl-C arrive as KeyboardInterrupt)."""
        try:
            while self._thread is not None and self._thread.is_alive():
                self._thread.join(timeout=1)
        finally:
            self.close()

    # --- request handling (called from handler threads) -----------------------------------

    def _ready(self, target: Target) -> str:
        """A bound upload DataVolume is UploadReady while this server serves it."""
        phase = dvstate.current_phase(target)
        if phase == dvm.UPLOAD_SCHEDULED:
            dvstate.record(target, phase=dvm.UPLOAD_READY)
            phase = dvm.UPLOAD_READY
        return phase

    def upload_for(self, authorization: str | None, namespace: str | None, name: str | None) -> _Upload:
        scheme, _, token = (authorization or "").partition(" ")
        subject = token_subject(self.key, token.strip()) if scheme.lower() == "bearer" else None
        if subject is None or (namespace is not None and subject != (namespace, name)):
            raise _Refused(401, "the upload token is missing, invalid, expired or for another DataVolume")
        dv = self.uploads.get(subject)
        if dv is None:
            raise _Refused(404, f"DataVolume {subject[0]}/{subject[1]} is not an upload DataVolume served here")
        try:
            return _Upload(dv, dvstate.resolve(dv, self.store))
        except DiskkitError as exc:
            raise _Refused(500, exc.line()) from None

    def status(self, up: _Upload) -> dict:
        phase = self._ready(up.target)
        status = dvstate.read_status(up.target)
        return {"name": up.dv.name, "namespace": up.dv.namespace, "phase": phase,
                "offset": up.target.part_size(),
                "progress": status.progress, "message": status.message}

    def _admit(self, up: _Upload) -> None:
        refusal = dvm.can_upload(self._ready(up.target))
        if refusal:
            raise _Refused(409, refusal, phase=dvstate.current_phase(up.target))

    def receive(self, up: _Upload, handler: _Handler, start: int, length: int, total: int | None) -> int:
        """Append `length` body bytes at `start`; returns the new offset. A body cut short keeps what
        arrived (the client resumes from it) and raises ConnectionError."""
        self._admit(up)
        limit = importer.fetch_limit(up.target)
        if max(total or 0, start + length) > limit:
            # as an http import: no more than the claim holds, however many bytes the client offers
            raise _Refused(413, f"{max(total or 0, start + length)} bytes are more than the claim holds (its size and qcow2"
                                f" overhead, {limit} bytes). A larger PVC is required")
        with _working(up), up.target.claim() as claim:
            offset = up.target.part_size()
            if start == 0 and offset and total is None:
                offset = 0  # virtctl's one-shot POST always starts over
            if start != offset:
                raise _Refused(409, f"the server holds {offset} bytes; continue from there", offset=offset)
            received = 0
            # A part planted as a link (to a root file, say a crontab) is refused, never appended to; in a
            # user's claim the user opens it, so even a link would lead only to a file of the user's.
            owner = asowner.owner_of(claim)
            if owner is None:
                fd = claim.open_file(dvstate.UPLOAD_PART, os.O_RDWR, create=0o640)
            else:
                fd = asowner.open_as(owner, claim, dvstate.UPLOAD_PART, os.O_RDWR, create=0o640)
            with os.fdopen(fd, "r+b") as out:
                out.truncate(offset)
                out.seek(offset)
                writer = SparseWriter(out)
                try:
                    while received < length:
                        chunk = handler.rfile.read(min(CHUNK, length - received))
                        if not chunk:
                            break
                        writer.write(chunk)
                        received += len(chunk)
                except OSError:
                    pass  # reset or timed out: what arrived is kept below
                finally:
                    out.truncate(offset + received)
                    out.flush()
                    os.fsync(out.fileno())
            new = offset + received
            if total:
                dvstate.record(up.target, progress=f"{100.0 * new / total:.2f}%")
            if received < length:
                raise ConnectionError(f"body cut at {new} bytes")
            return new

    def complete(self, up: _Upload, size: int, digest: str | None) -> dict:
        """Check what arrived against the client's size and sha256, then validate and convert it
        (formats, no backing file, `A larger PVC is required`) into disk.img, as an import is."""
        self._admit(up)
        with _working(up), up.target.claim() as claim:
            held = up.target.part_size()
            if held != size:
                raise _Refused(409, f"the server holds {held} of {size} bytes; send the rest first", offset=held)
            shown = f"upload to DataVolume {up.dv.key}"
            self.say(f"DataVolume {up.dv.key}: received {size} bytes, converting")
            progress = importer.Progress(up.target)
            owner = asowner.owner_of(claim)
            try:
                if owner is None:
                    done = self._convert(up, claim, digest, shown, progress)
                else:
                    # In a user's claim the user checks and converts what it uploaded (see importer.fill).
                    done = asowner.run_as(owner, lambda send: self._convert(up, claim, digest, shown, importer.Relay(send)),
                                          progress.receive)
            except DiskkitError as exc:
                dvstate.remove_scratch(up.target)  # resuming cannot fix a bad image: the part goes too
                dvstate.record(up.target, message=exc.line())
                raise _Refused(400, exc.line(), offset=0) from None
            except BaseException:
                dvstate.remove_scratch(up.target)
                raise
        if "sha256" in done:
            raise _Refused(422, f"sha256 of the received data is {done['sha256']}, the client sent {digest}; the upload starts over", offset=0)
        dvstate.record(up.target, phase=dvm.SUCCEEDED, progress="100.0%", message="Upload Complete")
        self.say(f"DataVolume {up.dv.key}: Succeeded")
        disk = up.target.disk_stat()
        return {"name": up.dv.name, "namespace": up.dv.namespace, "phase": dvm.SUCCEEDED,
                "size": disk.st_size if disk is not None else size, "sha256": digest, "notes": done["notes"]}

    def _convert(self, up: _Upload, claim: Dir, digest: str | None, shown: str, progress) -> dict:
        """Check the part against the client's sha256 and install it: {"notes"}, or {"sha256"} (what
        it is) when it is not what the client sent (the part is gone then; the upload starts over).
        What arrived first moves into a directory of our own, which the claim's owner cannot write
        (unless we are the owner): it cannot be swapped between the checks and the conversion."""
        work_name = importer.scratch("work")
        work = claim.mkdir(work_name, 0o700)
        try:
            claim.rename(dvstate.UPLOAD_PART, work, PART)
            work.regular(PART)
            if digest is not None:
                actual = _sha256(work, PART)
                if actual != digest:
                    return {"sha256": actual}
            try:
                return {"notes": self._install(up, claim, work, shown, progress)}
            except DiskkitError:
                raise
            except BaseException:
                if work.lstat(PART) is not None:
                    work.rename(PART, claim, dvstate.UPLOAD_PART)  # interrupted: the upload can resume
                raise
        finally:
            claim.discard(work, work_name)

    def _install(self, up: _Upload, claim: Dir, work: Dir, shown: str, progress) -> list[str]:
        if up.dv.content_type != "archive":
            return importer.install(up.target, claim, work, PART, shown, progress, self.store.tolerance)
        archive.unpack(work.proc / PART, claim, work, up.target.size, shown, KUBEVIRT_QEMU)
        return []

    def discard(self, up: _Upload) -> dict:
        with _working(up), up.target.claim() as claim:
            claim.unlink(dvstate.UPLOAD_PART)
        return {"offset": 0}


@contextlib.contextmanager
def _working(up: _Upload) -> Iterator[None]:
    """The claim's work lock for one request; another importer or upload holding it is a 503 to retry."""
    with dvstate.work_lock(up.target, wait=True, timeout=LOCK_WAIT) as got:
        if not got:
            raise _Refused(503, BUSY)
        yield


def _sha256(work: Dir, name: str) -> str:
    with os.fdopen(work.open_file(name), "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class _HTTPServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    app: UploadServer

    def handle_error(self, request, client_address):
        pass  # clients that went away are the resumable protocol's business, not the log's


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = CLIENT_TIMEOUT
    server: _HTTPServer

    def log_message(self, *args):
        pass

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode() + b"\n"
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self) -> tuple[str | None, str | None, str]:
        path = urlsplit(self.path).path
        if path in CDI_PATHS:
            return None, None, "cdi"
        if path.startswith(PREFIX):
            parts = path[len(PREFIX):].split("/")
            if len(parts) == 2:
                return parts[0], parts[1], "upload"
            if len(parts) == 3 and parts[2] == "complete":
                return parts[0], parts[1], "complete"
        raise _Refused(404, f"no such endpoint: {path}")

    def _handle(self, method: str) -> None:
        app = self.server.app
        length = int(self.headers.get("Content-Length") or 0)
        try:
            namespace, name, kind = self._route()
            up = app.upload_for(self.headers.get("Authorization"), namespace, name)
            if method == "GET" and kind == "upload":
                self._reply(200, app.status(up))
            elif method == "PUT" and kind == "upload":
                match = _RANGE.fullmatch(self.headers.get("Content-Range") or "")
                if not match:
                    raise _Refused(400, "Content-Range: bytes START-END/TOTAL is required")
                start, end, total = map(int, match.groups())
                if end - start + 1 != length or end >= total:
                    raise _Refused(400, "Content-Range does not match Content-Length")
                self._reply(200, {"offset": app.receive(up, self, start, length, total)})
            elif method == "POST" and kind == "complete":
                body = json.loads(self.rfile.read(length) or b"{}")
                self._reply(200, app.complete(up, int(body["size"]), body.get("sha256")))
            elif method == "DELETE" and kind == "upload":
                self._reply(200, app.discard(up))
            elif method == "POST" and kind == "cdi":
                size = app.receive(up, self, 0, length, None)
                self._reply(200, app.complete(up, size, None))
            else:
                raise _Refused(405, f"{method} is not allowed here")
        except _Refused as refused:
            if method in ("PUT", "POST") and length:
                self.close_connection = True  # the body was not read
            self._reply(refused.status, {"message": refused.message, **refused.extra})
        except ConnectionError:
            self.close_connection = True  # the client is gone; it asks for the offset when it comes back
        except (ValueError, KeyError) as exc:
            self.close_connection = True
            self._reply(400, {"message": f"bad request: {exc}"})
        except (DiskkitError, OSError) as exc:
            self.close_connection = True
            self._reply(500, {"message": exc.line() if isinstance(exc, DiskkitError) else str(exc)})

    def do_GET(self):
        self._handle("GET")

    def do_PUT(self):
        self._handle("PUT")

    def do_POST(self):
        self._handle("POST")

    def do_DELETE(self):
        self._handle("DELETE")

"""Send a disk to an upload DataVolume (the endpoint `launcher serve --upload-listen` runs).

Unlike virtctl image-upload, which POSTs the whole file and starts again at byte 0 after any
failure, a dropped connection costs only what was in flight: the client asks the server how many
bytes it holds and sends the rest with a Content-Range. The sha256 of the file, computed on a
thread while the bytes go out, is checked by the server before the disk is converted.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from diskkit.errors import DiskkitError
from diskkit.progress import Reporter

PREFIX = "/diskkit/v1/uploads"
WFFC = "WaitForFirstConsumer"
READY = "UploadReady"
SEND_BLOCK = 1 << 20
CONNECT_TIMEOUT, READ_TIMEOUT = 30, 300


@dataclass(frozen=True)
class UploadOptions:
    url: str
    token: str
    verify: bool | str = True  # False, or a CA bundle path
    retries: int = 5
    wait: float = 60.0  # for an UploadScheduled DataVolume to become UploadReady


class _Busy(Exception):
    """The server is still busy with an earlier request for this DataVolume (503): try again shortly."""


class _Slice:
    """The file from `start` to its end, read in 1 MiB blocks, reporting what was read."""

    def __init__(self, path: Path, start: int, size: int, advance: Callable[[int], None]):
        self._file = open(path, "rb")
        self._file.seek(start)
        self._left = size - start
        self._advance = advance

    def __len__(self) -> int:
        return self._left

    def read(self, n: int = -1) -> bytes:
        # http.client asks for small blocks; bigger ones cost fewer system calls and it sends them whole.
        want = self._left if n is None or n < 0 else min(max(n, SEND_BLOCK), self._left)
        data = self._file.read(want)
        self._left -= len(data)
        self._advance(len(data))
        return data

    def close(self) -> None:
        self._file.close()


class _Hasher(threading.Thread):
    """sha256 of the file on a thread of its own (hashlib releases the GIL), while the upload runs."""

    def __init__(self, path: Path):
        super().__init__(daemon=True, name="upload-sha256")
        self.path, self.digest, self.error = path, None, None

    def run(self) -> None:
        try:
            with open(self.path, "rb") as f:
                self.digest = hashlib.file_digest(f, "sha256").hexdigest()
        except OSError as exc:
            self.error = exc

    def result(self) -> str:
        self.join()
        if self.error is not None:
            raise DiskkitError(self.path, f"cannot be read ({self.error.strerror})")
        return self.digest


def _message(resp) -> str:
    try:
        return resp.json().get("message") or resp.reason
    except ValueError:
        return resp.text.strip().splitlines()[0] if resp.text.strip() else resp.reason


class _Session:
    def __init__(self, opts: UploadOptions, namespace: str, name: str):
        import requests

        self.requests = requests
        self.where = f"DataVolume {namespace}/{name}"
        self.base = f"{opts.url.rstrip('/')}{PREFIX}/{namespace}/{name}"
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"Bearer {opts.token}"
        self.http.verify = opts.verify
        if opts.verify is False:
            import urllib3

            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)

    def fail(self, resp) -> DiskkitError:
        if resp.status_code == 401:
            return DiskkitError(self.where, f"upload refused: {_message(resp)} (HTTP 401)")
        return DiskkitError(self.where, f"{_message(resp)} (HTTP {resp.status_code})")

    def status(self) -> dict:
        resp = self.http.get(self.base, timeout=(CONNECT_TIMEOUT, READ_TIMEOUT))
        if resp.status_code != 200:
            raise self.fail(resp)
        return resp.json()


def upload(opts: UploadOptions, namespace: str, name: str, path: Path, reporter: Reporter) -> dict:
    """Upload `path`; returns the server's final answer (phase Succeeded, size, sha256)."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise DiskkitError(path, f"cannot be read ({exc.strerror})") from None
    if size == 0:
        raise DiskkitError(path, "is empty")
    s = _Session(opts, namespace, name)
    requests = s.requests
    try:
        state = _ready(s, opts)
    except requests.exceptions.RequestException as exc:
        raise DiskkitError(s.where, f"cannot reach the upload endpoint {opts.url} ({_reason(exc)})") from None
    hasher = _Hasher(path)
    hasher.start()
    offset = state["offset"]
    restarted = False
    with reporter.task(f"uploading {path.name}", size) as task:
        sent = [0]

        def advance(n: int) -> None:
            sent[0] += n
            task.advance(n)

        if offset > size:  # a longer file was being sent: start over
            _discard(s)
            offset = 0
        advance(offset)
        failures = 0
        while True:
            try:
                if offset < size:
                    offset = _send(s, path, offset, size, advance)
                    advance(offset - sent[0])  # the bar shows what the server holds
                    continue
                result = _complete(s, size, hasher.result())
                if result is None:  # the server dropped what it had (checksum mismatch): once more from 0
                    if restarted:
                        raise DiskkitError(s.where, "the server received different bytes twice; is the file changing?")
                    restarted, offset = True, 0
                    advance(-sent[0])
                    continue
                reporter.event({"event": "done", **result})
                return result
            except (requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                    requests.exceptions.ChunkedEncodingError, _Busy) as exc:
                failures += 1
                if failures > opts.retries:
                    raise DiskkitError(s.where, f"upload failed after {opts.retries} retries ({_reason(exc)});"
                                                " run the same command again to continue") from None
                time.sleep(min(0.5 * 2 ** (failures - 1), 10))
                try:
                    state = s.status()
                except requests.exceptions.RequestException:
                    continue
                if state.get("phase") == "Succeeded":  # the answer to `complete` was what got lost
                    result = {**state, "sha256": hasher.result()}
                    reporter.event({"event": "done", **result})
                    return result
                held = state["offset"]
                reporter.event({"event": "resume", "offset": held, "reason": _reason(exc)})
                reporter.note(f"connection lost ({_reason(exc)}); resuming at byte {held} of {size}")
                advance(held - sent[0])
                offset = held


def _ready(s: _Session, opts: UploadOptions) -> dict:
    """The status once the DataVolume takes uploads; at once an error when it never will as things are."""
    deadline = time.monotonic() + opts.wait
    while True:
        state = s.status()
        phase = state.get("phase")
        if phase == READY:
            return state
        if phase == WFFC:
            raise DiskkitError(s.where, f"cannot upload to DataVolume in state {WFFC}")
        if phase == "Succeeded":
            raise DiskkitError(s.where, "has already Succeeded; its claim holds an uploaded disk")
        if phase == "Failed" or time.monotonic() >= deadline:
            raise DiskkitError(s.where, f"not ready for an upload (phase {phase}{': ' + state['message'] if state.get('message') else ''})")
        time.sleep(1)


def _send(s: _Session, path: Path, offset: int, size: int, advance: Callable[[int], None]) -> int:
    body = _Slice(path, offset, size, advance)
    try:
        resp = s.http.put(s.base, data=body, timeout=(CONNECT_TIMEOUT, READ_TIMEOUT),
                          headers={"Content-Range": f"bytes {offset}-{size - 1}/{size}", "Content-Type": "application/octet-stream"})
    finally:
        body.close()
    if resp.status_code == 200:
        return int(resp.json()["offset"])
    if resp.status_code == 409 and "offset" in _json(resp):
        return int(_json(resp)["offset"])  # the server holds another offset: continue from there
    if resp.status_code == 503:
        raise _Busy(_message(resp))
    raise s.fail(resp)


def _complete(s: _Session, size: int, digest: str) -> dict | None:
    resp = s.http.post(f"{s.base}/complete", json={"size": size, "sha256": digest}, timeout=(CONNECT_TIMEOUT, None))
    if resp.status_code == 200:
        return resp.json()
    if resp.status_code == 422:
        return None
    if resp.status_code == 503:
        raise _Busy(_message(resp))
    raise s.fail(resp)


def _discard(s: _Session) -> None:
    resp = s.http.delete(s.base, timeout=(CONNECT_TIMEOUT, READ_TIMEOUT))
    if resp.status_code != 200:
        raise s.fail(resp)


def _json(resp) -> dict:
    try:
        body = resp.json()
        return body if isinstance(body, dict) else {}
    except ValueError:
        return {}


def _reason(exc: BaseException) -> str:
    text = str(exc.args[0] if exc.args else exc)
    return text.split(": ")[-1].strip("()'\" ")[:160] or type(exc).__name__

"""An http(s) file read once, front to back, as a stream that outlives dropped connections.

A body cut short is asked for again from the byte it stopped at (`Range: bytes=N-`), with
`If-Range` naming the first answer's strong ETag (else its Last-Modified), so a server whose file
changed meanwhile answers with the whole new file instead of splicing two files together (RFC 9110
13.1.5); that, or a server that does not resume, raises SourceChanged and the caller starts over.
Connection failures, 408, 429 and 5xx are retried with backoff (Retry-After wins).
"""

from __future__ import annotations

import io
import time
from typing import Callable

import requests
import urllib3

from diskkit.errors import DiskkitError
from diskkit.registry.client import failure_reason, retry_after
from diskkit.registry.options import RegistryOptions
from diskkit.source.urls import check_url, shown

TIMEOUT = (30, 120)  # connect, and between two reads: a stalled server counts as a dropped one
RETRYABLE = (408, 429, 500, 502, 503, 504)
_DROPPED = (urllib3.exceptions.HTTPError, requests.exceptions.RequestException, OSError)


class SourceChanged(DiskkitError):
    """The upstream file cannot be continued where it stopped: it changed, or the server does not resume."""


class RemoteFile(io.RawIOBase):
    def __init__(self, url: str, opts: RegistryOptions, note: Callable[[str], None] | None = None):
        check_url(url)
        self.url, self.shown, self.opts = url, shown(url), opts
        self.note = note or (lambda line: None)
        self.offset = 0
        self.total: int | None = None
        self.validator: str | None = None
        self.attempts = 0  # failures so far, each waited out and retried
        self._session = requests.Session()
        self._session.headers["User-Agent"] = "diskkit"
        self._response: requests.Response | None = None
        try:
            self._open()
        except BaseException:
            self._session.close()
            raise

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        view = memoryview(buf)
        while True:
            problem = None
            try:
                assert self._response is not None
                data = self._response.raw.read(min(len(view), 1 << 20))
            except _DROPPED as exc:
                data, problem = b"", failure_reason(exc)
            if data:
                view[: len(data)] = data
                self.offset += len(data)
                return len(data)
            if problem is None and (self.total is None or self.offset >= self.total):
                return 0
            self._failed(problem or f"the body ended after {self.offset} of {self.total} bytes")
            self.note(f"{self.shown}: the connection dropped at byte {self.offset} of {self.total or '?'}; resuming from there")
            self._open()

    def _failed(self, problem: str) -> None:
        if self._response is not None:
            self._response.close()
            self._response = None
        if self.attempts >= self.opts.retries:
            raise DiskkitError(self.shown, f"download kept failing at byte {self.offset} of {self.total or '?'} ({problem}; {self.attempts + 1} attempts)")
        time.sleep(retry_after(None, self.attempts, self.opts))
        self.attempts += 1

    def _open(self) -> None:
        while True:
            headers = {"Accept-Encoding": "identity"}  # the file's own bytes: they are what the checksum covers
            if self.offset:
                headers["Range"] = f"bytes={self.offset}-"
                if self.validator:
                    headers["If-Range"] = self.validator
            try:
                response = self._session.get(self.url, headers=headers, stream=True, timeout=TIMEOUT)
            except requests.exceptions.SSLError as exc:
                raise DiskkitError(self.shown, f"TLS verification failed ({failure_reason(exc)}); a private CA goes in REQUESTS_CA_BUNDLE") from None
            except (requests.exceptions.InvalidSchema, requests.exceptions.InvalidURL, requests.exceptions.TooManyRedirects) as exc:
                raise DiskkitError(self.shown, f"the request failed ({type(exc).__name__}: {failure_reason(exc)})") from None
            except _DROPPED as exc:
                self._failed(f"cannot connect: {failure_reason(exc)}" if not self.offset else failure_reason(exc))
                continue
            status = response.status_code
            if status in RETRYABLE:
                response.close()
                if self.attempts >= self.opts.retries:
                    raise DiskkitError(self.shown, f"HTTP {status} {response.reason} ({self.attempts + 1} attempts)")
                time.sleep(retry_after(response, self.attempts, self.opts))
                self.attempts += 1
                continue
            if status == 200 and not self.offset:
                self._first(response)
                return
            if status == 206 and self.offset and self._continues(response):
                self._response = response
                return
            response.close()
            if self.offset and status in (200, 206, 416):
                why = "it changed on the server" if self._changed(response) else "the server does not resume downloads"
                raise SourceChanged(self.shown, f"cannot continue at byte {self.offset}: {why}")
            raise DiskkitError(self.shown, f"expected status code 200, got {status} ({response.reason})")

    def _first(self, response: requests.Response) -> None:
        length = response.headers.get("Content-Length", "")
        self.total = int(length) if length.isdigit() else None
        etag = response.headers.get("ETag")
        # A weak ETag may not be used in If-Range (RFC 9110 13.1.5); a date may.
        self.validator = etag if etag and not etag.startswith("W/") else response.headers.get("Last-Modified")
        self._response = response

    def _continues(self, response: requests.Response) -> bool:
        """Whether a 206 holds this file's bytes from our offset on (same validator, same total)."""
        answered = response.headers.get("Content-Range", "")
        if not answered.startswith(f"bytes {self.offset}-"):
            return False
        total = answered.rpartition("/")[2]
        return not self._changed(response) and (self.total is None or total == str(self.total))

    def _changed(self, response: requests.Response) -> bool:
        etag, modified = response.headers.get("ETag"), response.headers.get("Last-Modified")
        if self.validator is None:
            return True  # nothing pins the file: a restart is the only safe reading
        return self.validator not in (etag, modified)

    def close(self) -> None:
        if self._response is not None:
            self._response.close()
            self._response = None
        self._session.close()
        super().close()


def read_small(url: str, opts: RegistryOptions, limit: int) -> bytes:
    """A whole small file (a checksum file), retried as a disk is; more than `limit` bytes refused."""
    with RemoteFile(url, opts) as remote:
        if remote.total is not None and remote.total > limit:
            raise DiskkitError(remote.shown, f"is {remote.total} bytes; a checksum file over {limit} bytes is refused")
        data = io.BufferedReader(remote).read(limit + 1)
    if len(data) > limit:
        raise DiskkitError(shown(url), f"is more than {limit} bytes; a checksum file that large is refused")
    return data

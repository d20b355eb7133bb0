"""Byte ranges of a registry blob, fetched with HTTP range requests through the registry client (auth,
TLS, retries, resumed after dropped connections). What the bytes must hash to is the caller's
business: the disk server's lazy exports and the node's delta pulls both check every piece they use."""

from __future__ import annotations

import threading
from typing import Callable

import requests
import urllib3

from diskkit.errors import AuthError, RangesRefused, RegistryError
from diskkit.registry.client import Registry, failure_reason, get_blob, retry_after


ARRIVED_PIECE = 64 << 10


class BlobRanges:
    """Byte ranges of one registry blob, resumed after dropped connections as ResumableBlob does."""

    def __init__(self, registry: Registry, repository: str, digest: str, size: int, refuse_whole: bool = False):
        """`refuse_whole`: a range answered with the whole blob raises RangesRefused at once, rather
        than being read up to the range (for a caller that would rather fetch the blob another way)."""
        self.registry = registry
        self.repository = repository
        self.digest = digest
        self.size = size
        self.requests = 0
        self.received = 0  # bytes of the ranges asked for that arrived (a retried range counts twice)
        self.refuse_whole = refuse_whole
        self.stop = threading.Event()  # set when the server stops: no more waiting between retries

    def read(self, start: int, length: int, arrived: Callable[[bytearray], None] | None = None) -> bytes:
        """`length` bytes from `start`. The buffer grows with what arrives, never sized by `length`
        first: a length read from outside (a TOC, a descriptor) costs memory only as its bytes come,
        and each caller bounds what it asks for (diskkit.limits). `arrived(buf)` is called as the
        buffer grows (it only grows, retries included), so a caller can use its first bytes while
        the rest is on the way."""
        if start < 0 or length < 0 or start + length > self.size:
            raise ValueError(f"range {start}+{length} outside a {self.size}-byte blob")
        buf = bytearray()
        failures = 0
        while len(buf) < length:
            try:
                self._read_into(buf, start, length, arrived)
            except (AuthError, RangesRefused):
                raise
            except (RegistryError, requests.exceptions.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
                if failures >= self.registry.opts.retries:
                    if isinstance(exc, RegistryError):
                        raise
                    raise RegistryError(self.registry.host, f"blob {self.digest[:19]} range at {start + len(buf)} kept failing ({failure_reason(exc)})") from None
                if self.stop.wait(retry_after(None, failures, self.registry.opts)):
                    raise RegistryError(self.registry.host, f"blob {self.digest[:19]}: the server is stopping") from None
                failures += 1
        return bytes(buf)

    def _read_into(self, buf: bytearray, start: int, length: int, arrived: Callable[[bytearray], None] | None) -> None:
        first, last = start + len(buf), start + length - 1
        self.requests += 1
        response = get_blob(self.registry, self.repository, self.digest, first, last, skip_whole=not self.refuse_whole)
        if self.refuse_whole and response.status_code != 206:
            response.close()
            raise RangesRefused(self.registry.host, f"blob {self.digest[:19]}: the registry answered a range request with the whole blob")
        # When someone waits for the first bytes, what has come is handed over: read() would block until it has all it asked for.
        read = response.raw.read if arrived is None else getattr(response.raw, "read1", response.raw.read)  # urllib3 2
        try:
            while len(buf) < length:
                piece = read(min(length - len(buf), 1 << 20 if arrived is None else ARRIVED_PIECE))
                if not piece:
                    raise RegistryError(self.registry.host, f"blob {self.digest[:19]} range ended early at byte {start + len(buf)}")
                buf += piece
                self.received += len(piece)
                if arrived is not None:
                    arrived(buf)
        finally:
            response.close()


class RangeReader:
    """`read_range` of a repository's blobs that never reads a blob from its start up to the range
    when the registry ignores Range (a lazy TOC sits at the blob's end): such an answer raises
    RangesRefused, remembered in `refused`, and the caller reads the blob once, whole, instead."""

    def __init__(self, registry: Registry, repository: str):
        self.registry, self.repository = registry, repository
        self.received = 0
        self.refused: RangesRefused | None = None

    def read_range(self, desc, offset: int, size: int) -> bytes:
        ranges = BlobRanges(self.registry, self.repository, desc.digest, desc.size, refuse_whole=True)
        try:
            return ranges.read(offset, size)
        except RangesRefused as exc:
            self.refused = exc
            raise
        finally:
            self.received += ranges.received

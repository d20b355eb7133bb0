"""Readers and writers that hash what passes through them, so no blob is trusted unverified."""

from __future__ import annotations

import hashlib
import io
from typing import BinaryIO

from diskkit.errors import DiskkitError


class VerifyingReader(io.RawIOBase):
    """Passes a blob through, and raises at its end if the size or sha256 differ from the descriptor.

    Reading past the expected size is an error too: a longer blob is as wrong as a shorter one.
    """

    def __init__(self, raw: BinaryIO, digest: str, size: int, where: str):
        self._raw = raw
        self._digest = digest
        self._size = size
        self._where = where
        self._hash = hashlib.sha256()
        self._seen = 0
        self.verified = False

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        view = memoryview(buf)
        want = min(len(view), self._size - self._seen)
        if want <= 0:
            self._finish()
            return 0
        n = self._raw.readinto(view[:want]) if hasattr(self._raw, "readinto") else self._copy(view[:want])
        if not n:
            self._finish()
            return 0
        self._hash.update(view[:n])
        self._seen += n
        if self._seen == self._size:
            self._finish()
        return n

    def read(self, size: int = -1) -> bytes:
        # The source's own bytes, hashed and passed on: RawIOBase.read would copy them twice.
        if size is None or size < 0:
            return super().read(size)
        want = min(size, self._size - self._seen)
        data = self._raw.read(want) if want > 0 else b""
        if not data:
            self._finish()
            return b""
        self._hash.update(data)
        self._seen += len(data)
        if self._seen == self._size:
            self._finish()
        return data

    def _copy(self, view: memoryview) -> int:
        data = self._raw.read(len(view))
        view[: len(data)] = data
        return len(data)

    def _finish(self) -> None:
        if self.verified:
            return
        if self._seen != self._size:
            raise DiskkitError(self._where, f"blob {self._digest} is truncated: {self._seen} of {self._size} bytes")
        if self._raw.read(1):
            raise DiskkitError(self._where, f"blob {self._digest} is longer than its descriptor's {self._size} bytes")
        actual = "sha256:" + self._hash.hexdigest()
        if actual != self._digest:
            raise DiskkitError(self._where, f"blob {self._digest} does not match its digest (content hashes to {actual})")
        self.verified = True

    def drain(self) -> None:
        """Read to the end so the digest is checked even when the consumer stopped early."""
        while self.readinto(bytearray(1 << 20)):
            pass


def read_verified(raw: BinaryIO, digest: str, size: int, where: str, limit: int = 64 << 20) -> bytes:
    """A small blob (manifest, config) read whole and verified."""
    if size > limit:
        raise DiskkitError(where, f"{digest} is {size} bytes; manifests and configs over {limit} bytes are refused")
    reader = VerifyingReader(raw, digest, size, where)
    data = io.BufferedReader(reader).read()
    reader.drain()
    return data


class HashingReader(io.RawIOBase):
    """Counts and hashes what is read through it (the uncompressed side of a layer, for its diffID)."""

    def __init__(self, raw: BinaryIO):
        self._raw = raw
        self.hash = hashlib.sha256()
        self.count = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> bytes:
        # Passes the source's own chunks on: a 700 MB layer is not copied once more on its way.
        data = self._raw.read(size)
        self.hash.update(data)
        self.count += len(data)
        return data

    def readinto(self, buf) -> int:
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    @property
    def digest(self) -> str:
        return "sha256:" + self.hash.hexdigest()

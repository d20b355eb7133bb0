"""Read members of a tar archive in place (oci-archive and docker-archive sources), never extracting it."""

from __future__ import annotations

import io
import posixpath
import tarfile
from pathlib import Path
from typing import BinaryIO

from diskkit.errors import DiskkitError


class _Window(io.RawIOBase):
    """One member's bytes, read straight from the archive file at its offset."""

    def __init__(self, path: Path, offset: int, size: int):
        self._f = open(path, "rb")
        self._f.seek(offset)
        self._left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        if self._left <= 0:
            return 0
        view = memoryview(buf)[: min(len(buf), self._left)]
        n = self._f.readinto(view)
        self._left -= n
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


class TarStore:
    def __init__(self, path: Path):
        self.path = path
        if path.is_dir():
            raise DiskkitError(path, "is a directory, not an archive")
        try:
            with tarfile.open(path, "r:") as tar:
                members = tar.getmembers()
        except FileNotFoundError:
            raise DiskkitError(path, "archive does not exist") from None
        except (tarfile.TarError, OSError) as exc:
            raise DiskkitError(path, f"is not a readable tar archive ({exc})") from None
        self.members: dict[str, tarfile.TarInfo] = {}
        for m in members:
            name = m.name
            while name.startswith("./"):
                name = name[2:]
            name = posixpath.normpath(name.lstrip("/") or ".")
            if m.isfile():
                self.members[name] = m

    def member(self, rel: str) -> tarfile.TarInfo | None:
        while rel.startswith("./"):
            rel = rel[2:]
        return self.members.get(posixpath.normpath(rel.lstrip("/") or "."))

    def open(self, rel: str) -> BinaryIO:
        member = self.member(rel)
        if member is None:
            raise DiskkitError(self.path, f"archive has no member {rel}")
        return io.BufferedReader(_Window(self.path, member.offset_data, member.size), 1 << 20)

    def read(self, rel: str) -> bytes:
        with self.open(rel) as f:
            return f.read(64 << 20)

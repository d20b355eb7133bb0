"""Disks in the cache's extracted-disk store as exports: plain reads from the file, and the ref
records that point `launcher pull` at them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from launcher.node.cache import Cache


@dataclass
class Ref:
    """An image that resolved to an export: recorded as a pull would, once the disk is installed."""

    ref_key: str
    image: str
    digest: str


def record(cache: Cache, ref: Ref, final: Path) -> None:
    """The ref record `launcher pull` looks up first, pointing at the installed disk."""
    meta = cache.read_json(final.parent / "meta.json") or {}
    entry = {"path": str(final), "format": meta.get("format"), "virtual_size": meta.get("virtual_size"), "image": ref.image,
             "digest": ref.digest, "layer": meta.get("layer"), "member": meta.get("member")}
    cache.write_json(cache.ref_path(ref.ref_key), entry)


class InstalledDisk:
    """An export whose disk is complete and in the store: plain reads from the file."""

    def __init__(self, name: str, path: Path, description: str = ""):
        self.name = name
        self.path = path
        self.description = description or str(path)
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self.busy = False

    def read(self, offset: int, length: int) -> bytes:
        return os.pread(self.fd, length, offset)

    def read_ready(self, offset: int, length: int) -> bytearray | None:
        return cached_pread(self.fd, length, offset)

    def start(self) -> "InstalledDisk":
        return self

    def close(self) -> None:
        os.close(self.fd)

    def status(self) -> dict:
        return {"export": self.name, "description": self.description, "size": self.size, "verified": True, "installed": str(self.path)}


def cached_pread(fd: int, length: int, offset: int) -> bytearray | None:
    """The bytes if the page cache holds them all, else None: a read that would wait for the device
    goes to the NBD server's pool, so it holds up no other read of the connection."""
    buf = bytearray(length)
    try:
        got = os.preadv(fd, [buf], offset, os.RWF_NOWAIT)
    except OSError:  # EAGAIN: not all cached; EOPNOTSUPP: a filesystem without RWF_NOWAIT; else the pool's pread says
        return None
    return buf if got == length else None

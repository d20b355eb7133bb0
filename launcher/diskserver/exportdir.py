"""The files of one lazy export in the node cache: made atomically, reused by a restarted server
when they describe the same layout, written chunk by chunk, and hashed whole at the end.

    <root>/lazy/<export>/source.json   what the export is (written last: its presence means complete)
    <root>/lazy/<export>/disk.img      sparse; each chunk at its offset in the disk
    <root>/lazy/<export>/bitmap        one bit per chunk here (and verified, with a TOC); then one
                                       bit per chunk taken from the node's own chunks, not the registry
    <root>/lazy/<export>/state.json    counters, verified flag
    <root>/lazy/<export>/refs.json     the images that resolved to it, recorded for pulls once installed
    <root>/lazy/<export>/members.gz    v2: sparse; the chunks' gzip members as fetched, for the blob digest
    <root>/lazy/<export>/head, tail    the blob's bytes before and after the disk (v2: its members), for its digest

The bitmap is written only after the data it vouches for is synced, so a crash never marks a hole.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

from diskkit.errors import DiskkitError
from diskkit.streams.fsutil import write_atomic
from launcher.diskserver import imagewalk
from launcher.diskserver.exportid import around_digest
from launcher.diskserver.imagewalk import inflate_all
from launcher.diskserver.layout import Layout
from launcher.node.cache import Cache

LEFTOVERS = ("head", "tail", "bitmap", "disk.img", "members.gz", "refs.json")


def pack(bits: bytearray) -> bytes:
    out = bytearray((len(bits) + 7) // 8)
    index = -1
    while (index := bits.find(1, index + 1)) != -1:
        out[index >> 3] |= 1 << (index & 7)
    return bytes(out)


def unpack(data: bytes, count: int) -> bytearray:
    bits = bytearray(count)
    for index in range(min(count, len(data) * 8)):
        if data[index >> 3] >> (index & 7) & 1:
            bits[index] = 1
    return bits


class ExportDir:
    """lazy/<export>/ for `layout`: its disk and members files open for writing chunks."""

    def __init__(self, cache: Cache, layout: Layout, read: Callable[[int, int], bytes],
                 head: bytes | None = None, tail: bytes | None = None):
        """`read(start, length)` gives the blob's bytes, for a head or tail the caller has not got."""
        self.cache = cache
        self.layout = layout
        self.path = cache.root / "lazy" / layout.name
        self._zero = bytes(layout.chunk_size)
        self._prepare(read, head, tail)
        self.fd = os.open(self.path / "disk.img", os.O_RDWR)
        # v2 keeps each member as it arrives: the blob digest at the end needs no second fetch.
        self.members_fd = os.open(self.path / "members.gz", os.O_RDWR) if layout.members is not None else None

    def _prepare(self, read: Callable[[int, int], bytes], head: bytes | None, tail: bytes | None) -> None:
        """Reused when it describes this layout, else made afresh (atomically)."""
        current = self.cache.read_json(self.path / "source.json")
        if (current is not None and current.get("identity") == self.layout.identity.to_json()
                and current.get("layout") == self.layout.to_json() and (self.path / "disk.img").is_file()):
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        staging = self.path.parent / f".{self.layout.name}.{secrets.token_hex(4)}"
        staging.mkdir()
        try:
            lay = self.layout
            if head is None or len(head) != lay.data_start:
                head = read(0, lay.data_start)
            if tail is None or len(tail) != lay.layer_size - lay.data_end:
                tail = read(lay.data_end, lay.layer_size - lay.data_end)
            if around_digest(head, tail) != lay.around:
                raise DiskkitError(lay.name, "the registry's bytes around the disk are not those the export was opened with")
            (staging / "head").write_bytes(head)
            (staging / "tail").write_bytes(tail)
            with open(staging / "disk.img", "wb") as f:
                f.truncate(lay.size)  # sparse: chunks not fetched yet read as holes nobody is shown
            if lay.members is not None:
                with open(staging / "members.gz", "wb") as f:
                    f.truncate(lay.data_end - lay.data_start)
            (staging / "bitmap").write_bytes(bytes((lay.count + 7) // 8))
            write_atomic(staging / "source.json", json.dumps(self.source(), separators=(",", ":")).encode())
            if self.path.exists():
                shutil.rmtree(self.path)  # another layout under the same name: a stale or foreign entry
            staging.rename(self.path)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def source(self) -> dict:
        """source.json: the identity the directory is named by, and the layout to read the disk with."""
        return {"identity": self.layout.identity.to_json(), "layout": self.layout.to_json()}

    # --- what a restarted server finds ------------------------------------------------------------

    def bitmaps(self) -> tuple[bytearray, bytearray]:
        """The chunks here, and those of them taken from the node's own chunks (a bitmap written
        before reuse existed has no second part: none were)."""
        data = (self.path / "bitmap").read_bytes()
        count, size = self.layout.count, (self.layout.count + 7) // 8
        return unpack(data[:size], count), unpack(data[size:], count)

    def state(self) -> dict:
        return self.cache.read_json(self.path / "state.json") or {}

    def refs(self) -> list[dict]:
        return (self.cache.read_json(self.path / "refs.json") or {}).get("refs", [])

    # --- writing ----------------------------------------------------------------------------------

    def write_chunk(self, index: int, data, stored, zeros_too: bool) -> None:
        """Chunk `index`'s bytes, and (v2, fetched from the registry) its member as stored. Zero
        chunks stay holes unless `zeros_too` (the file holds suspect bytes to overwrite)."""
        lay = self.layout
        if zeros_too or data != self._zero[: len(data)]:
            os.pwrite(self.fd, data, lay.chunk_range(index)[0])
        if stored is not None and self.members_fd is not None:
            os.pwrite(self.members_fd, stored, lay.members[index][0] - lay.data_start)

    def write_refs(self, refs: list[dict]) -> None:
        write_atomic(self.path / "refs.json", json.dumps({"refs": refs}, indent=2).encode())

    def save(self, present: bytearray, reused: bytearray, status: dict) -> None:
        """The bitmaps, after the data they vouch for is on disk; then the counters."""
        os.fdatasync(self.fd)
        if self.members_fd is not None:
            os.fdatasync(self.members_fd)
        write_atomic(self.path / "bitmap", pack(present) + (pack(reused) if reused.find(1) != -1 else b""))
        write_atomic(self.path / "state.json", json.dumps(status, indent=2).encode())

    def close(self) -> None:
        os.close(self.fd)
        if self.members_fd is not None:
            os.close(self.members_fd)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def installed(self, final: Path) -> None:
        """The disk moved into the store: source.json says where; what only the fill needed goes."""
        write_atomic(self.path / "source.json", json.dumps({**self.source(), "installed": str(final)}, indent=2).encode())
        for leftover in LEFTOVERS:
            (self.path / leftover).unlink(missing_ok=True)

    # --- the end-to-end checks --------------------------------------------------------------------

    def blob_digest(self) -> str:
        """sha256 of the head, the chunks as the blob holds them (v2: members.gz), the tail."""
        blob = hashlib.sha256((self.path / "head").read_bytes())
        fd = self.fd if self.members_fd is None else self.members_fd
        _hash_fd(blob, fd, self.layout.data_end - self.layout.data_start)
        blob.update((self.path / "tail").read_bytes())
        return "sha256:" + blob.hexdigest()

    def diff_id(self) -> str:
        """sha256 of the uncompressed tar: the head's members, the disk, the tail's members."""
        diff = hashlib.sha256(inflate_all((self.path / "head").read_bytes(), self.layout.offset, "the layer's head"))
        _hash_fd(diff, self.fd, self.layout.size)
        diff.update(inflate_all((self.path / "tail").read_bytes(), 4 * imagewalk.MAX_HEAD_TAIL, "the layer's tail"))
        return "sha256:" + diff.hexdigest()


def _hash_fd(h, fd: int, size: int) -> None:
    offset = 0
    while offset < size:
        piece = os.pread(fd, min(4 << 20, size - offset), offset)
        if not piece:
            break
        h.update(piece)
        offset += len(piece)

"""The table of contents that makes a containerDisk layer readable at any offset (`diskkit build --lazy`).

A lazy layer is an ordinary uncompressed tar (`application/vnd.oci.image.layer.v1.tar`), so every
OCI client unpacks it as usual. The disk's bytes sit in it contiguously, at a fixed offset. After
the disk comes one more member, `.diskkit/lazy-toc.json` (outside /disk, so KubeVirt's rules never
see it), holding this JSON object:

    {"version": 1, "disk": "disk/root.qcow2", "offset": 1536, "size": 67108864,
     "chunkSize": 1048576, "chunks": ["<sha256 hex of disk bytes [0, 1 MiB)>", ...]}

`offset` is where the disk's first byte is in the layer blob; chunk i covers disk bytes
[i * chunkSize, (i + 1) * chunkSize) (the last one is shorter). The layer's descriptor in the
manifest locates and pins the TOC with three annotations, and the manifest carries
`io.diskkit.lazy` so a launcher knows, from the manifest alone, that the image can boot lazily:

    io.diskkit.lazy.toc.offset   the TOC's first byte in the blob
    io.diskkit.lazy.toc.size     its length
    io.diskkit.lazy.toc.digest   sha256 of the TOC

The manifest digest covers the annotations, the annotations cover the TOC, the TOC covers every
chunk: a reader fetching byte ranges checks each chunk before anyone reads it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from diskkit.errors import DiskkitError
from diskkit.oci.image import Descriptor

VERSION = 1
TOC_DIR = ".diskkit"
TOC_MEMBER = ".diskkit/lazy-toc.json"
ANNOTATION_LAZY = "io.diskkit.lazy"
ANNOTATION_TOC_OFFSET = "io.diskkit.lazy.toc.offset"
ANNOTATION_TOC_SIZE = "io.diskkit.lazy.toc.size"
ANNOTATION_TOC_DIGEST = "io.diskkit.lazy.toc.digest"
LAZY_VALUE = "toc-v1"
MIN_CHUNK = 1 << 20
MAX_CHUNKS = 16384  # keeps the TOC near 1 MiB at most; larger disks get larger chunks
MAX_TOC_BYTES = 4 << 20


def chunk_size_for(disk_size: int) -> int:
    """1 MiB chunks (a guest's first read waits for one chunk), doubled until the TOC stays small."""
    size = MIN_CHUNK
    while -(-disk_size // size) > MAX_CHUNKS:
        size *= 2
    return size


@dataclass(frozen=True)
class Toc:
    disk: str  # member path in the layer, no leading slash
    offset: int  # the disk's first byte in the blob
    size: int
    chunk_size: int
    chunks: tuple[str, ...]  # sha256 hex per chunk

    @property
    def count(self) -> int:
        return len(self.chunks)

    def chunk_range(self, index: int) -> tuple[int, int]:
        """Disk byte range [start, end) of chunk `index`."""
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.size)

    def render(self) -> bytes:
        obj = {"version": VERSION, "disk": self.disk, "offset": self.offset, "size": self.size,
               "chunkSize": self.chunk_size, "chunks": list(self.chunks)}
        return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


@dataclass(frozen=True)
class TocLocation:
    offset: int
    size: int
    digest: str

    def annotations(self) -> dict[str, str]:
        return {ANNOTATION_TOC_OFFSET: str(self.offset), ANNOTATION_TOC_SIZE: str(self.size), ANNOTATION_TOC_DIGEST: self.digest}


def location(layer: Descriptor, where: str) -> TocLocation | None:
    """Where the layer's TOC is, from its descriptor's annotations; None for layers without one."""
    notes = layer.annotations or {}
    if ANNOTATION_TOC_DIGEST not in notes:
        return None
    try:
        offset, size = int(notes[ANNOTATION_TOC_OFFSET]), int(notes[ANNOTATION_TOC_SIZE])
    except (KeyError, ValueError):
        raise DiskkitError(where, f"layer {layer.digest[:19]}: lazy TOC annotations are incomplete or not numbers") from None
    digest = notes[ANNOTATION_TOC_DIGEST]
    if not 0 <= offset < offset + size <= layer.size or size > MAX_TOC_BYTES:
        raise DiskkitError(where, f"layer {layer.digest[:19]}: lazy TOC at {offset}+{size} lies outside the {layer.size}-byte blob")
    if not digest.startswith("sha256:") or len(digest) != 71:
        raise DiskkitError(where, f"layer {layer.digest[:19]}: lazy TOC digest {digest!r} is not a sha256 digest")
    return TocLocation(offset, size, digest)


def parse(data: bytes, loc: TocLocation, where: str) -> Toc:
    """The TOC, checked against its pinned digest and for a layout a reader can rely on."""
    if "sha256:" + hashlib.sha256(data).hexdigest() != loc.digest:
        raise DiskkitError(where, f"lazy TOC does not match its digest {loc.digest}")
    try:
        obj = json.loads(data)
        toc = Toc(str(obj["disk"]), int(obj["offset"]), int(obj["size"]), int(obj["chunkSize"]), tuple(obj["chunks"]))
        version = obj.get("version")
    except (ValueError, KeyError, TypeError):
        raise DiskkitError(where, "lazy TOC is not the JSON object diskkit writes") from None
    if version != VERSION:
        raise DiskkitError(where, f"lazy TOC version {version!r} is not supported (expected {VERSION})")
    if toc.chunk_size < 4096 or toc.chunk_size % 4096:
        raise DiskkitError(where, f"lazy TOC chunk size {toc.chunk_size} is not a positive multiple of 4096")
    if toc.size <= 0 or toc.count != -(-toc.size // toc.chunk_size):
        raise DiskkitError(where, f"lazy TOC lists {toc.count} chunks for a {toc.size}-byte disk in {toc.chunk_size}-byte chunks")
    if toc.offset <= 0 or toc.offset + toc.size > loc.offset:
        raise DiskkitError(where, "lazy TOC places the disk outside the blob or over the TOC itself")
    if any(len(c) != 64 for c in toc.chunks):
        raise DiskkitError(where, "lazy TOC chunk digests must be sha256 hex")
    return toc


class ChunkHasher:
    """sha256 of each chunk-sized piece of a stream, whatever sizes the stream arrives in."""

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size
        self.digests: list[str] = []
        self._hash = hashlib.sha256()
        self._filled = 0

    def update(self, data) -> None:
        view = memoryview(data)
        while len(view):
            take = min(len(view), self.chunk_size - self._filled)
            self._hash.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.chunk_size:
                self._close_chunk()

    def _close_chunk(self) -> None:
        self.digests.append(self._hash.hexdigest())
        self._hash = hashlib.sha256()
        self._filled = 0

    def finish(self) -> tuple[str, ...]:
        if self._filled:
            self._close_chunk()
        return tuple(self.digests)

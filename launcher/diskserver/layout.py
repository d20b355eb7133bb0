"""Where a lazy image's disk lies in its layer blob and what pins its chunks (pure but for the reads
`find_layout` is handed): the disk found with KubeVirt's rules in the image's final filesystem, its
offset or gzip members from the lazy TOC, and the export identity those pins make."""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

from diskkit.disk.containerdisk import locate
from diskkit.errors import DiskkitError
from diskkit.layers import lazytoc
from diskkit.oci import artifact
from diskkit.oci.image import Image
from diskkit.oci.mediatypes import layer_compression
from launcher.diskserver import imagewalk
from launcher.diskserver.exportid import ExportId, around_digest, pins_digest
from launcher.diskserver.imagewalk import NotSeekable


@dataclass(frozen=True)
class Layout:
    """Where a disk lies in its layer blob, and how its chunks are checked."""

    registry: str
    repository: str
    layer: str
    layer_size: int
    member: str
    offset: int
    size: int
    chunk_size: int
    chunks: tuple[str, ...] | None  # sha256 per chunk from the TOC; None: only the blob digest checks
    members: tuple[tuple[int, int], ...] | None = None  # v2: each chunk's gzip member in the blob; `offset` is then in the tar
    diff_id: str | None = None  # v2: the config's diffID, checked once the disk is complete (v1: the blob is its own)
    member_digests: tuple[str, ...] | None = None  # v2: digest per chunk's gzip member as stored; then `chunks` is None
    member_hash: str = "sha256"  # which hash member_digests are (lazytoc.MEMBER_PINS); source.json written before it held sha256
    toc: str | None = None  # the lazy TOC's digest, from the layer's annotation
    around: str | None = None  # digest of the blob's bytes before and after the chunks (exportid.around_digest)
    # v2: BLAKE3 per chunk's uncompressed bytes from the TOC (pinned by its digest, `toc`): what the node's chunks are matched by
    chunk_blake3s: tuple[str, ...] | None = None
    # v3: each chunk's length (content-defined chunks, pinned by the TOC's digest); chunk_size is then the longest
    chunk_lengths: tuple[int, ...] | None = None

    @property
    def pinned(self) -> bool:
        """Each chunk has a digest of its own in the TOC, checked before it is served."""
        return self.chunks is not None or self.member_digests is not None

    @property
    def content_hashes(self) -> tuple[str, tuple[str, ...]] | None:
        """(hash name, hex per chunk) of each chunk's uncompressed bytes, as lazytoc.Toc.content_hashes."""
        if self.chunk_blake3s is not None:
            return "blake3", self.chunk_blake3s
        if self.chunks is not None:
            return "sha256", self.chunks
        return None

    @cached_property
    def identity(self) -> ExportId:
        """What the export serves is pinned by (launcher.diskserver.exportid): opens share it only when they agree on it all."""
        if self.member_digests is not None:
            pins = pins_digest(f"member-{self.member_hash}", self.member_digests)
        elif self.chunks is not None:
            pins = pins_digest("chunk-sha256", self.chunks)
        else:
            pins = None
        return ExportId(self.layer, self.layer_size, self.member, self.offset, self.size, self.chunk_size, self.toc, pins,
                        self.diff_id, self.around or "", None if pins is not None else (self.registry, self.repository))

    @property
    def name(self) -> str:
        return self.identity.name

    @cached_property
    def grid(self) -> lazytoc.Grid:
        return lazytoc.Grid(self.size, self.chunk_size, self.chunk_lengths)

    def chunk_range(self, index: int) -> tuple[int, int]:
        """Disk byte range [start, end) of chunk `index`."""
        return self.grid.range(index)

    @property
    def data_start(self) -> int:
        """Where the chunks' bytes begin in the blob; head is the blob before, tail after data_end."""
        return self.members[0][0] if self.members else self.offset

    @property
    def data_end(self) -> int:
        return sum(self.members[-1]) if self.members else self.offset + self.size

    @property
    def count(self) -> int:
        return self.grid.count

    def to_json(self) -> dict:
        # Not asdict: its deep copy of thousands of members and digests cost a VM's start 8 ms.
        obj = {**{f.name: getattr(self, f.name) for f in fields(self)}, "chunks": list(self.chunks) if self.chunks is not None else None,
               "members": [list(m) for m in self.members] if self.members is not None else None,
               "member_digests": list(self.member_digests) if self.member_digests is not None else None,
               "chunk_blake3s": list(self.chunk_blake3s) if self.chunk_blake3s is not None else None,
               "chunk_lengths": list(self.chunk_lengths) if self.chunk_lengths is not None else None}
        for newer in ("chunk_blake3s", "chunk_lengths"):
            if obj[newer] is None:
                del obj[newer]  # as source.json held it before: an export of an older TOC is still reused
        return obj

    @classmethod
    def from_json(cls, obj: dict) -> "Layout":
        chunks, members, pins, content = obj.get("chunks"), obj.get("members"), obj.get("member_digests"), obj.get("chunk_blake3s")
        lengths = obj.get("chunk_lengths")
        return cls(**{**obj, "chunks": tuple(chunks) if chunks is not None else None,
                      "members": tuple((int(o), int(n)) for o, n in members) if members is not None else None,
                      "member_digests": tuple(pins) if pins is not None else None,
                      "chunk_blake3s": tuple(content) if content is not None else None,
                      "chunk_lengths": tuple(int(n) for n in lengths) if lengths is not None else None})


@dataclass(frozen=True)
class Found:
    """A disk located for lazy reads, and (v2) the blob's bytes around its chunks, already fetched."""

    layout: Layout
    head: bytes | None = None
    tail: bytes | None = None


def find_layout(image: Image, ranges_for, registry_host: str, repository: str, path: str | None, shown: str) -> Found:
    """Locate the disk with KubeVirt's rules in the image's final filesystem (every layer applied,
    whiteouts included) and where its layer holds it; `ranges_for(descriptor)` reads a blob's bytes.

    Raises NotSeekable for images that must be pulled whole, DiskkitError for images `launcher pull`
    would refuse too, with its words."""
    if not image.layers:
        raise NotSeekable(shown, "has no layers")
    if not any(_lazy_capable(image, layer) for layer in image.layers):
        kinds = sorted({layer_compression(layer.media_type) or layer.media_type for layer in image.layers})
        raise NotSeekable(shown, f"its layer{'s are' if len(image.layers) > 1 else ' is'} {'/'.join(kinds)}-compressed; build it with --lazy or --compression none")
    walked = imagewalk.walk(image, ranges_for, shown)
    found = locate(walked.tree, path, allow_root_file=path is None)
    # UID 107's access included, as `launcher pull` and `diskkit verify` (diskkit.disk.containerdisk):
    # qemu in virt-launcher would fail on the file with Permission denied.
    blocking = walked.tree.findings + found.problems
    if found.node is None or blocking:
        raise DiskkitError(shown, "; ".join(blocking) or f"{found.shown}: not found in the image")
    index, member = found.node.layer, found.node.path
    layer = image.layers[index]
    if walked.verified(index):
        raise NotSeekable(shown, f"the disk {found.shown} is in layer {index}, which is neither lazy nor uncompressed")
    unverified = sorted((walked.ranged | set(walked.lazy)) - {index})
    if unverified:
        # Their headers shaped the tree KubeVirt's rules just read, and nothing will ever check them.
        raise NotSeekable(shown, f"layer {unverified[0]} is read at offsets but does not hold the disk (layer {index} does)")
    offset, size = walked.data_at[(index, member)]
    if size == 0:
        raise DiskkitError(shown, f"{found.shown} is empty")
    where = f"{shown}: layer {layer.digest[:19]}"
    lazy = walked.lazy.get(index)
    toc = walked.tocs.get(index)
    chunk_size, chunks, pins, pin_hash = lazytoc.chunk_size_for(size), None, None, "sha256"
    if toc is not None:
        if (toc.disk, toc.offset, toc.size) != (member, offset, size):
            raise DiskkitError(where, f"the lazy TOC describes /{toc.disk} at {toc.offset}+{toc.size}, but the layer holds /{member} at {offset}+{size}")
        chunk_size, chunks, pins, pin_hash = toc.chunk_size, toc.chunks, toc.member_digests, toc.member_hash
    v2 = lazy is not None
    data_start, data_end = (toc.members[0][0], sum(toc.members[-1])) if v2 else (offset, offset + size)
    besides = layer.size - (data_end - data_start)
    if besides > imagewalk.MAX_HEAD_TAIL:
        raise NotSeekable(shown, f"its layer holds {besides} bytes besides the disk")
    if v2:
        head, tail = lazy.head, lazy.tail
    else:
        # Fetched now, not when the export is made: their digest is part of what the export is.
        ranges = ranges_for(layer)
        head, tail = ranges.read(0, data_start), ranges.read(data_end, layer.size - data_end)
    loc = lazytoc.location(layer, where) if toc is not None else None
    layout = Layout(registry_host, repository, layer.digest, layer.size, member, offset, size, chunk_size, chunks,
                    toc.members if v2 else None, image.diff_ids[index] if v2 else None, pins, pin_hash,
                    loc.digest if loc is not None else None, around_digest(head, tail), toc.chunk_blake3s if toc is not None else None,
                    toc.chunk_lengths if toc is not None else None)
    return Found(layout, head, tail)


def _lazy_capable(image: Image, layer) -> bool:
    """A layer whose disk could be read at offsets: lazy gzip (a TOC) or uncompressed (a tar, or an
    artifact's file layer, whose blob is the file)."""
    as_file = artifact.file_layer(image.manifest, image.config_descriptor.media_type, layer.media_type, layer.annotations)
    if as_file is not None:
        return as_file.compression == "none"
    kind = layer_compression(layer.media_type)
    return kind == "none" or (kind == "gzip" and lazytoc.ANNOTATION_TOC_DIGEST in (layer.annotations or {}))


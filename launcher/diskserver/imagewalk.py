"""An image's final filesystem, as KubeVirt's rules see it, without fetching its lazy layer whole.

Layers are applied in order with whiteouts (diskkit.layers.imagefs), each read the cheapest way
that is still honest about where its bytes come from:

- a lazy gzip layer (TOC v2): its TOC, and the members before and after the disk's chunks, inflated;
  the disk's data is a hole nobody reads here;
- an uncompressed layer: its tar headers walked with range requests (v1 lazy, or plain);
- any other layer: read whole when it is small (MAX_SMALL_LAYER), its digest and diffID checked,
  so its files (a kernel, an initrd, whiteouts) can be used at once;
- an artifact's file layer (diskkit.oci.artifact): uncompressed, the blob is the file, its data at
  offset 0 and nothing to read here; compressed, it cannot be read at offsets.

Only the disk's own layer may be read without its digest checked first: its chunks are checked
against the TOC as they arrive and the blob digest once it is complete. Every other layer decides
what the disk is (a whiteout, a second file in /disk), so it must be verified before it counts.
"""

from __future__ import annotations

import hashlib
import io
import tarfile
import zlib
from dataclasses import dataclass, field
from typing import Callable, Protocol

from diskkit.errors import DiskkitError
from diskkit.layers import lazytoc
from diskkit.layers.imagefs import Tree, add_file, add_member, clean_member_name
from diskkit.oci import artifact
from diskkit.oci.image import Descriptor, Image
from diskkit.oci.mediatypes import layer_compression
from diskkit.streams.compression import decompressing_reader

MAX_MEMBERS = 10000  # tar headers walked over all layers before giving up on lazy reads
MAX_HEAD_TAIL = 64 << 20  # a lazy layer's bytes besides the disk, kept for the final digest
MAX_SMALL_LAYER = 64 << 20  # a layer without a TOC is read whole up to this size (compressed)
MAX_SMALL_TAR = 4 * MAX_SMALL_LAYER  # ... and inflated
MAX_SMALL_TOTAL = 2 * MAX_SMALL_LAYER  # all layers read whole: past this a pull is as cheap
WINDOW = 64 << 10  # header reads fetch this much at once: consecutive headers cost one request


class NotSeekable(DiskkitError):
    """The image cannot be read at offsets (compressed, large layers without a TOC, ...): pull it whole instead."""


class Ranges(Protocol):
    size: int

    def read(self, start: int, length: int) -> bytes: ...


class RangeFile(io.RawIOBase):
    """A seekable view of a blob for tarfile: headers are read, file data is seeked past."""

    def __init__(self, ranges: Ranges):
        self.ranges = ranges
        self.pos = 0
        self.window_at = -1
        self.window = b""

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.ranges.size + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self.ranges.size - self.pos)
        if n <= 0:
            return 0
        if not (self.window_at <= self.pos and self.pos + n <= self.window_at + len(self.window)):
            self.window_at = self.pos
            self.window = self.ranges.read(self.pos, min(max(n, WINDOW), self.ranges.size - self.pos))
        at = self.pos - self.window_at
        buf[:n] = self.window[at : at + n]
        self.pos += n
        return n


class Framed(io.RawIOBase):
    """The uncompressed tar of a v2 layer with its disk left out: the members before and after it
    inflated, the disk a hole tarfile seeks past (it reads headers, never file data)."""

    def __init__(self, head: bytes, hole: int, tail: bytes):
        self.head, self.hole, self.tail = head, hole, tail
        self.size = len(head) + hole + len(tail)
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buf) -> int:
        n = min(len(buf), self.size - self.pos)
        if n <= 0:
            return 0
        hole_end = len(self.head) + self.hole
        if self.pos < len(self.head):
            piece = self.head[self.pos : self.pos + n]
        elif self.pos < hole_end:
            piece = bytes(min(n, hole_end - self.pos))
        else:
            piece = self.tail[self.pos - hole_end : self.pos - hole_end + n]
        buf[: len(piece)] = piece
        self.pos += len(piece)
        return len(piece)


def inflate_all(data: bytes, limit: int, where: str) -> bytes:
    """Concatenated gzip members, as any gzip reader sees them, up to `limit` bytes."""
    out = bytearray()
    while data:
        inflater = zlib.decompressobj(31)
        try:
            out += inflater.decompress(data, limit + 1 - len(out))
        except zlib.error as exc:
            raise DiskkitError(where, f"is not gzip ({exc})") from None
        if len(out) > limit or not inflater.eof:
            raise DiskkitError(where, f"does not inflate to at most {limit} bytes of whole gzip members")
        data = inflater.unused_data
    return bytes(out)


@dataclass
class LazyLayer:
    """A TOC v2 layer as read here: the TOC, and the blob's bytes before and after the chunks (kept
    for the blob digest at the end, so the export need not fetch them again)."""

    toc: lazytoc.Toc
    head: bytes
    tail: bytes


@dataclass
class Walked:
    tree: Tree
    data_at: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)  # (layer, path) -> offset, size in its tar
    whole: dict[int, bytes] = field(default_factory=dict)  # layers read whole and verified: their tar
    lazy: dict[int, LazyLayer] = field(default_factory=dict)
    ranged: set[int] = field(default_factory=set)  # uncompressed layers whose headers came by range requests
    tocs: dict[int, lazytoc.Toc] = field(default_factory=dict)  # lazy layers (v1 and v2): their TOC
    readers: dict[int, io.RawIOBase] = field(default_factory=dict)  # the tar of a layer not read whole, where it can be read
    fetched_whole: int = 0  # blob bytes of the layers read whole

    def verified(self, index: int) -> bool:
        return index in self.whole

    def pinned_file(self, index: int, path: str, where: str) -> bytes | None:
        """A regular file's bytes once something pins them: its layer's digest (read whole), or its
        digest in the layer's lazy TOC (`files`); None when nothing does short of the whole blob."""
        offset, size = self.data_at[(index, path)]
        if index in self.whole:
            return self.whole[index][offset : offset + size]
        digest = dict(self.tocs[index].files).get(path) if index in self.tocs else None
        if digest is None or size > MAX_SMALL_TAR:
            return None
        reader = self.readers[index]
        reader.seek(offset)
        data = bytearray()
        while len(data) < size and (piece := reader.read(size - len(data))):
            data += piece
        if hashlib.sha256(data).hexdigest() != digest:
            raise DiskkitError(where, f"/{path} does not match its digest in the lazy TOC")
        return bytes(data)


def walk(image: Image, ranges_for: Callable[[Descriptor], Ranges], shown: str) -> Walked:
    """Every layer's headers applied in order, as imagefs.walk builds the tree from whole layers."""
    manifest, config_media = image.manifest, image.config_descriptor.media_type
    if len(image.diff_ids) != len(image.layers) and not artifact.is_artifact(manifest, config_media):
        raise DiskkitError(shown, f"config lists {len(image.diff_ids)} diff_ids for {len(image.layers)} layers")
    walked = Walked(Tree())
    count = 0
    for index, layer in enumerate(image.layers):
        as_file = artifact.file_layer(manifest, config_media, layer.media_type, layer.annotations)
        if as_file is not None:
            _file_layer(walked, index, layer, as_file, shown)
            continue
        fileobj = _reader(walked, index, layer, image.diff_ids[index], ranges_for(layer), shown, len(image.layers) == 1)
        try:
            with tarfile.open(fileobj=fileobj, mode="r:", errorlevel=2) as tar:
                for member in tar:
                    count += 1
                    if count > MAX_MEMBERS:
                        raise NotSeekable(shown, f"its layers have more than {MAX_MEMBERS} entries")
                    add_member(walked.tree, index, member)
                    cleaned = clean_member_name(member.name)
                    if cleaned is not None and member.isreg():
                        walked.data_at[(index, cleaned)] = (member.offset_data, member.size)
        except tarfile.TarError as exc:
            raise DiskkitError(shown, f"layer {index} ({layer.digest[:19]}) is not a valid tar: {exc}") from None
    return walked


def _file_layer(walked: Walked, index: int, layer: Descriptor, as_file: artifact.FileLayer, shown: str) -> None:
    """An artifact's file at its title, as imagefs applies it; checked by the blob digest once complete."""
    path = clean_member_name(as_file.title) if as_file.title else None
    if as_file.title and not path:
        walked.tree.findings.append(f"layer {index}'s title {as_file.title!r} escapes the image root")
    if not path:
        return
    if as_file.compression != "none":
        raise NotSeekable(shown, f"its file layer /{path} is {as_file.compression}-compressed; build it with --artifact --compression none")
    add_file(walked.tree, index, path, layer.size)
    walked.data_at[(index, path)] = (0, layer.size)
    walked.ranged.add(index)


def _reader(walked: Walked, index: int, layer: Descriptor, diff_id: str, ranges: Ranges, shown: str, alone: bool) -> io.RawIOBase:
    kind = layer_compression(layer.media_type)
    where = f"{shown}: layer {layer.digest[:19]}"
    loc = lazytoc.location(layer, where)
    if kind == "gzip" and loc is not None:
        # The TOC lies in the tail: read with the bytes after it (the trailer, when that is small),
        # it is asked of the registry once, and the tail is completed with what lies before it.
        after_toc = layer.size - loc.offset - loc.size
        from_toc = ranges.read(loc.offset, loc.size + (after_toc if after_toc <= MAX_HEAD_TAIL else 0))
        toc = lazytoc.parse(lazytoc.read_stored(from_toc[: loc.size], lazytoc.VERSION_GZIP, where), loc, where,
                            lazytoc.VERSION_GZIP)
        start, end = toc.members[0][0], sum(toc.members[-1])
        if start + layer.size - end > MAX_HEAD_TAIL:
            raise NotSeekable(shown, f"its layer holds {start + layer.size - end} bytes besides the disk")
        head = ranges.read(0, start)
        if end <= loc.offset and len(from_toc) == layer.size - loc.offset:
            tail = (ranges.read(end, loc.offset - end) if loc.offset > end else b"") + from_toc
        else:  # a TOC among the chunks' members: not the layout diskkit writes, read as it lies
            tail = ranges.read(end, layer.size - end)
        walked.lazy[index] = LazyLayer(toc, head, tail)
        walked.tocs[index] = toc
        inflated = inflate_all(head, toc.offset, f"{where}: the members before the disk")
        if len(inflated) != toc.offset:
            raise DiskkitError(where, f"the lazy TOC places the disk at {toc.offset} in the tar, but the members before it hold {len(inflated)} bytes")
        walked.readers[index] = Framed(inflated, toc.size, inflate_all(tail, 4 * MAX_HEAD_TAIL, f"{where}: the members after the disk"))
        return walked.readers[index]
    if kind == "none" and diff_id != layer.digest:
        raise DiskkitError(shown, f"layer {layer.digest[:19]} does not match the config's diffID (an uncompressed layer is its own diffID)")
    if kind == "none" and (alone or loc is not None or layer.size > MAX_SMALL_LAYER):
        walked.ranged.add(index)  # checked by the blob digest once the disk is complete, if it is the disk's layer
        if loc is not None:
            walked.tocs[index] = lazytoc.parse(ranges.read(loc.offset, loc.size), loc, where)
        walked.readers[index] = RangeFile(ranges)
        return RangeFile(ranges)  # a reader of its own: tarfile's position is not disturbed by file reads
    if kind is None:
        raise DiskkitError(shown, f"layer {index} has media type {layer.media_type}, which is not an image layer")
    if layer.size > MAX_SMALL_LAYER:
        raise NotSeekable(shown, f"layer {index} is {kind}-compressed without a lazy TOC and larger than {MAX_SMALL_LAYER} bytes; build it with --lazy")
    walked.fetched_whole += layer.size
    if walked.fetched_whole > MAX_SMALL_TOTAL:
        raise NotSeekable(shown, f"its layers without a lazy TOC hold more than {MAX_SMALL_TOTAL} bytes")
    walked.whole[index] = _whole(ranges, layer, kind, diff_id, where)
    return io.BytesIO(walked.whole[index])


def _whole(ranges: Ranges, layer: Descriptor, kind: str, diff_id: str, where: str) -> bytes:
    """A small layer's tar, its blob digest and diffID checked before any of it is believed."""
    blob = ranges.read(0, layer.size)
    if "sha256:" + hashlib.sha256(blob).hexdigest() != layer.digest:
        raise DiskkitError(where, "does not match its digest")
    tar = decompressing_reader(io.BytesIO(blob), kind, where).read(MAX_SMALL_TAR + 1)
    if len(tar) > MAX_SMALL_TAR:
        raise NotSeekable(where, f"inflates to more than {MAX_SMALL_TAR} bytes")
    if "sha256:" + hashlib.sha256(tar).hexdigest() != diff_id:
        raise DiskkitError(where, f"does not match its diffID {diff_id}")
    return tar

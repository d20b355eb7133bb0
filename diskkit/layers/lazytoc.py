"""The table of contents that makes a containerDisk layer readable at any offset (`diskkit build --lazy`).

Two layouts, three versions. Version 3 (the default of `--lazy`) is version 2 with the disk cut into
chunks where its content says (diskkit.layers.chunkcut) instead of every chunkSize bytes, so that a
run of bytes an update moved keeps its chunk; it adds each chunk's length, and its chunkSize is the
longest a chunk may be:

    {"version": 3, ..., "chunkSize": 1048576, "chunkLengths": [196608, 254519, ...], ...}

`chunkLengths` lists one length per chunk, each from 1 to chunkSize, adding up to `size`: chunk i
covers disk bytes [sum of the lengths before it, that plus its length). Every other field is version
2's, with member pins and `chunkBlake3s` required. A reader finds the chunk of a disk offset by a
binary search over the lengths' running sums (`Grid`).

Version 2 (`--lazy-chunks fixed`; every lazy gzip layer before version 3) is an ordinary gzip layer
(`application/vnd.oci.image.layer.v1.tar+gzip`) cut into independent gzip members: the tar bytes
before the disk's data, then exactly one member per disk chunk, then the rest, with the TOC's JSON
in a member of its own. Concatenated members are one valid gzip stream (RFC 1952 2.2), so every
client unpacks it as any gzip layer; a reader that knows the TOC fetches one member per chunk and
inflates it alone. This is eStargz's idea (containerd/stargz-snapshotter docs/estargz.md: a gzip
member per file, TOC located from the blob) and zstd:chunked's way of locating it (containers/storage
pkg/chunked: the TOC's position in a layer annotation, ignored by clients that do not know it). The
TOC adds, per chunk, the member's compressed `[offset, length]` in the blob, and `offset` is where
the disk's first byte is in the uncompressed tar:

    {"version": 2, "disk": "disk/root.qcow2", "offset": 1536, "size": 67108864, "chunkSize": 1048576,
     "memberBlake3s": ["<BLAKE3-256 hex of blob bytes [1024, 1024 + 310291)>", ...], "members": [[1024, 310291], ...],
     "chunkBlake3s": ["<BLAKE3-256 hex of disk bytes [0, 1 MiB)>", ...],
     "files": {"boot/vmlinuz": "<sha256 hex of its content>", ...}}

`memberBlake3s` pins each chunk by its gzip member exactly as stored in the blob: the writer hashes
the compressed bytes (less than half the disk's size), and a reader checks a member before any of
it reaches the inflater, then that it inflates to exactly the chunk's length. BLAKE3 because the
blob's own sha256 already passes over the same bytes and the diffID's over the whole tar: here it
hashes at 7.3 GB/s against sha256's 1.8 GB/s with SHA-NI, 0.13 CPU-s less for a 700 MB disk's
build (0.06 s of a build+push on 2 cores). Earlier TOCs are still read: version-2 TOCs pinning
members by sha256 (`memberDigests`), and before that chunks by their uncompressed bytes (`chunks`,
as version 1). The field's name says which digest an entry is: a TOC carries exactly one of the
three, and a member pin only with `members`. A gzip layer's TOC is version 2 or 3, whichever its
`version` says; the layer's media type is the same.

`chunkBlake3s` (version 2, written since issue 31) adds each chunk's BLAKE3-256 of its
UNCOMPRESSED bytes: what a node matches chunks it already holds by (launcher.chunks), so another
compression level or tool does not hide a chunk it has. It pins nothing in the blob (the member
pins do), and a TOC without it stays valid: `Toc.content_hashes` falls back to the sha256 `chunks`
of older TOCs, or says there is nothing to match by. Its cost is one more pass of BLAKE3 over the
disk in the compressing threads: 0.28 CPU-s per GiB in 1 MiB chunks, lost in the noise of
`bench/build.py --size-mb 200 --runs 3 --no-large` (median CPU 1.53 s before and after).

`files` (both versions; absent when the layer holds only the disk) pins the layer's other regular
files, the kernelBoot kernel and initrd: a reader takes them out of the members around the disk's
(or, v1, at their offsets) and checks them without the blob digest, which needs the whole disk.

Version 1 is an uncompressed tar (`application/vnd.oci.image.layer.v1.tar`), so every
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
chunk: a reader fetching byte ranges checks each chunk before anyone reads it. In version 2 the
offset and size annotations locate the TOC's gzip member in the blob and the digest is that of the
JSON inside it (as eStargz's `containerd.io/snapshot/stargz/toc.digest`), so the TOC in the
unpacked layer can be checked against it too.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import zlib
from dataclasses import dataclass
from functools import cached_property

import blake3

from diskkit import limits
from diskkit.errors import DiskkitError
from diskkit.oci.image import Descriptor

VERSION = 1  # uncompressed layer, the disk contiguous in the blob
VERSION_GZIP = 2  # gzip layer, one member per chunk
VERSION_CDC = 3  # gzip layer as version 2, the chunks cut where their content says (chunkLengths)
TOC_DIR = ".diskkit"
TOC_MEMBER = ".diskkit/lazy-toc.json"
ANNOTATION_LAZY = "io.diskkit.lazy"
ANNOTATION_TOC_OFFSET = "io.diskkit.lazy.toc.offset"
ANNOTATION_TOC_SIZE = "io.diskkit.lazy.toc.size"
ANNOTATION_TOC_DIGEST = "io.diskkit.lazy.toc.digest"
LAZY_VALUE = "toc-v1"
LAZY_VALUE_GZIP = "toc-v2"
LAZY_VALUE_CDC = "toc-v3"
LAZY_VALUES = {VERSION: LAZY_VALUE, VERSION_GZIP: LAZY_VALUE_GZIP, VERSION_CDC: LAZY_VALUE_CDC}  # the manifest's io.diskkit.lazy
MEMBER_PINS = {"blake3": "memberBlake3s", "sha256": "memberDigests"}  # hash -> the TOC field that lists it
MEMBER_HASH = "blake3"  # what new TOCs pin members with
CONTENT_FIELD = "chunkBlake3s"  # BLAKE3 of each chunk's uncompressed bytes, to match chunks by content
LENGTHS_FIELD = "chunkLengths"  # version 3: each chunk's length in the disk, in order
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
class Grid:
    """Where a disk's chunks lie: fixed (chunk i at i * chunk_size, the last one shorter) or, with
    `lengths` (TOC v3), back to back in those lengths, each at most chunk_size."""

    size: int
    chunk_size: int
    lengths: tuple[int, ...] | None = None

    @cached_property
    def starts(self) -> tuple[int, ...]:
        """Each chunk's first byte in the disk (content-defined chunks only)."""
        return tuple(itertools.accumulate(self.lengths[:-1], initial=0)) if self.lengths else ()

    @property
    def count(self) -> int:
        return len(self.lengths) if self.lengths is not None else -(-self.size // self.chunk_size)

    def range(self, index: int) -> tuple[int, int]:
        """Disk byte range [start, end) of chunk `index`."""
        if self.lengths is not None:
            start = self.starts[index]
            return start, start + self.lengths[index]
        start = index * self.chunk_size
        return start, min(start + self.chunk_size, self.size)

    def index(self, offset: int) -> int:
        """The chunk that holds disk byte `offset` (0 <= offset < size)."""
        if self.lengths is not None:
            return bisect.bisect_right(self.starts, offset) - 1
        return offset // self.chunk_size

    def past(self, index: int, nbytes: int) -> int:
        """The first chunk at least `nbytes` past chunk `index`'s start, or count: a span of whole chunks."""
        start = self.range(index)[0] if index < self.count else self.size
        return self.count if start + nbytes >= self.size else self.index(start + nbytes)

    @property
    def mean(self) -> int:
        return -(-self.size // max(1, self.count))


@dataclass(frozen=True)
class Toc:
    disk: str  # member path in the layer, no leading slash
    offset: int  # the disk's first byte in the blob
    size: int
    chunk_size: int
    chunks: tuple[str, ...] | None  # sha256 hex per chunk's uncompressed bytes (v1, and v2 TOCs written before memberDigests)
    members: tuple[tuple[int, int], ...] | None = None  # version 2: each chunk's gzip member (offset, length) in the blob
    files: tuple[tuple[str, str], ...] = ()  # (path, sha256 hex) of the layer's other regular files: kernelBoot artifacts
    member_digests: tuple[str, ...] | None = None  # version 2: hex digest per chunk's gzip member as stored in the blob
    member_hash: str = MEMBER_HASH  # which hash member_digests are (MEMBER_PINS)
    chunk_blake3s: tuple[str, ...] | None = None  # version 2: BLAKE3-256 hex per chunk's uncompressed bytes (CONTENT_FIELD)
    chunk_lengths: tuple[int, ...] | None = None  # version 3: each chunk's length (LENGTHS_FIELD); chunk_size is then the longest a chunk may be

    @property
    def content_hashes(self) -> tuple[str, tuple[str, ...]] | None:
        """(hash name, hex per chunk) of each chunk's uncompressed bytes, to find a chunk by its
        content: BLAKE3 where the TOC carries it, else the sha256 `chunks` of older TOCs, else None."""
        if self.chunk_blake3s is not None:
            return "blake3", self.chunk_blake3s
        if self.chunks is not None:
            return "sha256", self.chunks
        return None

    @property
    def version(self) -> int:
        if self.members is None:
            return VERSION
        return VERSION_GZIP if self.chunk_lengths is None else VERSION_CDC

    @property
    def count(self) -> int:
        return len(self.chunks if self.member_digests is None else self.member_digests)

    @cached_property
    def grid(self) -> Grid:
        return Grid(self.size, self.chunk_size, self.chunk_lengths)

    def chunk_range(self, index: int) -> tuple[int, int]:
        """Disk byte range [start, end) of chunk `index`."""
        return self.grid.range(index)

    def render(self) -> bytes:
        obj = {"version": self.version, "disk": self.disk, "offset": self.offset, "size": self.size,
               "chunkSize": self.chunk_size}
        if self.chunks is not None:
            obj["chunks"] = list(self.chunks)
        if self.member_digests is not None:
            obj[MEMBER_PINS[self.member_hash]] = list(self.member_digests)
        if self.chunk_blake3s is not None:
            obj[CONTENT_FIELD] = list(self.chunk_blake3s)
        if self.chunk_lengths is not None:
            obj[LENGTHS_FIELD] = list(self.chunk_lengths)
        if self.members is not None:
            obj["members"] = [list(m) for m in self.members]
        if self.files:
            obj["files"] = dict(self.files)
        return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


@dataclass(frozen=True)
class TocLocation:
    offset: int
    size: int
    digest: str

    def annotations(self) -> dict[str, str]:
        return {ANNOTATION_TOC_OFFSET: str(self.offset), ANNOTATION_TOC_SIZE: str(self.size), ANNOTATION_TOC_DIGEST: self.digest}


def without_toc(annotations: dict[str, str]) -> dict[str, str]:
    """A layer's annotations once its blob is re-encoded, when the TOC no longer describes it."""
    toc_keys = (ANNOTATION_TOC_OFFSET, ANNOTATION_TOC_SIZE, ANNOTATION_TOC_DIGEST)
    return {k: v for k, v in annotations.items() if k not in toc_keys}


def marked(manifest: dict, layers: list[Descriptor]) -> bool:
    """Built to boot lazily: the manifest says so, or (an image another tool built FROM a lazy one,
    keeping the lower layer's descriptor but not the manifest's annotations) a layer pins a TOC."""
    return ANNOTATION_LAZY in (manifest.get("annotations") or {}) or any(ANNOTATION_TOC_DIGEST in (layer.annotations or {}) for layer in layers)


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


def inflate(data: bytes, limit: int, where: str) -> bytes:
    """One gzip member, refused when it holds more than `limit` bytes or anything after its end."""
    inflater = zlib.decompressobj(31)
    try:
        out = inflater.decompress(data, limit + 1)  # one byte of room: the trailer is read, a longer member seen
    except zlib.error as exc:
        raise DiskkitError(where, f"is not a gzip member ({exc})") from None
    if len(out) > limit or inflater.unconsumed_tail or not inflater.eof or inflater.unused_data:
        raise DiskkitError(where, f"is not a single gzip member of at most {limit} bytes")
    return out


def version_for(media_type: str) -> int:
    """The TOC layout a layer of this media type holds: VERSION_GZIP stands for gzip members (versions 2 and 3)."""
    return VERSION_GZIP if media_type.endswith("+gzip") else VERSION


def read_stored(stored: bytes, version: int, where: str) -> bytes:
    """The TOC's JSON from its bytes in the blob (version 2: one gzip member, inflated within bounds)."""
    return inflate(stored, MAX_TOC_BYTES, f"{where}: lazy TOC") if version == VERSION_GZIP else stored


def parse(data: bytes, loc: TocLocation, where: str, expected: int = VERSION) -> Toc:
    """The TOC's JSON, checked against its pinned digest and for a layout a reader can rely on."""
    if "sha256:" + hashlib.sha256(data).hexdigest() != loc.digest:
        raise DiskkitError(where, f"lazy TOC does not match its digest {loc.digest}")
    try:
        obj = json.loads(data)
        members = obj.get("members")
        if members is not None:
            members = tuple((int(o), int(n)) for o, n in members)
        files = tuple(sorted((str(k), str(v)) for k, v in (obj.get("files") or {}).items()))
        chunks = obj.get("chunks")
        pins = [(name, obj[field]) for name, field in MEMBER_PINS.items() if obj.get(field) is not None]
        if (chunks is not None) + len(pins) != 1:
            raise DiskkitError(where, "lazy TOC must pin its chunks with exactly one of chunks (uncompressed), memberBlake3s and memberDigests (gzip members)")
        member_hash, member_digests = pins[0] if pins else (MEMBER_HASH, None)
        content, lengths = obj.get(CONTENT_FIELD), obj.get(LENGTHS_FIELD)
        toc = Toc(str(obj["disk"]), int(obj["offset"]), int(obj["size"]), int(obj["chunkSize"]),
                  tuple(map(str, chunks)) if chunks is not None else None, members, files,
                  tuple(map(str, member_digests)) if member_digests is not None else None, member_hash,
                  tuple(map(str, content)) if content is not None else None,
                  tuple(_length(n) for n in lengths) if lengths is not None else None)
        version = obj.get("version")
    except (ValueError, KeyError, TypeError, AttributeError):
        raise DiskkitError(where, "lazy TOC is not the JSON object diskkit writes") from None
    if toc.member_digests is not None and toc.members is None:
        raise DiskkitError(where, f"lazy TOC pins gzip members ({MEMBER_PINS[toc.member_hash]}) but lists none (members)")
    accepted = (VERSION_GZIP, VERSION_CDC) if expected == VERSION_GZIP else (expected,)
    if version not in accepted:
        raise DiskkitError(where, f"lazy TOC version {version!r} is not supported in this layer (expected {' or '.join(map(str, accepted))})")
    if version == VERSION_CDC and (toc.chunk_lengths is None or toc.member_digests is None or toc.chunk_blake3s is None):
        raise DiskkitError(where, f"lazy TOC version 3 must list {LENGTHS_FIELD}, pin its gzip members and name its chunks by content ({CONTENT_FIELD})")
    if toc.version != version:
        raise DiskkitError(where, f"lazy TOC version {version} does not hold what that version lists (members only in gzip layers, {LENGTHS_FIELD} only in version 3)")
    if toc.chunk_size < 4096 or toc.chunk_size % 4096:
        raise DiskkitError(where, f"lazy TOC chunk size {toc.chunk_size} is not a positive multiple of 4096")
    # A reader holds a chunk (and its gzip member) in memory: the TOC's word on its size is bounded first.
    limits.check(toc.chunk_size, limits.MAX_CHUNK, where, "the lazy TOC's chunk size")
    if toc.size <= 0:
        raise DiskkitError(where, f"lazy TOC describes a disk of {toc.size} bytes")
    if toc.chunk_lengths is not None:
        _check_lengths(toc, where)
    elif toc.count != -(-toc.size // toc.chunk_size):
        raise DiskkitError(where, f"lazy TOC lists {toc.count} chunks for a {toc.size}-byte disk in {toc.chunk_size}-byte chunks")
    if toc.members is not None:
        _check_members(toc, loc, where)
    elif toc.offset <= 0 or toc.offset + toc.size > loc.offset:
        raise DiskkitError(where, "lazy TOC places the disk outside the blob or over the TOC itself")
    if toc.chunk_blake3s is not None and (toc.members is None or len(toc.chunk_blake3s) != toc.count):
        raise DiskkitError(where, f"lazy TOC's {CONTENT_FIELD} must list one hash per chunk of a gzip layer")
    if any(len(c) != 64 for c in (*(toc.chunks or toc.member_digests), *(toc.chunk_blake3s or ()))) or any(len(d) != 64 for _, d in toc.files):
        raise DiskkitError(where, "lazy TOC chunk and file digests must be 64 hex digits")
    return toc


def _length(value) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"chunk length {value!r} is not an integer")
    return value


def _check_lengths(toc: Toc, where: str) -> None:
    """Content-defined chunks: one length per chunk, none empty or longer than chunkSize, adding up to the disk."""
    if len(toc.chunk_lengths) != toc.count:
        raise DiskkitError(where, f"lazy TOC lists {len(toc.chunk_lengths)} chunk lengths for {toc.count} chunks")
    if not all(0 < n <= toc.chunk_size for n in toc.chunk_lengths):
        raise DiskkitError(where, f"lazy TOC lists a chunk length outside 1..{toc.chunk_size} (its chunkSize)")
    if sum(toc.chunk_lengths) != toc.size:
        raise DiskkitError(where, f"lazy TOC's chunk lengths add up to {sum(toc.chunk_lengths)} bytes, not the disk's {toc.size}")


def _check_members(toc: Toc, loc: TocLocation, where: str) -> None:
    """Members back to back, one per chunk, after the tar headers and before the TOC: the head and
    tail a reader keeps for the blob digest are then exactly the bytes around them."""
    if len(toc.members) != toc.count:
        raise DiskkitError(where, f"lazy TOC lists {len(toc.members)} gzip members for {toc.count} chunks")
    at = toc.members[0][0]
    if at <= 0 or toc.offset <= 0:
        raise DiskkitError(where, "lazy TOC places the first chunk at the start of the blob, before any tar header")
    longest = limits.member_limit(toc.chunk_size)
    for index, (offset, length) in enumerate(toc.members):
        if offset != at or length <= 0:
            raise DiskkitError(where, f"lazy TOC's gzip members are not back to back (one at {offset}+{length}, expected at {at})")
        # Every reader fetches or cuts a member whole: a length the TOC states is what it would allocate.
        limits.check(length, longest, where, f"the lazy TOC's gzip member of chunk {index} (a {toc.chunk_size}-byte chunk)")
        at += length
    if at > loc.offset:
        raise DiskkitError(where, "lazy TOC places the chunks outside the blob or over the TOC itself")


def content_hash(hash_name: str, data) -> str:
    """The hex digest of a chunk's uncompressed bytes under the name `Toc.content_hashes` gives."""
    if hash_name == "blake3":
        return blake3.blake3(data).hexdigest()
    if hash_name == "sha256":
        return hashlib.sha256(data).hexdigest()
    raise ValueError(f"no chunk content hash {hash_name!r}")


def may_be_zeros(members: tuple[tuple[int, int], ...] | None, index: int, length: int) -> bool:
    """Whether chunk `index` (`length` bytes) can be all zeros, which a node needs no file for: with
    gzip members, only one whose member is a 64th of it or less (zeros deflate about 740-fold). Hashing
    zeros of every length content-defined chunks take to compare would cost more than the lookup."""
    return members is None or members[index][1] * 64 <= length


def member_pin(hash_name: str, member) -> str:
    """The hex digest a TOC pins a gzip member with (Toc.member_hash)."""
    if hash_name == "blake3":
        return blake3.blake3(member).hexdigest()  # releases the GIL, as hashlib does
    return hashlib.sha256(member).hexdigest()


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

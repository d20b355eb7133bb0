"""A pull that costs what changed (issue 31): a lazy layer assembled from the chunks the node already
holds and range requests for the rest, checked end to end as a whole pull is.

When a layer's lazy TOC names its chunks by content (`chunkBlake3s`, or the sha256 `chunks` of v1
and older v2 TOCs), every chunk the node's index (launcher.chunks) has a place for, in any cached
disk of any image from any registry, is read from there and hashed (LocalChunks); neighbouring
missing chunks are fetched as one range of their gzip members, each member checked against its pin
and its inflated chunk against its content hash. The layer is handed to the pull's walk as the
UNCOMPRESSED tar it stands for (the head members' bytes, the disk, the tail's: TOC member, other
files, trailer), whose sha256 must be the diffID the manifest-pinned config lists: the walk spools
and checks the disk from it exactly as from a downloaded layer, so nothing is installed that a whole
pull would not have installed.

A layer is pulled whole instead when its TOC names no chunk by content, when the chunks the node holds
would save less than MIN_SAVED of its blob (the whole blob streams in one request, with its digest
checked as it arrives, and resumes after a kill), when more than MAX_BESIDES of the blob lies around
the disk's chunks, or when the registry answers a range request with the whole blob.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import zlib
from dataclasses import dataclass, field

from diskkit.errors import DiskkitError
from diskkit.layers import lazytoc
from diskkit.oci.image import Descriptor, Image
from diskkit.oci.mediatypes import OCI_LAYER
from diskkit.ops.verify import stored_tocs
from diskkit.progress import Reporter
from diskkit.registry.ranges import BlobRanges, RangeReader, RangesRefused
from diskkit.transports.remote import RemoteSource
from launcher.chunks.index import ChunkIndex
from launcher.chunks.source import LocalChunks, zero_hash

MIN_SAVED = 0.10  # below this share of the blob saved, a range per missing run gains less than one stream
MAX_BESIDES = 64 << 20  # compressed bytes around the chunks (kernels, other files), fetched in one piece each side
MAX_RUN = 16 << 20  # one range of neighbouring missing members, at most: memory stays flat
PIECE = 1 << 20


@dataclass
class Transfer:
    """What a pull moved: layer bytes asked of the registry, disk bytes not fetched."""

    fetched: int = 0
    reused: int = 0  # taken from cached files, or all-zero chunks, which need no file
    assembled: list[str] = field(default_factory=list)  # layers pulled by chunks
    whole: list[str] = field(default_factory=list)  # why lazy layers were pulled whole
    ranges_refused: bool = False


@dataclass(frozen=True)
class LayerPlan:
    index: int
    desc: Descriptor
    toc: lazytoc.Toc
    diff_id: str
    hash_name: str
    hexes: tuple[str, ...]
    have: frozenset[int]  # chunks the index (or all-zero content) promises; each is still hashed when read
    head: bytes  # the blob before the chunks, fetched while planning (the first range: it tells whether ranges work)

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Each chunk's bytes in the blob: its gzip member (v2), or the disk's bytes themselves (v1)."""
        if self.toc.members is not None:
            return list(self.toc.members)
        return [(self.toc.offset + start, end - start) for start, end in map(self.toc.chunk_range, range(self.toc.count))]

    @property
    def where(self) -> str:
        return f"layer {self.index} ({self.desc.digest[:19]})"


def read_tocs(source, image: Image, transfer: Transfer) -> dict[int, lazytoc.Toc | None]:
    """The image's lazy TOCs (none for an image not built lazy), read where their annotations say."""
    if not lazytoc.marked(image.manifest, image.layers):
        return {}
    if not isinstance(source, RemoteSource):
        return stored_tocs(source, image, [])
    reader = RangeReader(source.registry, source.name.repository)
    tocs = stored_tocs(reader, image, [])
    transfer.fetched += reader.received
    if reader.refused is not None:
        transfer.ranges_refused = True
        transfer.whole.append(reader.refused.rule)
    return tocs


def plan(source, image: Image, tocs: dict[int, lazytoc.Toc | None], index: ChunkIndex, transfer: Transfer) -> dict[int, LayerPlan]:
    """The layers worth assembling from chunks; why others are pulled whole goes to `transfer.whole`."""
    if not isinstance(source, RemoteSource) or transfer.ranges_refused:
        return {}  # a layout or archive on this machine: reading it whole costs no download
    plans: dict[int, LayerPlan] = {}
    diff_ids = image.diff_ids
    for at, toc in sorted(tocs.items()):
        desc = image.layers[at]
        why = _unusable(toc, at, diff_ids)
        if why:
            transfer.whole.append(f"layer {at}: {why}")
            continue
        hash_name, hexes = toc.content_hashes
        draft = LayerPlan(at, desc, toc, diff_ids[at], hash_name, hexes, frozenset(), b"")
        spans = draft.spans
        have = frozenset(i for i in range(toc.count) if _held(index, hash_name, hexes[i], toc, i))
        saved = sum(spans[i][1] for i in have)
        if saved < MIN_SAVED * desc.size:
            transfer.whole.append(f"layer {at}: the node holds chunks worth {saved} of its {desc.size} bytes, less than {MIN_SAVED:.0%}")
            continue
        data_start, data_end = spans[0][0], sum(spans[-1])
        if desc.size - (data_end - data_start) > MAX_BESIDES:
            transfer.whole.append(f"layer {at}: more than {MAX_BESIDES >> 20} MiB of it lies around the disk's chunks")
            continue
        ranges = BlobRanges(source.registry, source.name.repository, desc.digest, desc.size, refuse_whole=True)
        try:
            head = ranges.read(0, data_start)
        except RangesRefused as exc:
            transfer.whole.append(f"layer {at}: {exc.rule}")
            return {}  # the same registry for every layer
        transfer.fetched += ranges.received
        plans[at] = dataclasses.replace(draft, have=have, head=head)
    return plans


def _unusable(toc: lazytoc.Toc | None, at: int, diff_ids: list[str]) -> str | None:
    if toc is None:
        return "its lazy TOC cannot be read where its annotations say"
    if toc.content_hashes is None:
        return f"its lazy TOC names no chunk by its content (no {lazytoc.CONTENT_FIELD}: built before it)"
    if at >= len(diff_ids):
        return "the config lists no diffID for it"
    return None


def _held(index: ChunkIndex, hash_name: str, hexdigest: str, toc: lazytoc.Toc, i: int) -> bool:
    start, end = toc.chunk_range(i)
    if lazytoc.may_be_zeros(toc.members, i, end - start) and hexdigest == zero_hash(hash_name, end - start):
        return True
    return bool(index.lookup(hash_name, hexdigest))


def assembled_image(image: Image, plans: dict[int, LayerPlan]) -> Image:
    """`image` with each planned layer described as the uncompressed tar DeltaSource gives for it:
    its digest is then the diffID, which the walk checks the assembled bytes against."""
    layers = [Descriptor(OCI_LAYER, plans[i].diff_id, -1) if i in plans else desc for i, desc in enumerate(image.layers)]
    return dataclasses.replace(image, layers=layers)


class DeltaSource:
    """The pull's source, but a planned layer's blob is its uncompressed tar, assembled from chunks."""

    def __init__(self, source: RemoteSource, plans: dict[int, LayerPlan], index: ChunkIndex, cache, transfer: Transfer, reporter: Reporter):
        self.source, self.index, self.cache, self.transfer, self.reporter = source, index, cache, transfer, reporter
        self.plans = {p.diff_id: p for p in plans.values()}

    def __getattr__(self, name: str):
        return getattr(self.source, name)

    @contextlib.contextmanager
    def blob(self, desc: Descriptor):
        planned = self.plans.get(desc.digest)
        if planned is None or desc.media_type != OCI_LAYER:
            self.transfer.fetched += desc.size
            with self.source.blob(desc) as stream:
                yield stream
            return
        ranges = BlobRanges(self.source.registry, self.source.name.repository, planned.desc.digest, planned.desc.size, refuse_whole=True)
        local = LocalChunks(self.index, self.cache, planned.toc)
        with self.reporter.task(f"{planned.desc.digest[:19]} by chunks", planned.toc.size) as task:
            reader = _Pieces(_assemble(planned, local, ranges, task.advance))
            try:
                yield reader
            finally:
                self.transfer.fetched += ranges.received
                self.transfer.reused += local.reused
        self.transfer.assembled.append(planned.desc.digest)


def _assemble(plan_: LayerPlan, local: LocalChunks, ranges: BlobRanges, advance):
    """The layer's uncompressed tar, piece by piece: head, each chunk (the node's, else fetched), tail."""
    toc, spans, where = plan_.toc, plan_.spans, plan_.where
    yield from _decoded(plan_.head, toc, f"{where}: the bytes before the disk")
    runs = {first: last for first, last in _missing_runs(plan_, spans)}
    fetched: dict[int, bytes] = {}
    for i in range(toc.count):
        if i in runs:
            first, last = i, runs[i]
            at = spans[first][0]
            data = ranges.read(at, sum(spans[last]) - at)
            fetched = {j: data[spans[j][0] - at : sum(spans[j]) - at] for j in range(first, last + 1)}
        member = fetched.pop(i, None)
        chunk = None if member is not None or i not in plan_.have else local.get(i)
        if chunk is None:
            if member is None:  # promised by the index, but the file no longer holds it
                member = ranges.read(*spans[i])
            chunk = _checked(plan_, i, member)
        advance(len(chunk))
        yield chunk
    data_end = sum(spans[-1])
    yield from _decoded(ranges.read(data_end, plan_.desc.size - data_end), toc, f"{where}: the bytes after the disk")


def _missing_runs(plan_: LayerPlan, spans) -> list[tuple[int, int]]:
    """Neighbouring chunks the node lacks, as (first, last), each run's members at most MAX_RUN bytes."""
    runs: list[tuple[int, int]] = []
    for i in range(plan_.toc.count):
        if i in plan_.have:
            continue
        if runs and runs[-1][1] == i - 1 and sum(spans[i]) - spans[runs[-1][0]][0] <= MAX_RUN:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return runs


def _checked(plan_: LayerPlan, i: int, member: bytes) -> bytes:
    """A fetched chunk: its member against the TOC's pin, then what it inflates to against its content hash."""
    toc, where = plan_.toc, plan_.where
    offset, length = plan_.spans[i]
    start, end = toc.chunk_range(i)
    if toc.member_digests is not None and lazytoc.member_pin(toc.member_hash, member) != toc.member_digests[i]:
        raise DiskkitError(where, f"chunk {i}'s gzip member at {offset}+{length} does not match its digest in the lazy TOC")
    chunk = lazytoc.inflate(member, end - start, f"{where}: chunk {i}'s gzip member") if toc.members is not None else member
    if len(chunk) != end - start or lazytoc.content_hash(plan_.hash_name, chunk) != plan_.hexes[i]:
        raise DiskkitError(where, f"chunk {i} does not match its {plan_.hash_name} in the lazy TOC")
    return chunk


def _decoded(data: bytes, toc: lazytoc.Toc, where: str):
    """v2: the concatenated gzip members inflated, a piece at a time; v1: the bytes as they are."""
    if toc.members is None:
        yield data
        return
    rest = data
    while rest:
        inflater = zlib.decompressobj(31)
        pending = rest
        try:
            while not inflater.eof:
                out = inflater.decompress(pending, PIECE)
                pending = inflater.unconsumed_tail
                if out:
                    yield out
                elif not pending:
                    raise DiskkitError(where, "end inside a gzip member")
        except zlib.error as exc:
            raise DiskkitError(where, f"are not gzip members ({exc})") from None
        rest = inflater.unused_data


class _Pieces(io.RawIOBase):
    """A stream over an iterator of byte pieces. Not hashed here: the walk hashes every layer's tar
    against its diffID (diskkit.layers.imagefs.walk), and `plan` only takes layers the config lists one for."""

    def __init__(self, pieces):
        self.pieces = iter(pieces)
        self.current = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        while not self.current:
            piece = next(self.pieces, None)
            if piece is None:
                return 0
            self.current = memoryview(piece)
        n = min(len(buf), len(self.current))
        buf[:n] = self.current[:n]
        self.current = self.current[n:]
        return n

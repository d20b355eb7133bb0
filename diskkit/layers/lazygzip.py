"""Write a lazy gzip layer (TOC version 3, see lazytoc): one gzip member per disk chunk, in one pass.

A reader thread frames the tar, hashes the diffID and cuts the stream into members: the disk's
data exactly at chunk boundaries (content-defined, diskkit.layers.chunkcut; fixed, TOC version 2,
for a disk too large for them), everything else in pieces of at most CHUNK bytes. Each member is
compressed (and, for a chunk, the member and the chunk hashed: the TOC pins members and
names chunks by content, see lazytoc) on a thread pool, so every core compresses; the futures go
through a bounded queue in stream order, so memory stays flat whatever the disk size. The calling
thread takes them in order, notes each chunk's offset in the blob, hashes the blob and hands the
bytes to the sink, a batch of members at a time. The TOC is written last, when every offset is known.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from diskkit.errors import DiskkitError
from diskkit.layers import chunkcut, lazytoc
from diskkit.layers.layer import (
    CHUNK,
    DIR_MODE,
    BlobSink,
    Entry,
    LayerResult,
    Stopped,
    member_header,
    tar_header,
)
from diskkit.streams.compression import gzip_member, gzip_member_parts
from diskkit.streams.pieceread import PieceReader

WORKERS = os.cpu_count() or 2


def _compress(data: bytes, level: int | None) -> bytes:
    return gzip_member(data, level)


def _compress_chunks(chunks: list, level: int | None) -> tuple[bytes, list[tuple[int, str, str]]]:
    """The batch's members side by side in one bytes object and, per chunk, (its member's length,
    the member's pin, its content hash): all in the compressing thread. Small chunks go in batches,
    one task each CHUNK bytes, and a batch goes on as one piece: every hand-over between threads
    wakes one, which costs this kind of VM about 20 microseconds of CPU."""
    parts, made = [], []
    for data in chunks:
        member = gzip_member_parts(data, level)
        parts += member
        made.append((sum(map(len, member)), lazytoc.content_hash("blake3", data)))
    joined = b"".join(parts)
    view, at, out = memoryview(joined), 0, []
    for length, content in made:
        out.append((length, lazytoc.member_pin(lazytoc.MEMBER_HASH, view[at:at + length]), content))
        at += length
    return joined, out


class _Framer:
    """The producer: tar bytes in stream order, cut into members and submitted to the pool."""

    def __init__(self, pool: ThreadPoolExecutor, out: queue.Queue, diff, stop: threading.Event, level: int | None):
        self.pool, self.out, self.diff, self.stop, self.level = pool, out, diff, stop, level
        self.position = 0  # in the uncompressed tar
        self.pending = bytearray()
        self.batch: list = []  # disk chunks not submitted yet, and what releases their buffers
        self.releases: list[Callable[[], None]] = []
        self.batched = 0

    def add(self, data: bytes | memoryview) -> None:
        self.pending += data
        if len(self.pending) >= CHUNK:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            data = bytes(self.pending)
            self.diff.update(data)
            self.position += len(data)
            self.put((False, self.pool.submit(_compress, data, self.level), len(data)))
            self.pending = bytearray()

    def disk(self, data: bytes | memoryview) -> None:
        """The disk's bytes as read, before the chunks cut from them: hashed and counted once per piece."""
        self.diff.update(data)
        self.position += len(data)

    def chunk(self, data: bytes | memoryview, release: Callable[[], None] | None = None) -> None:
        """A disk chunk (its bytes already given to `disk`), compressed with the next ones up to CHUNK
        bytes; `release` is called once it is compressed: the reader may then reuse its buffer."""
        self.batch.append(data)
        if release is not None:
            self.releases.append(release)
        self.batched += len(data)
        if self.batched >= CHUNK:
            self.end_batch()

    def end_batch(self) -> None:
        if not self.batch:
            return
        future = self.pool.submit(_compress_chunks, self.batch, self.level)
        releases = self.releases
        if releases:
            future.add_done_callback(lambda _: [release() for release in releases])
        self.put((True, future, [len(data) for data in self.batch]))
        self.batch, self.releases, self.batched = [], [], 0

    def put(self, item) -> None:
        while not self.stop.is_set():
            try:
                self.out.put(item, timeout=0.2)
                return
            except queue.Full:
                continue
        raise Stopped


def _submit_disk(entry: Entry, chunk_size: int, cuts: chunkcut.Params | None, framer: _Framer) -> int:
    """The disk's chunks, each a member of its own; the bytes read (one more if the file grew)."""
    # Content-defined chunks are cut from pieces of the longest chunk's size: a chunk spanning two
    # pieces is copied; a piece is lent to the chunks cut from it until they are compressed.
    reader = PieceReader(entry.source, chunk_size, framer.out.maxsize + WORKERS + (2 if cuts else 0), entry.size)
    cutter = chunkcut.Cutter(cuts) if cuts is not None else None
    copied = 0
    try:
        for view, release in reader:
            copied += len(view)
            framer.disk(view)
            if cutter is None:
                framer.chunk(view, release)
                continue
            for chunk, lent in cutter.feed(view, release):
                framer.chunk(chunk, lent)
        for chunk, lent in cutter.finish() if cutter is not None else ():
            framer.chunk(chunk, lent)
        framer.end_batch()
        if reader.grew(copied):
            copied += 1
    finally:
        if cutter is not None:
            cutter.close()
        reader.close()
    return copied


def _produce(entries: list[Entry], mtime: int, framer: _Framer, toc_for: str, found: list, files: list, content_defined: bool) -> None:
    try:
        for entry in entries:
            framer.add(tar_header(entry, mtime))
            if entry.is_dir:
                continue
            disk = entry.path == toc_for
            if disk:
                framer.flush()  # the first chunk starts a member of its own
                cuts = chunkcut.params_for(entry.size) if content_defined else None
                found.append((framer.position, entry.size, lazytoc.chunk_size_for(entry.size) if cuts is None else cuts.max, cuts))
            copied = 0
            if disk:
                copied = _submit_disk(entry, found[-1][2], found[-1][3], framer)
            else:
                digest = hashlib.sha256()
                with open(entry.source, "rb") as src:
                    # A buffered read returns short only at the end of the file.
                    while copied < entry.size and (data := src.read(min(CHUNK, entry.size - copied))):
                        copied += len(data)
                        digest.update(data)
                        framer.add(data)
                    copied += len(src.read(1))  # a file that grew is refused too
                files.append((entry.path, digest.hexdigest()))
            if copied != entry.size:
                raise DiskkitError(entry.source, f"changed while being read ({entry.size} bytes expected, {copied} read)")
            if entry.size % 512:
                framer.add(bytes(512 - entry.size % 512))
        framer.flush()
        framer.put(None)
    except Stopped:
        pass
    except BaseException as exc:  # handed to the consumer, which re-raises it in the caller's thread
        framer.out.put(exc)


def write_layer(
    entries: list[Entry],
    sink: BlobSink,
    level: int | None = None,
    mtime: int = 0,
    advance: Callable[[int], None] | None = None,
    toc_for: str = "",
    content_defined: bool = True,
) -> LayerResult:
    """The layer, with a version-3 TOC (version 2 for a disk too large for content-defined chunks) for the member `toc_for` (the disk)."""
    if not any(e.path == toc_for and not e.is_dir for e in entries):
        raise DiskkitError(f"/{toc_for}", "is not a file in the layer, so no lazy TOC can describe it")
    diff = hashlib.sha256()
    futures: queue.Queue = queue.Queue(2 * WORKERS + 2)  # compressing or done, not yet written
    stop = threading.Event()
    found: list[tuple[int, int, int, chunkcut.Params | None]] = []
    files: list[tuple[str, str]] = []
    pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="gzip")
    framer = _Framer(pool, futures, diff, stop, level)
    reader = threading.Thread(target=_produce, args=(entries, mtime, framer, toc_for, found, files, content_defined), daemon=True)
    # The blob is hashed and handed to the sink here, between waits for the workers: both sinks
    # (an upload, a layout's direct writer) send from threads of their own already.
    blob = hashlib.sha256()
    reader.start()
    position = 0
    members: list[tuple[int, int]] = []
    digests: list[str] = []
    contents: list[str] = []
    lengths: list[int] = []

    def emit(data: bytes) -> int:
        nonlocal position
        at = position
        blob.update(data)
        sink.write(data)
        position += len(data)
        return at

    try:
        while True:
            item = futures.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            chunks, future, raw = item
            if not chunks:
                emit(future.result())
                if advance:
                    advance(raw)
                continue
            joined, done = future.result()
            at = emit(joined)
            for length, (member_length, member_pin, content) in zip(raw, done):
                members.append((at, member_length))
                at += member_length
                digests.append(member_pin)
                contents.append(content)
                lengths.append(length)
            if advance:
                advance(sum(raw))
        # The reader is done with the diffID: the TOC member and the trailer are hashed here.
        disk_at, size, chunk_size, cuts = found[0]
        toc = lazytoc.Toc(toc_for, disk_at, size, chunk_size, None, tuple(members), tuple(sorted(files)), tuple(digests),
                          chunk_blake3s=tuple(contents), chunk_lengths=tuple(lengths) if cuts is not None else None)
        doc = toc.render()
        headers = member_header(lazytoc.TOC_DIR, DIR_MODE, 0, mtime, directory=True) + member_header(lazytoc.TOC_MEMBER, 0o444, len(doc), mtime)
        trailer = bytes(-len(doc) % 512) + bytes(1024)
        for part in (headers, doc, trailer):
            diff.update(part)
        emit(gzip_member(headers, level))
        toc_member = gzip_member(doc, level)  # a member of its own: a reader fetches and inflates just it
        toc_at = emit(toc_member)
        emit(gzip_member(trailer, level))
    finally:
        stop.set()
        reader.join()
        pool.shutdown(wait=True, cancel_futures=True)
    loc = lazytoc.TocLocation(toc_at, len(toc_member), "sha256:" + hashlib.sha256(doc).hexdigest())
    return LayerResult("sha256:" + blob.hexdigest(), position, "sha256:" + diff.hexdigest(), "gzip", loc, toc.version)

"""Write one image layer in a single streaming pass: tar framing, diffID hash, compression, digest.

A reader thread reads the source files and hashes the uncompressed tar stream while the calling
thread compresses, hashes the blob and writes it; ISA-L, zstd and hashlib release the GIL, so the
two cores both work. The queue between them is bounded: memory stays flat whatever the disk size.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import queue
import tarfile
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Protocol

from diskkit.errors import DiskkitError
from diskkit.layers import lazytoc
from diskkit.streams.compression import compressor

QEMU_UID = QEMU_GID = 107
QEMU_NAME = "qemu"
DIR_MODE = 0o555
FILE_MODE = 0o440
CHUNK = 1 << 20
QUEUE_DEPTH = 8


class BlobSink(Protocol):
    def write(self, data: bytes | memoryview) -> object: ...


@dataclass(frozen=True)
class Entry:
    """One member of the layer: a directory, or a regular file copied from `source`."""

    path: str  # relative to the image root, no leading or trailing slash
    mode: int
    source: Path | None = None
    size: int = 0

    @property
    def is_dir(self) -> bool:
        return self.source is None


@dataclass(frozen=True)
class LayerResult:
    digest: str  # sha256 of the blob as stored (compressed)
    size: int
    diff_id: str  # sha256 of the uncompressed tar
    compression: str
    toc: lazytoc.TocLocation | None = None  # where the lazy TOC is in the blob
    toc_version: int | None = None  # which TOC layout (lazytoc.VERSION...), for the manifest's io.diskkit.lazy


def entries_for(files: list[tuple[str, Path]]) -> list[Entry]:
    """Layer members for files at absolute image paths: every parent directory, then the files.

    Directories get 0555 and files 0440, all owned by qemu (107:107), as KubeVirt's own test images.
    Members come sorted so the same inputs always give the same tar.
    """
    dirs: set[str] = set()
    members: list[Entry] = []
    for image_path, source in files:
        rel = image_path.lstrip("/")
        parent = posixpath.dirname(rel)
        while parent:
            dirs.add(parent)
            parent = posixpath.dirname(parent)
        members.append(Entry(rel, FILE_MODE, source, source.stat().st_size))
    seen = {m.path for m in members}
    if len(seen) != len(members):
        raise DiskkitError("--path", "two files would land at the same path in the image")
    if seen & dirs:
        raise DiskkitError(sorted(seen & dirs)[0], "is both a file and a parent directory in the image")
    members += [Entry(d, DIR_MODE) for d in dirs]
    return sorted(members, key=lambda m: m.path)


def tar_header(entry: Entry, mtime: int) -> bytes:
    return member_header(entry.path, entry.mode, entry.size, mtime, entry.is_dir)


def member_header(path: str, mode: int, size: int, mtime: int, directory: bool = False) -> bytes:
    info = tarfile.TarInfo(path)
    info.type = tarfile.DIRTYPE if directory else tarfile.REGTYPE
    info.mode = mode
    info.size = size
    info.uid, info.gid = QEMU_UID, QEMU_GID
    info.uname, info.gname = QEMU_NAME, QEMU_NAME
    info.mtime = mtime
    # PAX only adds an extended header where ustar cannot hold a field (files over 8 GiB).
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


def _produce(entries: list[Entry], mtime: int, out: queue.Queue, diff: "hashlib._Hash", stop: threading.Event,
             toc_for: str | None = None, toc_out: list | None = None) -> None:
    """Tar framing and the diffID; with `toc_for` (a member path) also the chunk digests of that
    member and, after every entry, the lazy TOC member pointing at them (appended to `toc_out`)."""
    position = 0

    def put(block: bytes | memoryview) -> None:
        nonlocal position
        diff.update(block)
        position += len(block)
        while not stop.is_set():
            try:
                out.put(block, timeout=0.2)
                return
            except queue.Full:
                continue
        raise Stopped

    toc: lazytoc.Toc | None = None
    files: list[tuple[str, str]] = []  # the other files' digests, for the TOC
    try:
        for entry in entries:
            put(tar_header(entry, mtime))
            if entry.is_dir:
                continue
            chunks = lazytoc.ChunkHasher(lazytoc.chunk_size_for(entry.size)) if entry.path == toc_for else None
            digest = hashlib.sha256() if toc_for is not None and chunks is None else None
            data_offset = position
            for view in file_chunks(entry.source, entry.size):
                if chunks is not None:
                    chunks.update(view)
                if digest is not None:
                    digest.update(view)
                put(view)
            if entry.size % 512:
                put(bytes(512 - entry.size % 512))
            if chunks is not None:
                toc = lazytoc.Toc(entry.path, data_offset, entry.size, chunks.chunk_size, chunks.finish())
            if digest is not None:
                files.append((entry.path, digest.hexdigest()))
        if toc is not None and toc_out is not None:
            toc = replace(toc, files=tuple(sorted(files)))
            # Last, as the digests are known only now; outside /disk, where KubeVirt never looks.
            data = toc.render()
            put(member_header(lazytoc.TOC_DIR, DIR_MODE, 0, mtime, directory=True))
            put(member_header(lazytoc.TOC_MEMBER, 0o444, len(data), mtime))
            toc_out.append(lazytoc.TocLocation(position, len(data), "sha256:" + hashlib.sha256(data).hexdigest()))
            put(data)
            if len(data) % 512:
                put(bytes(512 - len(data) % 512))
        put(bytes(1024))
        out.put(None)
    except Stopped:
        pass
    except BaseException as exc:  # handed to the consumer, which re-raises it in the caller's thread
        out.put(exc)


def file_chunks(path: Path, size: int) -> Iterator[memoryview]:
    """`path`'s bytes in CHUNK-sized views, read sequentially once; a file that is no longer `size`
    bytes long (it changed while being read) is refused rather than packed short or long."""
    copied = 0
    with open(path, "rb") as src:
        os.posix_fadvise(src.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while True:
            buf = bytearray(CHUNK)
            n = src.readinto(buf)
            if not n:
                break
            copied += n
            if copied > size:
                break
            yield memoryview(buf)[:n]
    if copied != size:
        raise DiskkitError(str(path), f"changed while being read ({size} bytes expected, {copied} read)")


class Stopped(Exception):
    pass


class BlobWriter(threading.Thread):
    """Hashes and writes the compressed stream, so the sink (a file or an upload) overlaps compression."""

    def __init__(self, sink: BlobSink, hashed: bool):
        super().__init__(daemon=True)
        self.sink = sink
        self.hash = hashlib.sha256() if hashed else None
        self.size = 0
        self.error: BaseException | None = None
        self.queue: queue.Queue = queue.Queue(QUEUE_DEPTH)

    def run(self) -> None:
        while True:
            data = self.queue.get()
            if data is None:
                return
            if self.error is not None:
                continue  # keep draining so the producer never blocks
            try:
                if self.hash is not None:
                    self.hash.update(data)
                self.sink.write(data)
                self.size += len(data)
            except BaseException as exc:
                self.error = exc

    def put(self, data) -> None:
        if self.error is not None:
            raise self.error
        if data:
            self.queue.put(data)


def pump(reader: threading.Thread, chunks: queue.Queue, stop: threading.Event, comp, writer: BlobWriter,
         advance: Callable[[int], None] | None) -> BlobWriter:
    """Run the stages: `reader` fills `chunks` (None at the end, an exception on failure, raised
    here in the caller's thread), this thread compresses, `writer` hashes and writes the blob. On
    any failure every thread is stopped and joined before the error goes on."""
    reader.start()
    writer.start()
    try:
        while True:
            item = chunks.get()
            if item is None:
                break
            if isinstance(item, BaseException):
                raise item
            writer.put(comp.compress(item))
            if advance:
                advance(len(item))
        writer.put(comp.flush())
    finally:
        stop.set()
        reader.join()
        writer.queue.put(None)
        writer.join()
    if writer.error is not None:
        raise writer.error
    return writer


def write_layer(
    entries: list[Entry],
    sink: BlobSink,
    compression: str,
    level: int | None = None,
    mtime: int = 0,
    advance: Callable[[int], None] | None = None,
    toc_for: str | None = None,
) -> LayerResult:
    """Three stages on two cores: read+tar+diffID | compress | blob digest+write, joined by bounded queues.

    `toc_for` names the member (the disk) a lazy TOC is written for; the layer must be uncompressed,
    since the TOC's offsets are offsets in the blob."""
    if toc_for is not None and compression != "none":
        raise DiskkitError("--lazy", f"a lazy layer is read at offsets, so it cannot be {compression}-compressed")
    comp = compressor(compression, level)
    diff = hashlib.sha256()
    chunks: queue.Queue = queue.Queue(QUEUE_DEPTH)
    stop = threading.Event()
    toc_out: list[lazytoc.TocLocation] = []
    reader = threading.Thread(target=_produce, args=(entries, mtime, chunks, diff, stop, toc_for, toc_out), daemon=True)
    writer = pump(reader, chunks, stop, comp, BlobWriter(sink, hashed=compression != "none"), advance)
    blob = writer.hash or diff
    return LayerResult("sha256:" + blob.hexdigest(), writer.size, "sha256:" + diff.hexdigest(), compression, toc_out[0] if toc_out else None,
                       lazytoc.VERSION if toc_out else None)

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
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from .compression import compressor
from .errors import DiskkitError

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
    info = tarfile.TarInfo(entry.path)
    info.type = tarfile.DIRTYPE if entry.is_dir else tarfile.REGTYPE
    info.mode = entry.mode
    info.size = entry.size
    info.uid, info.gid = QEMU_UID, QEMU_GID
    info.uname, info.gname = QEMU_NAME, QEMU_NAME
    info.mtime = mtime
    # PAX only adds an extended header where ustar cannot hold a field (files over 8 GiB).
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


def _produce(entries: list[Entry], mtime: int, out: queue.Queue, diff: "hashlib._Hash", stop: threading.Event) -> None:
    def put(block: bytes | memoryview) -> None:
        diff.update(block)
        while not stop.is_set():
            try:
                out.put(block, timeout=0.2)
                return
            except queue.Full:
                continue
        raise _Stopped

    try:
        for entry in entries:
            put(tar_header(entry, mtime))
            if entry.is_dir:
                continue
            copied = 0
            with open(entry.source, "rb") as src:
                os.posix_fadvise(src.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                while True:
                    buf = bytearray(CHUNK)
                    n = src.readinto(buf)
                    if not n:
                        break
                    copied += n
                    if copied > entry.size:
                        break
                    put(memoryview(buf)[:n])
            if copied != entry.size:
                raise DiskkitError(entry.source, f"changed while being read ({entry.size} bytes expected, {copied} read)")
            if entry.size % 512:
                put(bytes(512 - entry.size % 512))
        put(bytes(1024))
        out.put(None)
    except _Stopped:
        pass
    except BaseException as exc:  # handed to the consumer, which re-raises it in the caller's thread
        out.put(exc)


class _Stopped(Exception):
    pass


class _Writer(threading.Thread):
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


def write_layer(
    entries: list[Entry],
    sink: BlobSink,
    compression: str,
    level: int | None = None,
    mtime: int = 0,
    advance: Callable[[int], None] | None = None,
) -> LayerResult:
    """Three stages on two cores: read+tar+diffID | compress | blob digest+write, joined by bounded queues."""
    comp = compressor(compression, level)
    diff = hashlib.sha256()
    chunks: queue.Queue = queue.Queue(QUEUE_DEPTH)
    stop = threading.Event()
    reader = threading.Thread(target=_produce, args=(entries, mtime, chunks, diff, stop), daemon=True)
    writer = _Writer(sink, hashed=compression != "none")
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
    blob = writer.hash or diff
    return LayerResult("sha256:" + blob.hexdigest(), writer.size, "sha256:" + diff.hexdigest(), compression)

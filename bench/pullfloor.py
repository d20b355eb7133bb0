"""The least work a verified, durable pull of a lazy v2 layer's disk can do here, as one process.

bench/launch.py times it beside `launcher pull` and skopeo+umoci: it bounds what any pull that
keeps our checks could reach on this machine. What it does, and no more:

  - the blob's sha256 (the manifest's pin), on a thread of its own;
  - every chunk's gzip member checked against its TOC pin and inflated, on every core;
  - the sha256 of the inflated chunks in order (a diffID's work, less the tar headers'), on a thread;
  - the disk written past the page cache (diskkit's sparse direct writer), then fsync.

What it leaves out, each in its favour: the network (the blob is read from the registry's
storage, in the page cache under bench/launch.py's warm condition), the tar parse, the kept copy
a killed pull resumes from, qemu-img's checks, the cache's records. A `launcher pull` within a
few per cent of it has no work left to cut but the checks themselves.

With --discard the disk is not written at all: what the checks and the inflate cost alone, so the
table shows how much of a pull's time is the device's.

With --http URL the blob's bytes come from URL (the registry's GET of the blob, one connection,
http.client) instead of its storage: the same work plus the download, which no pull can skip (the
registry's CPU on the same cores included). A thread receives the answer, hashes it and cuts it
into members as the pool inflates them; the TOC is still read from storage, in its favour.

    python bench/pullfloor.py [--discard] [--http URL] BLOB MANIFEST.json OUT_DIR
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import queue
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

from isal import isal_zlib

from diskkit.errors import DiskkitError
from diskkit.layers import lazytoc
from diskkit.oci.image import Descriptor
from diskkit.streams.sparse import SparseDirectWriter

PIECE = 1 << 20


def blob_digest(fd: int, size: int, out: list) -> None:
    h, buf, at = hashlib.sha256(), bytearray(PIECE), 0
    while at < size:
        n = os.preadv(fd, [buf], at)
        h.update(memoryview(buf)[:n])
        at += n
    out.append("sha256:" + h.hexdigest())


def chunk(fd: int, toc: lazytoc.Toc, index: int) -> bytes:
    at, length = toc.members[index]
    return inflate(os.pread(fd, length, at), toc, index)


def inflate(member: bytes, toc: lazytoc.Toc, index: int) -> bytes:
    if toc.member_digests is not None and lazytoc.member_pin(toc.member_hash, member) != toc.member_digests[index]:
        raise DiskkitError("floor", f"chunk {index}'s member does not match its pin")
    start, end = toc.chunk_range(index)
    out = isal_zlib.decompressobj(31).decompress(member, end - start + 1)
    if len(out) != end - start:
        raise DiskkitError("floor", f"chunk {index} inflates to {len(out)} bytes, not {end - start}")
    return out


class Discard:
    """The writer's face, writing nothing."""

    def write(self, data) -> None:
        pass

    def close(self) -> None:
        pass


def received(url: str, toc: lazytoc.Toc, pool: ThreadPoolExecutor, futures: queue.Queue, digest: list) -> None:
    """The blob over HTTP: hashed as it arrives, each member handed to the pool, in order; a failure
    reaches the writer as the next member's."""
    try:
        receive(url, toc, pool, futures, digest)
    except BaseException as exc:  # noqa: BLE001 - raised in the main thread instead
        failed: Future = Future()
        failed.set_exception(exc)
        futures.put(failed)


def receive(url: str, toc: lazytoc.Toc, pool: ThreadPoolExecutor, futures: queue.Queue, digest: list) -> None:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.netloc)
    conn.request("GET", parts.path)
    answer = conn.getresponse()
    if answer.status != 200:
        raise DiskkitError("floor", f"GET {url}: HTTP {answer.status}")
    h, at = hashlib.sha256(), 0
    pieces: queue.Queue = queue.Queue(16)  # hashed on a thread of their own, as the blob's digest is from storage
    hashing = threading.Thread(target=lambda: [h.update(p) for p in iter(pieces.get, None)])
    hashing.start()
    try:
        for index, (start, length) in enumerate(toc.members):
            if start > at:
                pieces.put(answer.read(start - at))
            member = answer.read(length)
            pieces.put(member)
            at = start + length
            futures.put(pool.submit(inflate, member, toc, index))
        while rest := answer.read(PIECE):
            pieces.put(rest)
    finally:
        pieces.put(None)
        hashing.join()
    conn.close()
    digest.append("sha256:" + h.hexdigest())


def main(blob: Path, manifest: Path, out_dir: Path, discard: bool = False, url: str | None = None) -> int:
    layers = json.loads(manifest.read_text())["layers"]
    desc = Descriptor.from_json(layers[-1], "floor")
    fd = os.open(blob, os.O_RDONLY)
    loc = lazytoc.location(desc, "floor")
    toc = lazytoc.parse(lazytoc.read_stored(os.pread(fd, loc.size, loc.offset), lazytoc.version_for(desc.media_type), "floor"),
                        loc, "floor", lazytoc.version_for(desc.media_type))
    digest: list[str] = []
    window = (os.cpu_count() or 2) * 4  # members in flight: memory stays flat
    pool = ThreadPoolExecutor(os.cpu_count() or 2)
    futures: queue.Queue = queue.Queue(window)
    if url is None:
        hasher = threading.Thread(target=blob_digest, args=(fd, os.fstat(fd).st_size, digest))
    else:
        hasher = threading.Thread(target=received, args=(url, toc, pool, futures, digest))
    hasher.start()
    content = hashlib.sha256()
    chunks: queue.Queue = queue.Queue(8)
    summer = threading.Thread(target=lambda: [content.update(c) for c in iter(chunks.get, None)])
    summer.start()
    path = out_dir / "disk.img"
    with open(path, "wb") as f, pool:
        writer = Discard() if discard else SparseDirectWriter(path, f.fileno())
        pending = [pool.submit(chunk, fd, toc, i) for i in range(min(window, toc.count))] if url is None else []
        for i in range(toc.count):
            if url is not None:
                data = futures.get().result()
            else:
                data = pending[i].result()
                pending[i] = None
                if i + window < toc.count:
                    pending.append(pool.submit(chunk, fd, toc, i + window))
            chunks.put(data)
            writer.write(data)
        chunks.put(None)
        writer.close()
        if not discard:
            os.fsync(f.fileno())
    hasher.join()
    summer.join()
    if digest[0] != desc.digest:
        raise DiskkitError("floor", f"blob {desc.digest} hashes to {digest[0]}")
    print(json.dumps({"disk": str(path), "bytes": toc.size, "content": content.hexdigest()}))
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    discard = "--discard" in args
    url = args[args.index("--http") + 1] if "--http" in args else None
    blob, manifest, out_dir = (Path(a) for a in args if a not in ("--discard", "--http", url))
    sys.exit(main(blob, manifest, out_dir, discard, url))

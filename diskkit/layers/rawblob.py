"""Write one file as a blob of its own (an OCI artifact's layer: no tar), in one streaming pass.

The same three stages as layer.write_layer on two cores: read + hash of the plain bytes | compress |
hash of the blob + write, joined by bounded queues, so memory stays flat whatever the disk size.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from pathlib import Path
from typing import Callable

from diskkit.layers.layer import QUEUE_DEPTH, BlobSink, BlobWriter, LayerResult, file_chunks, pump
from diskkit.streams.compression import compressor


def _produce(source: Path, size: int, out: queue.Queue, plain: "hashlib._Hash", stop: threading.Event) -> None:
    def put(item) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    try:
        for view in file_chunks(source, size):
            plain.update(view)
            if not put(view):
                return
        put(None)
    except BaseException as exc:  # handed to the consumer, which re-raises it in the caller's thread
        put(exc)


def write_blob(source: Path, sink: BlobSink, compression: str, level: int | None = None,
               advance: Callable[[int], None] | None = None) -> LayerResult:
    """`source`'s bytes, compressed as asked, into `sink`; `diff_id` is the digest of the plain bytes."""
    comp = compressor(compression, level)
    size = source.stat().st_size
    plain = hashlib.sha256()
    chunks: queue.Queue = queue.Queue(QUEUE_DEPTH)
    stop = threading.Event()
    reader = threading.Thread(target=_produce, args=(source, size, chunks, plain, stop), daemon=True)
    writer = pump(reader, chunks, stop, comp, BlobWriter(sink, hashed=compression != "none"), advance)
    blob = writer.hash or plain
    return LayerResult("sha256:" + blob.hexdigest(), writer.size, "sha256:" + plain.hexdigest(), compression)

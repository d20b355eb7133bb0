"""The requests before a lazy export's first disk byte, in as few round trips as the protocol lets.

An open reads the image's manifest, then its config, then (imagewalk) each lazy layer's TOC at the
blob's end, the bytes before the disk and those after it, then the disk's first chunk (the header
check): one round trip each, in sequence, over a link where each costs tens of milliseconds. The
TOC's place is in the manifest (the layer's annotations), so as soon as the manifest is read each
lazy layer's tail (the TOC, what follows it and TAIL_AHEAD before it: the members after the disk)
and head (HEAD_AHEAD: the tar header before the disk and its first chunks) are asked for at once,
beside the config, on connections of their own. The walk then finds those ranges here, and the
export its first and last chunks (launcher.diskserver.registrychunks `held`); a read that begins or
ends in a piece asks the registry only for the rest, so no byte of the blob travels twice.

Nothing here is trusted more than before: these are ranges of the same blob that the walk and the
export would have read, checked the same way (the TOC against its pinned digest, each chunk against
the TOC, the layer's bytes around the disk by the blob digest once complete). Every piece is
bounded: HEAD_AHEAD, and TAIL_AHEAD plus the TOC and what follows it only when that is at most
MAX_TAIL, for at most MAX_LAYERS layers, asked only by an open the signature policy admitted, and
not for a layer this server exports already (its bytes are in the node's cache).
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future
from typing import Callable, Protocol, Sequence

from diskkit.errors import DiskkitError
from diskkit.layers import lazytoc
from diskkit.oci.image import Descriptor
from diskkit.registry.ranges import BlobRanges

log = logging.getLogger("launcher.firstbytes")

HEAD_AHEAD = 128 << 10  # the tar header before the disk and the members of its first chunks (a disk header compresses well)
TAIL_AHEAD = 64 << 10  # the members after the disk (the tar's end) lie just before the TOC
MAX_TAIL = lazytoc.MAX_TOC_BYTES + (64 << 10)  # the TOC and what follows it (a gzip trailer), beyond which the walk reads it as before
MAX_LAYERS = 4


class Ranges(Protocol):
    size: int
    digest: str

    def read(self, start: int, length: int) -> bytes: ...


class Early:
    """Ranges of an image's lazy layers asked for as soon as its manifest was read."""

    def __init__(self) -> None:
        self.pieces: dict[str, list[tuple[int, Future]]] = {}  # layer digest -> (start, bytes to come)
        self.readers: list[BlobRanges] = []

    def ranges(self, ranges: Ranges) -> "EarlyRanges | Ranges":
        pieces = self.pieces.get(ranges.digest)
        return EarlyRanges(ranges, pieces) if pieces else ranges

    def held(self, digest: str, low: int, high: int) -> list[tuple[int, bytes]]:
        """The pieces of blob `digest` that came, cut to [low, high) (the disk's members: what an export fetches)."""
        out = []
        for at, future in self.pieces.get(digest, ()):
            data = _result(future)
            lo, hi = max(low, at), min(high, at + len(data or b""))
            if data is not None and lo < hi:
                out.append((lo, data[lo - at : hi - at]))
        return out

    def close(self) -> None:
        """The open is done with them: a piece still retrying a failing registry stops."""
        for ranges in self.readers:
            ranges.stop.set()


def ahead(manifest: bytes, registry, repository: str, known: Callable[[str], bool]) -> Early:
    """Starts reading the head and tail of each lazy layer `manifest` names (an image manifest; an
    index names none: its platform's manifest is read later), but those `known(digest)` says the
    server holds already."""
    early = Early()
    try:
        obj = json.loads(manifest)
        layers = [Descriptor.from_json(layer, "layer") for layer in obj.get("layers") or []] if isinstance(obj, dict) else []
    except (ValueError, TypeError, KeyError, AttributeError, DiskkitError):
        return early  # the walk reads it as before, and says what is wrong with it
    wanted: list[tuple[Descriptor, int, int]] = []
    for layer in layers:
        try:
            loc = lazytoc.location(layer, "layer")
        except DiskkitError:
            continue
        if loc is None or known(layer.digest) or any(layer.digest == w[0].digest for w in wanted):
            continue
        if len({w[0].digest for w in wanted}) == MAX_LAYERS:
            break
        tail_at = max(0, loc.offset - TAIL_AHEAD)
        if layer.size - loc.offset <= MAX_TAIL:
            wanted.append((layer, tail_at, layer.size - tail_at))
        head = min(HEAD_AHEAD, tail_at if wanted and wanted[-1][0] is layer else layer.size)
        if head > 0:
            wanted.append((layer, 0, head))
    for layer, start, length in wanted:
        ranges = BlobRanges(registry, repository, layer.digest, layer.size)
        early.readers.append(ranges)
        early.pieces.setdefault(layer.digest, []).append((start, _started(ranges.read, start, length)))
    return early


def _started(read: Callable[[int, int], bytes], start: int, length: int) -> Future:
    """`read(start, length)` on a thread of its own: a daemon, as a server stopping waits for no registry."""
    future: Future = Future()

    def work() -> None:
        try:
            future.set_result(read(start, length))
        except BaseException as exc:  # handed to whoever asks for the piece
            future.set_exception(exc)

    threading.Thread(target=work, name="first-bytes", daemon=True).start()
    return future


def held_ends(held: Sequence[tuple[int, bytes]], start: int, stop: int) -> tuple[bytes, bytes]:
    """Of blob bytes [start, stop), those `held` (offset, bytes) has at the front, and at the back after them."""
    front = back = b""
    for at, data in held:
        if at <= start < at + len(data):
            front = data[start - at : min(stop, at + len(data)) - at]
    for at, data in held:
        if start + len(front) < at < stop <= at + len(data):
            back = data[: stop - at]
    return front, back


class EarlyRanges:
    """A blob's ranges where what a piece asked for early holds is taken from it, and only the rest asked for."""

    def __init__(self, ranges: Ranges, pieces: list[tuple[int, Future]]):
        self.ranges, self.pieces = ranges, pieces
        self.size, self.digest = ranges.size, ranges.digest

    def read(self, start: int, length: int) -> bytes:
        held = [(at, data) for at, future in self.pieces if (data := _result(future)) is not None]
        front, back = held_ends(held, start, start + length)
        rest = length - len(front) - len(back)
        middle = self.ranges.read(start + len(front), rest) if rest else b""
        return front + middle + back


def _result(future: Future) -> bytes | None:
    """The piece's bytes; None when asking for it failed (the walk then asks again, and reports)."""
    try:
        return future.result()
    except Exception as exc:  # the same range is read again on the walk's own path, whose failure is the one told
        log.info("a range read ahead failed: %s", exc)
        return None

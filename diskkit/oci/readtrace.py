"""A boot's read trace: the order in which a guest first read its containerDisk, published beside
the image so a node's disk server can prefetch in that order (docs/formats.md#boot-read-traces).

Pure. A trace is the predicate of an in-toto statement about one manifest digest, signed and stored
as a boot-test attestation is (diskkit.signing.attestation), under a predicate type of its own:

    {"imageDigest": "sha256:...", "disk": {"path": "disk/root.qcow2", "size": 67108864},
     "granule": 65536, "reads": [[0, 65536], [1048576, 196608], ...], "truncated": false,
     "image": "registry/repo:tag", "launcher": "launcher 1.2", "timestamp": "2026-..."}

`reads` are byte ranges [offset, length] of the disk as the disk server exports it (the file in the
image, a qcow2's own bytes), in the order the guest first touched them, each widened to whole
granules and merged with the one before when they touch; bytes read again are not repeated. A
trace is only ever advice on what to fetch first: every byte still comes through the TOC's pins.
"""

from __future__ import annotations

from dataclasses import dataclass

from diskkit.limits import MAX_TRACE_READS

PREDICATE_TYPE = "urn:diskkit:attestation:boot-reads:v1"
GRANULE = 64 << 10  # qcow2's default cluster: finer is noise to a prefetcher of ~190 KiB chunks


class Refused(Exception):
    """This trace cannot be used for this disk; the message says why in one line."""


@dataclass(frozen=True)
class ReadTrace:
    digest: str
    path: str
    size: int
    reads: tuple[tuple[int, int], ...]
    truncated: bool = False


class Recorder:
    """The first touch of each granule a guest reads, in order, merged into runs; at most
    MAX_TRACE_READS runs (then `truncated`: a boot's first reads are what a prefetch needs most).
    Not thread-safe: the caller holds a lock."""

    def __init__(self, size: int, granule: int = GRANULE):
        self.size, self.granule = size, granule
        self.seen = bytearray(-(-size // granule) // 8 + 1)  # a bit per granule: 2 MiB for a 1 TiB disk
        self.runs: list[list[int]] = []  # [first granule, end granule)
        self.truncated = False

    def add(self, offset: int, length: int) -> None:
        if self.truncated or length <= 0 or offset < 0 or offset >= self.size:
            return
        first, end = offset // self.granule, (min(offset + length, self.size) - 1) // self.granule + 1
        for g in range(first, end):
            if self.seen[g >> 3] & (1 << (g & 7)):
                continue
            if self.runs and self.runs[-1][1] == g:
                self.runs[-1][1] = g + 1
            elif len(self.runs) >= MAX_TRACE_READS:
                self.truncated = True
                return
            else:
                self.runs.append([g, g + 1])
            self.seen[g >> 3] |= 1 << (g & 7)

    def reads(self) -> list[list[int]]:
        g = self.granule
        return [[a * g, min(b * g, self.size) - a * g] for a, b in self.runs]


def predicate(image: str, digest: str, path: str, size: int, reads: list, truncated: bool, launcher: str, timestamp: str) -> dict:
    return {"image": image, "imageDigest": digest, "disk": {"path": path, "size": size}, "granule": GRANULE,
            "reads": reads, "truncated": truncated, "launcher": launcher, "timestamp": timestamp}


def parse(doc, digest: str, path: str, size: int) -> ReadTrace:
    """The trace of `digest`'s disk at `path` (`size` bytes) in a signed predicate; Refused unless it
    names that digest and that disk, within MAX_TRACE_READS ranges, every one inside the disk."""
    if not isinstance(doc, dict):
        raise Refused("the trace is not a JSON object")
    if doc.get("imageDigest") != digest:
        raise Refused(f"the trace is of {str(doc.get('imageDigest'))[:19]}, not {digest[:19]}")
    disk = doc.get("disk")
    if not isinstance(disk, dict) or disk.get("path") != path or disk.get("size") != size:
        got = f"{disk.get('path')!r} of {disk.get('size')} bytes" if isinstance(disk, dict) else "no disk"
        raise Refused(f"the trace names {got}, not {path!r} of {size} bytes")
    reads = doc.get("reads")
    if not isinstance(reads, list):
        raise Refused("the trace has no list of reads")
    if len(reads) > MAX_TRACE_READS:
        raise Refused(f"the trace has {len(reads)} reads, more than {MAX_TRACE_READS}")
    out = []
    for i, entry in enumerate(reads):
        if (not isinstance(entry, list) or len(entry) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in entry)):
            raise Refused(f"reads[{i}] is not [offset, length]")
        offset, length = entry
        if offset < 0 or length <= 0 or offset + length > size:
            raise Refused(f"reads[{i}] [{offset}, {length}] lies outside the {size}-byte disk")
        out.append((offset, length))
    return ReadTrace(digest, path, size, tuple(out), doc.get("truncated") is True)

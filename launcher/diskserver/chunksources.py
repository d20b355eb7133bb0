"""What a lazy export's fill draws chunks from, in order: each source gives the chunks of a run it
can, already checked against what the TOC pins, and the fill asks the next source for the rest.
The registry's ranges are one source (launcher.diskserver.registrychunks); a source that answers
one chunk at a time (the node's own chunks) joins the list through EachChunk."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Protocol

log = logging.getLogger("launcher.chunksources")


@dataclass
class Chunk:
    data: bytes | memoryview  # the chunk's disk bytes, verified
    stored: bytes | memoryview | None = None  # v2, from the registry: its gzip member as the blob holds it


@dataclass
class Taken:
    """What a source gave for a run: good chunks, chunks that failed their check, and the bytes it moved."""

    chunks: dict[int, Chunk] = field(default_factory=dict)
    bad: list[int] = field(default_factory=list)
    nbytes: int = 0


Sink = Callable[[int, Chunk], None]


class RunSource(Protocol):
    reused: bool  # the node's own bytes (counted as reused), not the registry's (counted as fetched)

    def take(self, first: int, end: int, sink: Sink | None = None, ending: Callable[[], None] | None = None) -> Taken:
        """Chunks [first, end) this source has; raises DiskkitError when it failed as a whole.
        `sink(index, chunk)` is given each good chunk as soon as it is checked, before the run ends;
        `ending()` may be called once the rest is about to arrive (a source on the link says when)."""
        ...


class OneChunk(Protocol):
    def get(self, index: int) -> bytes | None: ...


class EachChunk:
    """A source answering chunk by chunk (verified, or None) as a RunSource of the node's bytes."""

    reused = True

    def __init__(self, source: OneChunk):
        self.source = source

    def take(self, first: int, end: int, sink: Sink | None = None, ending: Callable[[], None] | None = None) -> Taken:
        taken = Taken()
        for index in range(first, end):
            try:
                data = self.source.get(index)
            except Exception as exc:  # an index busy or broken costs fetches, never a read
                log.warning("chunks %d-%d not looked up on this node: %s", index, end - 1, exc)
                break
            if data is not None:
                taken.chunks[index] = Chunk(data)
                taken.nbytes += len(data)
                if sink is not None:
                    sink(index, taken.chunks[index])
        return taken

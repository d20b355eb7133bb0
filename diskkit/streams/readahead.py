"""A reader that runs its source in a thread, so the stages of a pull use both cores.

Reading a layer is three kinds of work: fetch and hash the blob, decompress and hash the tar,
parse the tar and write the disk. hashlib and ISA-L release the GIL, so each stage behind a
ReadAhead overlaps the next. Memory stays bounded: `depth` chunks of `chunk` bytes at most.
"""

from __future__ import annotations

from typing import BinaryIO

from diskkit.streams.queuedreader import QueuedReader


class ReadAhead(QueuedReader):
    def __init__(self, source: BinaryIO, chunk: int = 1 << 20, depth: int = 4):
        self._source = source
        self._chunk = chunk
        super().__init__(depth)

    def _produce(self) -> None:
        while not self._stop.is_set() and (data := self._source.read(self._chunk)):
            self._put(data)

    def drain(self) -> None:
        while self.read(self._chunk):
            pass

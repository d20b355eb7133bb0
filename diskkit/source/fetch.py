"""A disk from a URL or a pipe, read once: the bytes are hashed for the published checksum,
decompressed and taken out of a tar as they arrive, and written, sparse, as the one temporary copy
the build then reads (qemu-img must inspect a qcow2 before it is packaged, and a tar header states
the disk's size before its first byte). Nothing is handed on before the checksum holds."""

from __future__ import annotations

import io
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO, Callable

from diskkit.disk import payload
from diskkit.errors import DiskkitError
from diskkit.registry.options import RegistryOptions
from diskkit.source import checksum, urls
from diskkit.streams.readahead import ReadAhead

STDIN = "-"
CHUNK = 1 << 20


def is_stream(spec: str | Path) -> bool:
    """A URL or `-` (stdin), as opposed to a local file."""
    return isinstance(spec, str) and (spec == STDIN or urls.is_url(spec))


def shown(spec: str | Path) -> str:
    if spec == STDIN:
        return "stdin"
    return urls.shown(spec) if isinstance(spec, str) and urls.is_url(spec) else str(spec)


def expectations(spec: str | Path, value: str | None, sums: str | None, opts: RegistryOptions) -> list[checksum.Expected]:
    """What the input's bytes must hash to: --checksum's value, or its entry in the checksum file
    (a URL or a local path), found by the input's file name. Read before the disk, so a missing entry
    costs no download."""
    if value is not None and sums is not None:
        raise DiskkitError("--checksum", "give --checksum or --checksum-file, not both")
    if value is not None:
        return [checksum.parse_value(value)]
    if sums is None:
        return []
    name = urls.file_name(spec) if isinstance(spec, str) and urls.is_url(spec) else ("" if spec == STDIN else Path(spec).name)
    if not name:
        raise DiskkitError(f"--checksum-file {shown(sums)}", f"{shown(spec)} has no file name to look up; give --checksum sha256:HEX")
    if urls.is_url(sums):
        from diskkit.source import httpfile

        text = httpfile.read_small(sums, opts, checksum.FILE_LIMIT)
    else:
        try:
            with open(sums, "rb") as f:
                text = f.read(checksum.FILE_LIMIT + 1)
        except OSError as exc:
            raise DiskkitError(sums, f"checksum file cannot be read ({exc.strerror})") from None
        if len(text) > checksum.FILE_LIMIT:
            raise DiskkitError(sums, f"is more than {checksum.FILE_LIMIT} bytes; a checksum file that large is refused")
    return checksum.lookup(text.decode("utf-8", "replace"), name, f"--checksum-file {shown(sums)}")


def refuse_mismatch(spec, hashes: checksum.Hashes) -> None:
    bad = hashes.mismatch()
    if bad is not None:
        expected, actual = bad
        # containers/image copy/digesting_reader.go's words
        raise DiskkitError(shown(spec), f"Digest did not match, expected {expected}, got {actual} ({expected.origin}); nothing was built")


def check_file(path: Path, expected: list[checksum.Expected]) -> None:
    """A local input hashed whole before it is used."""
    hashes = checksum.Hashes(expected)
    with open(path, "rb") as f:
        while data := f.read(CHUNK):
            hashes.update(data)
    refuse_mismatch(path, hashes)


class Hashing(io.RawIOBase):
    """The stream as read, every byte also fed to the hashes; `count` says how many went through."""

    def __init__(self, raw: BinaryIO, hashes: checksum.Hashes):
        self._raw, self._hashes, self.count = raw, hashes, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        n = self._raw.readinto(buf)
        if n:
            self._hashes.update(memoryview(buf)[:n])
            self.count += n
        return n or 0

    def drain(self) -> None:
        """The rest, after the disk ended (tar padding, trailing bytes): the checksum covers all."""
        buf = bytearray(CHUNK)
        while self.readinto(buf):
            pass


def download(spec: str, workdir: Path, expected: list[checksum.Expected], opts: RegistryOptions,
             note: Callable[[str], None] | None = None) -> payload.Unwrapped:
    """The disk at URL `spec` (or on stdin for `-`), unwrapped into `workdir` in one pass and
    checked against `expected`. A file that changed on the server mid-download is read again
    from its start (at most opts.retries times)."""
    from diskkit.source import httpfile

    note = note or (lambda line: None)
    restarts = 0
    while True:
        out_dir = workdir / f"download{restarts}"
        out_dir.mkdir(parents=True)
        try:
            return _download_once(spec, out_dir, expected, opts, note)
        except httpfile.SourceChanged as exc:
            shutil.rmtree(out_dir, ignore_errors=True)
            if restarts >= opts.retries:
                raise
            restarts += 1
            note(f"{exc.line()}; reading it again from the start")
        except BaseException:
            shutil.rmtree(out_dir, ignore_errors=True)
            raise


def _download_once(spec: str, out_dir: Path, expected, opts: RegistryOptions, note) -> payload.Unwrapped:
    hashes = checksum.Hashes(expected)
    if spec == STDIN:
        raw, name = sys.stdin.buffer.raw if hasattr(sys.stdin.buffer, "raw") else sys.stdin.buffer, ""
    else:
        from diskkit.source import httpfile

        raw, name = httpfile.RemoteFile(spec, opts, note), urls.file_name(spec)
    hashing = Hashing(raw, hashes)
    # Fetching and hashing in a thread of their own, decompressing and writing in this one: hashlib,
    # ISA-L and the lzma/bz2/zstd libraries release the GIL, so both cores work (bench/upstream.py).
    ahead = ReadAhead(hashing)
    try:
        disk = payload.unwrap_stream(ahead, name, shown(spec), out_dir / "disk", note)
        ahead.drain()
    finally:
        ahead.close()
        if spec != STDIN:
            raw.close()
    if expected:
        refuse_mismatch(spec, hashes)
        note(f"{shown(spec)}: {', '.join(str(e) for e in expected)} verified over {hashing.count} bytes")
    return replace(disk, checked=tuple(sorted(str(e) for e in expected)))


"""Durable filesystem writes: temp name, fsync, rename, so nothing half-written looks complete."""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
from pathlib import Path
from typing import Iterator

from diskkit.errors import DiskkitError

WRITEBACK_STEP = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2


def _sync_file_range():
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None  # not Linux: the fsync before publishing does all the work
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return call


_start_writeback = _sync_file_range()


class Writeback:
    """Starts writing a growing file's pages to disk every WRITEBACK_STEP bytes, without waiting.

    A 700 MB disk written to the page cache and fsynced at the end waits a quarter of a second
    for the device, with the CPUs idle; written back as it streams, the fsync finds only the tail.
    """

    def __init__(self, out):
        self._out = out
        self._started = 0

    def __call__(self) -> None:
        position = self._out.tell()
        self._started = min(self._started, position)  # the writer went back (a download restarted)
        if _start_writeback is None or position - self._started < WRITEBACK_STEP:
            return
        self._out.flush()
        _start_writeback(self._out.fileno(), self._started, position - self._started, _SYNC_FILE_RANGE_WRITE)
        self._started = position


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise DiskkitError(path, f"cannot be written ({exc.strerror})") from None
    fsync_dir(path.parent)


def check_writable(directory: Path) -> None:
    """Refuse early, before any work, when the destination directory cannot take new files."""
    if not directory.is_dir():
        raise DiskkitError(directory, "destination directory does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise DiskkitError(directory, "destination directory is not writable")


def staging_file(final: Path) -> Path:
    """A sibling temporary name, on the same filesystem so the final rename is atomic."""
    check_writable(final.parent if str(final.parent) else Path("."))
    if final.is_dir():
        raise DiskkitError(final, "is a directory; an archive destination must be a file")
    return final.with_name(f".{final.name}.diskkit-{secrets.token_hex(4)}")


@contextlib.contextmanager
def publishing(path: Path, verb: str = "written") -> Iterator[Path]:
    """A staging name beside `path` for the block to fill (and fsync); renamed onto `path` when the
    block ends cleanly, removed when it does not."""
    staging = path.with_name(path.name + ".staging")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield staging
        os.rename(staging, path)
    except OSError as exc:
        staging.unlink(missing_ok=True)
        raise DiskkitError(path, f"cannot be {verb} ({exc.strerror})") from None
    except BaseException:
        staging.unlink(missing_ok=True)
        raise

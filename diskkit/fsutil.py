"""Durable filesystem writes: temp name, fsync, rename, so nothing half-written looks complete."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path
from typing import Iterator

from .errors import DiskkitError


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

"""ISO 9660 images with Joliet and Rock Ridge, as KubeVirt's `xorrisofs -joliet -rock` makes them, in-process.

Images are padded to whole MiB. The same volume id and files always give the same bytes: every timestamp is SOURCE_DATE_EPOCH (else
the Unix epoch), entries are sorted, owners are 0:0. Images appear complete under their final name or
not at all (written under `<name>.staging`, fsynced, renamed).
"""

from __future__ import annotations

import contextlib
import io
import os
import threading
import time as _time
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator, Mapping

from diskkit.streams.fsutil import publishing

FILE_MODE = 0o100644
DIR_MODE = 0o040755
_VOLUME_ID_MAX = 32  # bytes of the primary volume descriptor's volume identifier
_JOLIET_MAX = 64  # UCS-2 characters of a Joliet name
_ISO_NAME_MAX = 30  # interchange level 3: name and extension together
# qemu opens images with O_DIRECT (cache none) and then refuses sizes that are not a multiple of the
# host's request alignment; KubeVirt pads for the same reason (xorrisofs -partition_cyl_align on).
ALIGNMENT = 1 << 20
_D_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")


def epoch() -> int:
    return int(os.environ.get("SOURCE_DATE_EPOCH", "0") or 0)


class _FrozenClock:
    """Stands in for the `time` module inside pycdlib, which stamps every record with time.time() and
    the local time zone and takes no date of its own: UTC, at one fixed instant."""

    def __init__(self, at: int):
        self.at = at

    def time(self) -> float:
        return float(self.at)

    def localtime(self, seconds=None):
        return _time.gmtime(self.at if seconds is None else seconds)

    def __getattr__(self, name):
        return getattr(_time, name)


_clock_lock = threading.Lock()


@contextlib.contextmanager
def _frozen_clock(at: int) -> Iterator[None]:
    import pycdlib.dates
    import pycdlib.headervd
    import pycdlib.pycdlib
    import pycdlib.utils

    modules = (pycdlib.dates, pycdlib.headervd, pycdlib.pycdlib, pycdlib.utils)
    with _clock_lock:
        saved = [module.time for module in modules]
        for module in modules:
            module.time = _FrozenClock(at)
        try:
            yield
        finally:
            for module, original in zip(modules, saved):
                module.time = original


def _iso_name(name: str, taken: set[str], directory: bool) -> str:
    """A level-3 ISO 9660 name for `name`, unique in its directory (readers use the Rock Ridge or
    Joliet name; this one only has to be valid)."""
    stem, dot, ext = name.upper().rpartition(".") if not directory and "." in name.strip(".") else (name.upper(), "", "")
    clean = lambda text: "".join(c if c in _D_CHARS else "_" for c in text)  # noqa: E731
    stem, ext = clean(stem) or "_", clean(ext)[:3]
    room = _ISO_NAME_MAX - (len(ext) + 1 if ext else 0)
    for number in range(len(taken) + 1):
        suffix = f"_{number}" if number else ""
        candidate = stem[: room - len(suffix)] + suffix + (f".{ext}" if ext else "")
        if candidate not in taken:
            taken.add(candidate)
            return candidate
    raise AssertionError("unreachable: one of len(taken)+1 candidates is free")


def _joliet_name(name: str, taken: set[str]) -> str:
    for number in range(len(taken) + 1):
        suffix = f"~{number}" if number else ""
        candidate = name[: _JOLIET_MAX - len(suffix)] + suffix
        if candidate not in taken:
            taken.add(candidate)
            return candidate
    raise AssertionError("unreachable")


def check_path(path: str) -> PurePosixPath:
    """A file's path inside the image: relative, no empty, `.` or `..` parts."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{path!r} is not a relative path without '.' or '..' parts")
    return PurePosixPath(path)


def _validated(files: Mapping[str, bytes]) -> list[tuple[PurePosixPath, bytes]]:
    entries = sorted((check_path(p), data) for p, data in files.items())
    paths = {p for p, _ in entries}
    for path, _ in entries:
        for parent in path.parents:
            if parent in paths:
                raise ValueError(f"{parent} is both a file and the directory of {path}")
    return entries


def write_to(out, volume_id: str, files: Mapping[str, bytes], modes: Mapping[str, int] | None = None) -> None:
    """Write the image of `files` (relative path -> content) to the binary stream `out`."""
    import pycdlib  # here: a VM without a config or cloud-init disk never loads it

    if len(volume_id.encode()) > _VOLUME_ID_MAX:
        raise ValueError(f"volume id {volume_id!r} is longer than {_VOLUME_ID_MAX} bytes")
    modes = modes or {}
    entries = _validated(files)
    iso = pycdlib.PyCdlib()
    with _frozen_clock(epoch()):
        # Level 3: names up to 30 characters. xorriso's default is level 1 too, but no reader looks at
        # these names when Rock Ridge or Joliet is there.
        iso.new(interchange_level=3, vol_ident=volume_id, joliet=3, rock_ridge="1.09", sys_ident="", app_ident_str="")
        made: dict[PurePosixPath, tuple[str, str]] = {PurePosixPath("."): ("", "")}  # dir -> (iso path, joliet path)
        iso_taken: dict[PurePosixPath, set[str]] = {}
        joliet_taken: dict[PurePosixPath, set[str]] = {}

        def place(path: PurePosixPath, directory: bool) -> tuple[str, str]:
            parent_iso, parent_joliet = made[path.parent]
            iso_name = _iso_name(path.name, iso_taken.setdefault(path.parent, set()), directory)
            joliet_name = _joliet_name(path.name, joliet_taken.setdefault(path.parent, set()))
            return f"{parent_iso}/{iso_name}", f"{parent_joliet}/{joliet_name}"

        for path, data in entries:
            for directory in reversed(path.parents[:-1]):
                if directory not in made:
                    iso_path, joliet_path = place(directory, True)
                    iso.add_directory(iso_path=iso_path, rr_name=directory.name, joliet_path=joliet_path, file_mode=DIR_MODE)
                    made[directory] = (iso_path, joliet_path)
            iso_path, joliet_path = place(path, False)
            mode = 0o100000 | (modes.get(str(path), FILE_MODE) & 0o7777)
            iso.add_fp(io.BytesIO(data), len(data), iso_path=iso_path + ";1", rr_name=path.name,
                       joliet_path=joliet_path, file_mode=mode)
        iso.write_fp(out)
    iso.close()


def write_iso(path: Path, volume_id: str, files: Mapping[str, bytes], modes: Mapping[str, int] | None = None,
              finish: Callable[[Path], None] | None = None) -> Path:
    """Write the image to `path` atomically; `finish(staging)` runs before the rename (chown, say)."""
    with publishing(path) as staging:
        # 0600 from the start: the image may carry secrets (cloud-init passwords, Secret volumes,
        # tokens); as root, `finish` gives it to the qemu user.
        with os.fdopen(os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
            os.fchmod(out.fileno(), 0o600)  # a staging file left behind keeps its mode through O_CREAT
            write_to(out, volume_id, files, modes)
            out.truncate(-(-out.tell() // ALIGNMENT) * ALIGNMENT)  # zeros, as a hole
            out.flush()
            os.fsync(out.fileno())
        if finish is not None:
            finish(staging)
    return path

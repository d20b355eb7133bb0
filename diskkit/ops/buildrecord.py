"""What a build input made last time: a local record from what pins the input to the layer it gave.

The layer's digest is known only once it has been streamed, so an unchanged rebuild cannot ask the
registry first. The record remembers it, keyed by everything that decides the layer's bytes: each
input file's device, inode, size, mtime_ns and ctime_ns (any write or rename moves ctime) and every
build setting the layer depends on. It is a hint, never a source of truth: a hit is used only once
the destination confirms it holds that blob, and the manifest then names the blob by its digest.
read() and write() keep other records in the same place under the same rules (diskkit.ops.buildskip's).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import tempfile
import time
from pathlib import Path

from diskkit import __version__
from diskkit.layers import lazytoc
from diskkit.layers.layer import LayerResult

DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
FORMAT = 2  # 2: lazy layers record their TOC's version (content-defined chunks, TOC v3, came with it)
MAX_PLACES = 8
SETTLE_NS = 1_000_000_000  # coarser than the timestamps of every Linux filesystem but FAT's


def records_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or ""
    if not os.path.isabs(base):  # the XDG spec: a relative value is invalid and ignored
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "diskkit" / "builds"


def pin(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def key(files: list[tuple[str, Path]], settings: dict, streamed: list[tuple[str, str, tuple[str, ...]]] = ()) -> tuple[str, bool]:
    """The record's name (every (image path, input file) pinned by its inode and times, every
    (image path, URL as shown, checksums verified) of a URL or pipe pinned by those checksums, plus
    the settings), and whether a record may be written under it.

    A file changed again within its filesystem's timestamp granularity of the moment it was pinned
    would keep the same pin with other bytes, so only pins whose ctime lies SETTLE seconds in the
    past are recorded: any later change then gives a different ctime."""
    now = time.time_ns()
    pins = [[image_path, str(Path(local).absolute()), pin(Path(local))] for image_path, local in files]
    sums = [[image_path, source, sorted(checked)] for image_path, source, checked in streamed]
    what = {"format": FORMAT, "diskkit": __version__, "files": pins, "settings": settings, **({"streamed": sums} if sums else {})}
    settled = all(now - p[2][4] >= SETTLE_NS for p in pins)
    return hashlib.sha256(json.dumps(what, sort_keys=True, separators=(",", ":")).encode()).hexdigest(), settled


def _read(name: str) -> dict:
    """The record's JSON, only from a directory and file this user owns and nobody else can write: a
    record someone else planted would name their blob for our input (the HEAD cannot tell)."""
    directory = records_dir()
    st = os.stat(directory, follow_symlinks=False)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise PermissionError(f"{directory} is not this user's alone")
    fd = os.open(directory / f"{name}.json", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise PermissionError(f"{name}.json is not this user's alone")
        return json.loads(f.read(64 << 10))


def lookup(name: str) -> LayerResult | None:
    """The layer recorded under `name`, or None when there is none or it is not one we wrote."""
    try:
        obj = _read(name)
        toc = obj.get("toc")
        layer = LayerResult(
            obj["digest"], int(obj["size"]), obj["diffID"], obj["compression"],
            lazytoc.TocLocation(int(toc["offset"]), int(toc["size"]), toc["digest"]) if toc else None,
            int(toc["version"]) if toc else None,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if obj.get("format") != FORMAT or not (DIGEST.match(layer.digest) and DIGEST.match(layer.diff_id)) or layer.size <= 0:
        return None
    if layer.toc is not None and (not DIGEST.match(layer.toc.digest) or layer.toc_version not in lazytoc.LAZY_VALUES):
        return None
    return layer


def places(name: str) -> list[str]:
    """The registry repositories ("HOST/REPO") this record's layer was last pushed to, newest first."""
    try:
        at = _read(name).get("at") or []
    except (OSError, ValueError, AttributeError):
        return []
    return [p for p in at if isinstance(p, str) and "/" in p][:MAX_PLACES]


def read(name: str) -> dict | None:
    """The record's JSON object, or None when there is none, it is not one we wrote, or not of this format."""
    try:
        obj = _read(name)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) and obj.get("format") == FORMAT else None


def store(name: str, layer: LayerResult, place: str | None = None) -> str | None:
    """Write the record, with `place` first among where the layer is; a cache that cannot be written
    only costs the next rebuild its shortcut, so the reason is returned for a note instead of failing
    the build."""
    obj = {"format": FORMAT, "digest": layer.digest, "size": layer.size, "diffID": layer.diff_id, "compression": layer.compression}
    known = lookup(name)
    earlier = places(name) if known is not None and known.digest == layer.digest else []
    at = [p for p in [place, *earlier] if p]
    if at:
        obj["at"] = list(dict.fromkeys(at))[:MAX_PLACES]
    if layer.toc is not None:
        obj["toc"] = {"offset": layer.toc.offset, "size": layer.toc.size, "digest": layer.toc.digest, "version": layer.toc_version}
    return write(name, obj)


def write(name: str, obj: dict) -> str | None:
    """Write record `name` (temp name, fsync, rename); the reason it could not be written, or None."""
    obj = {**obj, "format": FORMAT}
    directory = records_dir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".record-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps(obj, sort_keys=True).encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, directory / f"{name}.json")
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as exc:
        return f"{directory}: build record not written ({exc.strerror or exc})"
    return None

"""Free cache space: drop what no running VM uses, least recently used first."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from diskkit.errors import DiskkitError

from launcher.node.cache import Cache, tree_size
from launcher.diskserver.server import lazy_leftovers
from launcher.runtime.vms import cleanup, state
from launcher.runtime.runner import Libvirt

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Sizes as users write them: 500M, 10G, 1.5Gi, 2T, 4096 (binary units throughout)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB]?)\s*", text)
    if not match:
        raise DiskkitError(f"--max-size {text}", "must be a size such as 500M, 10G or 1.5Ti")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass
class Collected:
    removed: list[str] = field(default_factory=list)
    freed: int = 0
    kept: int = 0
    vms_cleaned: list[str] = field(default_factory=list)


def collect(cache: Cache, max_size: int | None = None) -> Collected:
    """Without max_size remove every unused disk; with it, only as many (oldest use first) as needed."""
    out = Collected()
    with cache.lock("gc"):
        in_use: set[str] = set()
        for record in cache.vm_records():
            if state(record) in ("running", "unknown"):
                in_use.update(record.get("entries", []))
                continue
            try:
                lv = Libvirt(record["uri"])
            except DiskkitError:
                lv = None
            cleanup(cache, lv, record["domain"])
            out.vms_cleaned.append(record["domain"])
        for stale in cache.stale_staging():
            shutil.rmtree(stale, ignore_errors=True)
        for partial in lazy_leftovers(cache):
            out.freed += tree_size(partial)
            shutil.rmtree(partial, ignore_errors=True)
            out.removed.append(str(partial))
        entries = [(e, tree_size(e)) for e in cache.disks()]
        total = sum(size for _, size in entries)
        unused = sorted((e for e in entries if str(e[0]) not in in_use), key=lambda e: _last_use(e[0]))
        for entry, size in unused:
            if max_size is not None and total <= max_size:
                break
            _remove_entry(entry)
            out.removed.append(str(entry))
            out.freed += size
            total -= size
        out.kept = total
    return out


def _last_use(entry: Path) -> float:
    try:
        return (entry / "meta.json").stat().st_mtime
    except OSError:
        return 0.0


def _remove_entry(entry: Path) -> None:
    # Rename first so a reader never sees a half-deleted entry as complete.
    doomed = entry.with_name(f".gone-{entry.name}")
    entry.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)

"""Free cache space: drop what no running VM uses, least recently used first."""

from __future__ import annotations

import contextlib
import shutil
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

from diskkit.registry.partial import abandoned
from launcher.chunks.index import ChunkIndex
from launcher.diskserver.server import lazy_leftovers
from launcher.node.cache import Cache, tree_size
from launcher.runtime import rundir
from launcher.runtime.stopping import DEFAULT_GRACE_PERIOD
from launcher.runtime.lookup import reachable, state
from launcher.runtime.vms import cleanup


@dataclass
class Collected:
    removed: list[str] = field(default_factory=list)
    freed: int = 0
    kept: int = 0
    vms_cleaned: list[str] = field(default_factory=list)
    locks_removed: list[str] = field(default_factory=list)


def collect(cache: Cache, max_size: int | None = None) -> Collected:
    """Without max_size remove every unused disk; with it, only as many (oldest use first) as needed."""
    out = Collected()
    index = ChunkIndex(cache)
    with cache.lock("gc"):
        in_use: set[str] = set()
        for record in cache.vm_records():
            # A paused VM (by the user, or waiting for space) is a live one: its guest goes on when unpaused.
            if state(record, cache) in ("running", "paused", "unknown"):
                in_use.update(record.get("entries", []))
                continue
            # Through the same stop as `launcher stop`: a domain that started meanwhile gets its grace period.
            with reachable(record) as lv:
                cleanup(cache, lv, record["domain"], record.get("gracePeriod", DEFAULT_GRACE_PERIOD))
            out.vms_cleaned.append(record["domain"])
        out.vms_cleaned += _unrecorded_runs(cache)
        cache.reclaim_staging()
        for partial in abandoned(cache.partial_dir):
            with contextlib.suppress(OSError):
                out.freed += partial.stat().st_blocks * 512
                partial.unlink()
                out.removed.append(str(partial))
        for partial in lazy_leftovers(cache):
            _forget(index, cache, partial)
            out.freed += tree_size(partial)
            shutil.rmtree(partial, ignore_errors=True)
            out.removed.append(str(partial))
        # VM exports' claims count as disks do; they hold what their VM wrote, so they go only when
        # no running VM uses them, as disks, and no launcher is between making one and recording its VM.
        exports = cache.exports()
        entries = [(e, tree_size(e)) for e in [*cache.disks(), *exports]]
        total = sum(size for _, size in entries)
        unused = sorted((e for e in entries if str(e[0]) not in in_use), key=lambda e: _last_use(e[0]))
        for entry, size in unused:
            if max_size is not None and total <= max_size:
                break
            if entry not in exports:
                _forget(index, cache, entry)
            if not _remove_entry(cache, entry, entry in exports):
                continue
            out.removed.append(str(entry))
            out.freed += size
            total -= size
        out.kept = total
        # A VM's lock outlives the VM (one file per name ever run): those no launcher holds go.
        out.locks_removed = [str(path) for prefix in ("vm-", "export-") for path in cache.remove_stale_locks(prefix)]
    return out


def _unrecorded_runs(cache: Cache) -> list[str]:
    """Run directories no VM record names and no launcher holds: those of a run killed before it
    recorded its VM (while pulling or making the overlays). Removed under the VM's lock, so a new
    run of the same name, which takes it first, never loses the directory it is preparing."""
    recorded = {cache.run_dir(record["domain"]) for record in cache.vm_records()}
    removed = []
    for run_dir in cache.run_dirs():
        if run_dir in recorded:
            continue
        with cache.lock_if_free(f"vm-{run_dir.name}") as free:
            if free and not cache.vm_record_path(run_dir.name).exists():
                rundir.remove(run_dir)
                removed.append(run_dir.name)
    return removed


def _last_use(entry: Path) -> float:
    try:
        return (entry / ("meta.json" if (entry / "meta.json").exists() else "vm.json")).stat().st_mtime
    except OSError:
        return 0.0


def _forget(index: ChunkIndex, cache: Cache, removed: Path) -> None:
    """Before the files go, so no pull is pointed at them after (one that read a place meanwhile
    finds the file gone or its bytes wrong, and fetches the chunk)."""
    with contextlib.suppress(sqlite3.Error, ValueError):
        index.forget_under(str(removed.relative_to(cache.root)))


def _remove_entry(cache: Cache, entry: Path, export: bool) -> bool:
    """Removed (True), or kept because a launcher is about to run the VM export it is (False)."""
    if not export:
        _rename_away(entry)
        return True
    with cache.lock_if_free(f"export-use-{entry.name}") as free:
        if free:
            _rename_away(entry)
        return free


def _rename_away(entry: Path) -> None:
    # Rename first so a reader never sees a half-deleted entry as complete.
    doomed = entry.with_name(f".gone-{entry.name}")
    entry.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)

"""A containerDisk read at offsets straight from its registry blob: the fill of a lazy export.

The disk of a seekable image (found in the image's layers by imagewalk) lies in its layer's blob at
a fixed offset (v1, uncompressed) or as one gzip member per chunk (v2, see diskkit.lazytoc). Reads
take the chunks they touch from the export's chunk sources, in order (launcher.diskserver.chunksources:
the registry's ranges are one, launcher.diskserver.registrychunks); background threads prefetch the
rest, in pieces sized to the node's link and never while a read waits for the network
(launcher.diskserver.linkshare). Each chunk lands in the export's files (launcher.diskserver.exportdir) and is marked in a
bitmap persisted after the data is synced, so a restarted server resumes where it stopped.

Integrity: with a TOC every chunk is checked by its source before anyone can read it, and a chunk
that fails is fetched again. Without one (a plain uncompressed layer) chunks are served as they
arrive, unless `strict`, in which case reads wait for the whole blob. Either way, once every chunk
is here the blob digest is recomputed from the file and the layer's other bytes (v2 with chunks
taken from the node rather than fetched has no members for that: the uncompressed tar is checked
against the config's diffID instead); only then is the export marked verified and the file moved
into the cache's extracted-disk store (launcher.diskserver.installed), where `launcher pull` of the
same image finds it.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from diskkit.errors import DiskkitError
from diskkit.ops.verify import DiskFacts, disk_problems
from launcher.chunks.index import CHUNKS_FILE, ChunkIndex, of_toc, records_for
from launcher.diskserver.blobranges import BlobRanges
from launcher.diskserver.chunksources import RunSource, Taken
from launcher.diskserver.exportdir import ExportDir
from launcher.diskserver.installed import Ref, cached_pread, record
from launcher.diskserver.layout import Layout
from launcher.diskserver.linkshare import LinkShare
from launcher.diskserver.nbd import NbdError
from launcher.diskserver.registrychunks import RegistryChunks
from launcher.node.cache import Cache

log = logging.getLogger("launcher.lazydisk")

# A boot reads the head of its disk first (boot sector, loader, kernel, initrd: 17 MiB for the test
# guest): fetched at full speed from the moment the export opens, while libvirt starts qemu.
HEAD_PREFETCH = 32 << 20
# Past the head, a booting guest gets read-ahead only: this far beyond its last read. In a traced
# bench/lazy.py run on 2 cores, the rest of a 4 GiB disk prefetched during the boot (64 MiB/s) made
# the guest's reads take 3.8 s instead of 1.0 s and its kernel 4.9 s instead of 3.3 s next to a 64 MiB
# disk's, though no read waited for the network: the prefetch, the registry and the GIL took the CPU.
READ_AHEAD = 16 << 20
GUEST_BUSY = 3.0  # a guest that read this recently is working: the rest of the disk waits
BOOT_HOLD = 20.0  # ... as it does for this long after a VM was announced or connected (a kernel boots without reading)
SAVE_INTERVAL = 1.0
VERIFY_ATTEMPTS = 3


@dataclass
class Stats:
    fetched_bytes: int = 0  # from the registry, as transferred (v2: compressed)
    fetched_chunks: int = 0
    reused_bytes: int = 0  # taken from the node's own chunks (uncompressed)
    reused_chunks: int = 0
    corrupt_chunks: int = 0
    demand_fetches: int = 0
    failed_fetches: int = 0
    verify_attempts: int = 0


class _Bucket:
    """A token bucket: prefetching at most `rate` bytes a second (0: unlimited), demand reads never wait."""

    def __init__(self, rate: int):
        self.rate = rate
        self.lock = threading.Lock()
        self.next_free = time.monotonic()

    def take(self, nbytes: int, closing: threading.Event) -> None:
        """Waits until `nbytes` more keep the average at `rate`: paid before the request, not after."""
        if not self.rate:
            return
        with self.lock:
            now = time.monotonic()
            self.next_free = max(now, self.next_free) + nbytes / self.rate
            until = self.next_free
        closing.wait(max(0.0, until - now))


@dataclass
class Options:
    strict: bool = False
    prefetch_threads: int = 2
    prefetch_rate: int = 0  # bytes per second, 0 = as fast as the registry goes
    fetch_timeout: float = 300.0  # how long a read waits through registry outages before EIO


class LazyDisk:
    """One export: reads fetch what they need, prefetchers fetch the rest, completion verifies and installs."""

    def __init__(self, cache: Cache, layout: Layout, ranges: BlobRanges, opts: Options, description: str = "",
                 head: bytes | None = None, tail: bytes | None = None, sources: list[RunSource] | None = None,
                 chunk_index: ChunkIndex | None = None, link: LinkShare | None = None):
        """`sources`: where chunks come from, asked in order; the registry's ranges alone by default.
        `chunk_index`: where the installed disk's chunks are recorded, for later pulls and exports.
        `link`: the node's link, shared with the server's other exports (one of its own by default)."""
        self.chunk_index = chunk_index
        self.cache = cache
        self.layout = layout
        self.ranges = ranges
        self.link = link if link is not None else LinkShare()
        self.sources = sources if sources is not None else [RegistryChunks(layout, ranges, link=self.link)]
        self.opts = opts
        self.name = layout.name
        self.description = description or f"{layout.layer} /{layout.member}"
        self.size = layout.size
        self.stats = Stats()
        self.refs: dict[str, Ref] = {}
        self.lock = threading.Lock()
        self.save_lock = threading.Lock()
        self.discarded = False  # refused: nothing of it may be written or installed any more
        self.inflight: dict[int, threading.Event] = {}
        self.closing = ranges.stop  # one event: a stopping export ends its retries too
        self.verified = threading.Event()
        self.failed: str | None = None
        self.last_failure: str | None = None  # the registry's last refusal, while it lasts: told to VMs that pause
        self.progress_at = time.monotonic()  # the last fetch that brought chunks
        # Why an idle server stopped waiting for the rest (no VM reading, the registry failing for a
        # whole fetch timeout): the fill is not busy any more, so the server may go; a VM connecting clears it.
        self.abandoned: str | None = None
        self.installed: Path | None = None
        self.cursor = 0
        self.head_end = layout.grid.past(0, HEAD_PREFETCH)  # the first chunk past the disk's head
        # Prefetching found nothing it may fetch while the guest boots or works, and no fetch was in
        # flight: the rest waits (status's prefetchHeld; any claim clears it).
        self.held = False
        self.last_read = 0.0
        self.last_touch = 0.0
        self.stale_data = False  # after a failed blob digest the file holds suspect bytes: zeros get written too
        self.dirty = False
        self.bucket = _Bucket(opts.prefetch_rate)
        # A boot's trace (launcher.diskserver.traceplan): chunk runs [start, end) in the order it read
        # them, prefetched before anything else, at full speed, as the head is.
        self.plan: list[tuple[int, int]] = []
        self.plan_at = 0  # the runs before it are here
        self.trace: dict | None = None  # what the plan came from, or why there is none
        self.trace_looked_for = False
        self._completing = False
        self.files = ExportDir(cache, layout, ranges.read, head, tail)
        self.fd = self.files.fd
        self.present, self.reused = self.files.bitmaps()
        for k, v in (self.files.state().get("stats") or {}).items():
            if hasattr(self.stats, k):
                setattr(self.stats, k, int(v))
        for ref in self.files.refs():
            self.refs[ref["ref_key"]] = Ref(**ref)
        self.threads = [threading.Thread(target=self._prefetch, name=f"prefetch-{i}", daemon=True) for i in range(max(1, opts.prefetch_threads))]
        self.saver = threading.Thread(target=self._save_regularly, name="save", daemon=True)

    def start(self) -> "LazyDisk":
        self.saver.start()
        if all(self.present):
            threading.Thread(target=self._complete, name="verify", daemon=True).start()
        else:
            for thread in self.threads:
                thread.start()
        return self

    def close(self, grace: float = 1.0) -> None:
        """Stops within `grace` seconds: a fetch stuck on an unreachable registry is abandoned, never
        waited for (SIGTERM must end the server promptly; the bitmap only vouches for synced chunks)."""
        self.closing.set()
        deadline = time.monotonic() + grace
        for thread in [*self.threads, self.saver]:
            if thread.is_alive():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self._save(force=True)
        if not any(thread.is_alive() for thread in self.threads):
            self.files.close()  # else a stuck fetcher may still write to it: it goes with the process

    def discard(self) -> None:
        """Stop and remove everything this export wrote: it was refused. A fetch or a save finishing
        meanwhile writes nothing (the flag is set under the save lock, which every write of state holds)."""
        self.close()
        with self.save_lock:
            self.discarded = True
            self.files.remove()

    def known(self) -> dict[tuple[int, int], Path]:
        """The blob's ranges this export holds in the cache: (start, length) -> file."""
        lay = self.layout
        return {(0, lay.data_start): self.files.path / "head", (lay.data_end, lay.layer_size - lay.data_end): self.files.path / "tail"}

    def add_ref(self, ref: Ref) -> None:
        """Kept with the state, so a server restarted before the end still records every image."""
        with self.lock:
            known = ref.ref_key in self.refs
            self.refs[ref.ref_key] = ref
            installed = self.installed
            refs = [asdict(r) for r in self.refs.values()]
        if installed is not None:
            record(self.cache, ref, installed)
        elif not known:
            self.files.write_refs(refs)

    # --- the NBD side ---------------------------------------------------------------------------

    def touch(self) -> None:
        """A client connected: a VM is starting, and its boot needs the CPU more than the prefetch."""
        self.last_touch = self.last_read = time.monotonic()
        self.abandoned = None

    def no_boot(self) -> None:
        """No VM reads this export nor is announced for it: the boot hold (BOOT_HOLD, GUEST_BUSY) ends."""
        self.last_touch = self.last_read = 0.0

    def stalled_for(self) -> float:
        """Seconds since a fetch last brought chunks (or since the export opened)."""
        return time.monotonic() - self.progress_at

    def abandon(self, reason: str) -> None:
        """An idle server gives up on the rest: recorded in state.json, and the export no longer holds it."""
        self.abandoned = reason
        log.warning("%s: %s", self.name, reason)
        try:
            self._save(force=True)
        except (OSError, DiskkitError) as exc:
            log.warning("%s: state not saved: %s", self.name, exc)

    def follow_trace(self, reads, note: dict) -> None:
        """Prefetch the chunks `reads` (disk byte ranges, checked to lie inside it) touch first, in that order."""
        grid = self.layout.grid
        seen: set[int] = set()
        runs: list[list[int]] = []
        for offset, length in reads:
            for index in range(grid.index(offset), grid.index(offset + length - 1) + 1):
                if index in seen:
                    continue
                seen.add(index)
                if runs and runs[-1][1] == index:
                    runs[-1][1] = index + 1
                else:
                    runs.append([index, index + 1])
        with self.lock:
            self.plan, self.plan_at = [(a, b) for a, b in runs], 0
            self.trace = {**note, "chunks": len(seen)} if reads else note

    def _planned(self) -> tuple[tuple[int, int], ...]:
        """The trace's runs still missing a chunk, those done dropped from the front."""
        with self.lock:
            while self.plan_at < len(self.plan) and self.present.find(0, *self.plan[self.plan_at]) == -1:
                self.plan_at += 1
            return tuple(self.plan[self.plan_at:])

    def _guest_busy(self) -> bool:
        """A guest booting or working on this export: the rest of the disk waits (but the head and read-ahead)."""
        now = time.monotonic()
        return now - self.last_read < GUEST_BUSY or now - self.last_touch < BOOT_HOLD

    def _window(self, busy: bool) -> tuple[tuple[int, int], ...]:
        """The chunk ranges [start, end) prefetching may claim now, in order: a boot trace's first;
        then all of them from the guest's cursor on unless a guest is `busy`; then the read-ahead
        past its last read and the head, and all the rest after them over a slow link
        (LinkShare.slow), where the link is what a boot waits for: the seconds its kernel boots
        without reading fill the disk before its init reads the root filesystem. Over a fast link
        the rest waits for the boot's end: its fetch would only take the CPU the boot needs."""
        grid = self.layout.grid
        count, cursor = grid.count, min(self.cursor, grid.count)
        planned = self._planned()
        rest = ((cursor, count), (0, count))
        if not busy:
            return *planned, *rest
        boot = (cursor, grid.past(cursor, READ_AHEAD)), (0, self.head_end)
        return *planned, *boot, *(rest if self.link.slow() else ())

    def _chunk_span(self, offset: int, length: int) -> tuple[int, int]:
        """The first and last chunk a read of `length` (> 0) bytes at `offset` touches."""
        grid = self.layout.grid
        return grid.index(offset), grid.index(offset + length - 1)

    def _note_read(self, last: int | None) -> None:
        if last is not None:
            self.cursor = last + 1  # prefetch where the guest is reading: boots read sequentially
        self.last_read = time.monotonic()

    def _strict_wait(self) -> bool:
        """Without chunk digests nothing is verified before the whole blob is: strict reads wait for it."""
        return self.opts.strict and not self.layout.pinned and not self.verified.is_set()

    def read_ready(self, offset: int, length: int) -> bytearray | None:
        """The bytes if every chunk they touch is here (and may be served) and in the page cache; else None."""
        if self.failed is not None or not length or self._strict_wait():
            return None
        first, last = self._chunk_span(offset, length)
        if self.present.find(0, first, last + 1) != -1:
            return None
        data = cached_pread(self.fd, length, offset)
        if data is not None:
            self._note_read(last)
        return data

    def read(self, offset: int, length: int) -> bytes:
        if self.failed is not None:
            raise NbdError(errno.EIO, self.failed)
        if not length:
            return b""
        last = None
        if self._strict_wait():
            if not self.verified.wait(self.opts.fetch_timeout) or self.failed is not None:
                raise NbdError(errno.EIO, self.failed or "the blob was not verified in time")
        else:
            first, last = self._chunk_span(offset, length)
            self._ensure(first, last)
        self._note_read(last)
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise NbdError(errno.EIO, f"short read at {offset}")
        return data

    def _ensure(self, first: int, last: int) -> None:
        deadline = time.monotonic() + self.opts.fetch_timeout
        failures = 0
        while True:
            claimed: list[int] = []
            waits: list[threading.Event] = []
            with self.lock:
                for index in range(first, last + 1):
                    if self.present[index]:
                        continue
                    event = self.inflight.get(index)
                    if event is None:
                        self.inflight[index] = threading.Event()
                        claimed.append(index)
                        self.held = False
                    else:
                        waits.append(event)
            if not claimed and not waits:
                return
            if claimed:
                with self.lock:
                    self.stats.demand_fetches += 1
                with self.link.demand():
                    if not self._fetch_claimed(claimed):
                        failures += 1
            for event in waits:
                event.wait(max(0.0, deadline - time.monotonic()))
            if self.failed is not None:
                raise NbdError(errno.EIO, self.failed)
            if self.closing.is_set():
                raise NbdError(errno.ESHUTDOWN, "the disk server is stopping")
            if time.monotonic() > deadline:
                # The VM pauses on this (errorPolicy stop) and is resumed by its launcher, which retries the read.
                log.warning("%s: chunks %d-%d not fetched in %g s: a read fails", self.name, first, last, self.opts.fetch_timeout)
                raise NbdError(errno.EIO, f"chunks {first}-{last} could not be fetched in {self.opts.fetch_timeout:g} s")
            if failures:
                # The registry is down or restarting: wait, then ask again, for as long as the deadline allows.
                self.closing.wait(min(0.5 * 2 ** min(failures, 4), 5.0, max(0.0, deadline - time.monotonic())))

    # --- fetching -------------------------------------------------------------------------------

    def _fetch_claimed(self, claimed: list[int], ending: Callable[[], None] | None = None) -> bool:
        """Fetch chunks this thread claimed, in runs of consecutive ones; always releases the claims.
        `ending()`: told when the last of them are about to arrive (the sources' `take`)."""
        ok = True
        runs: list[list[int]] = []
        for index in claimed:
            if runs and runs[-1][-1] + 1 == index:
                runs[-1].append(index)
            else:
                runs.append([index])
        try:
            for run in runs:
                if not self._fetch_run(run[0], run[-1] + 1, ending if run is runs[-1] else None):
                    ok = False
        finally:
            with self.lock:
                for index in claimed:
                    event = self.inflight.pop(index, None)
                    if event is not None:
                        event.set()
        return ok

    def _fetch_run(self, first: int, end: int, ending: Callable[[], None] | None = None) -> bool:
        """Chunks [first, end) from the sources in order, each asked only for what those before it lacked."""
        missing = [(first, end)]
        for source in self.sources:
            still: list[tuple[int, int]] = []
            for low, high in missing:
                kept: set[int] = set()

                def sink(index: int, chunk, source=source, kept=kept) -> None:
                    self._keep_chunk(index, chunk, source.reused)
                    kept.add(index)

                try:
                    taken = source.take(low, high, sink, ending if (low, high) == missing[-1] else None)
                except DiskkitError as exc:
                    if kept:
                        self.progress_at = time.monotonic()  # some of the run came before the failure
                    with self.lock:
                        if source.reused:
                            self.stats.reused_chunks += len(kept)
                        else:
                            self.stats.fetched_chunks += len(kept)
                    self.stats.failed_fetches += 1
                    self.last_failure = exc.line()
                    self.dirty = True  # state.json tells why the fill is not moving
                    log.warning("%s: chunks %d-%d not fetched: %s", self.name, low, high - 1, exc.line())
                    still.extend(_gaps(low, high, kept))
                    continue
                if not source.reused:
                    self.last_failure = None
                if taken.chunks or not source.reused:
                    self.progress_at = time.monotonic()
                self._keep(taken, source.reused, kept)
                still.extend(_gaps(low, high, taken.chunks))
            missing = still
            if not missing:
                break
        if self.present.find(0) == -1:
            # Readers fetched the last gaps: verify now rather than when a (throttled) prefetcher wakes.
            threading.Thread(target=self._complete, name="verify", daemon=True).start()
        return not missing

    def _keep_chunk(self, index: int, chunk, reused: bool) -> None:
        self.files.write_chunk(index, chunk.data, chunk.stored, self.stale_data)
        # Released at once: a reader waiting for this chunk (the first one of a prefetched run, say)
        # need not wait for the rest of the run to arrive and be checked.
        with self.lock:
            self.present[index] = 1
            self.reused[index] = 1 if reused else 0
            self.dirty = True
            event = self.inflight.pop(index, None)
        if event is not None:
            event.set()

    def _keep(self, taken: Taken, reused: bool, kept: set[int]) -> None:
        """The chunks of `taken` not handed over as they arrived (`kept`), and the counts."""
        for index, chunk in sorted(taken.chunks.items()):
            if index not in kept:
                self._keep_chunk(index, chunk, reused)
        with self.lock:
            if reused:
                self.stats.reused_chunks += len(taken.chunks)
                self.stats.reused_bytes += taken.nbytes
            else:
                self.stats.fetched_chunks += len(taken.chunks)
                self.stats.fetched_bytes += taken.nbytes
            self.stats.corrupt_chunks += len(taken.bad)
        if taken.bad:
            log.warning("%s: chunk%s %s failed verification against the TOC; fetching again", self.name,
                        "s" if len(taken.bad) > 1 else "", ", ".join(map(str, taken.bad)))

    def _claim_prefetch(self, window: tuple[tuple[int, int], ...], span: int) -> list[int] | None:
        """The next run of missing, unclaimed chunks (about `span` bytes) in the first of `window`'s
        ranges that has one; None when none is left there."""
        grid = self.layout.grid
        with self.lock:
            for start, limit in window:
                index = self.present.find(0, start, limit)
                while index != -1 and index in self.inflight:
                    index = self.present.find(0, index + 1, limit)
                if index == -1:
                    continue
                run = []
                end = max(index + 1, grid.past(index, span))  # about `span` bytes, whole chunks
                while index < min(limit, end) and not self.present[index] and index not in self.inflight:
                    self.inflight[index] = threading.Event()
                    run.append(index)
                    index += 1
                self.held = False
                return run
        return None

    def _prefetch(self) -> None:
        niced = False
        failures = 0
        while not self.closing.is_set() and self.failed is None:
            busy = self._guest_busy()
            window = self._window(busy)
            if not busy and not niced:
                # The rest of the disk is background work; the head and the read-ahead are not: a
                # niced thread holding the GIL would keep the guest's reads waiting on a loaded host.
                _lower_priority()
                niced = True
            span = self.link.span()
            # Paid for before claiming: chunks claimed by a throttled prefetcher would keep readers waiting.
            self.bucket.take(span, self.closing)
            with self.link.prefetch(self.name, busy, self.opts.prefetch_threads, self.closing) as place:
                if place is None:
                    return
                run = self._claim_prefetch(window, span)
                fetched = run is not None and self._fetch_claimed(run, place.leave)
            if run is None:
                with self.lock:
                    done = all(self.present) and not self.inflight
                    self.held = not done and busy and not self.inflight
                if done:
                    self._complete()
                    return
                self.closing.wait(0.05)  # the rest is being fetched by readers, or waits for the boot to end
                continue
            if fetched:
                failures = 0
            else:
                failures += 1
                self.closing.wait(min(0.5 * 2 ** min(failures, 5), 10.0))

    # --- completion -----------------------------------------------------------------------------

    def _complete(self) -> None:
        with self.lock:
            if self._completing or self.verified.is_set():
                return
            self._completing = True
        try:
            self._save(force=True)
            self.stats.verify_attempts += 1
            # v2 chunks taken from the node came without their members: the blob cannot be rebuilt, and
            # the uncompressed tar's diffID (pinned by the config the manifest pins) is the end-to-end check.
            members_missing = self.layout.members is not None and self.reused.find(1) != -1
            if members_missing and self.layout.diff_id is None:
                self.failed = f"layer {self.layout.layer[:19]}: chunks reused but no diffID to check them by"
                self.verified.set()
                return
            if not members_missing and (digest := self.files.blob_digest()) != self.layout.layer:
                self._verification_failed(digest)
                return
            if self.layout.diff_id is not None and (diff := self.files.diff_id()) != self.layout.diff_id:
                # The blob is the one the manifest names, so is every chunk: the config disagrees, as a pull would find.
                self.failed = f"layer {self.layout.layer[:19]} unpacks to {diff[:19]}, not the config's diffID {self.layout.diff_id[:19]}"
                self.verified.set()
                log.warning("%s: %s", self.name, self.failed)
                return
            self.verified.set()
            self._save(force=True)
            log.info("%s: complete and verified (%s)", self.name, self.layout.layer)
            self._install()
        except Exception as exc:  # the export keeps serving from its file; only installing is lost
            log.exception("%s: finishing failed: %s", self.name, exc)
        finally:
            with self.lock:
                self._completing = False

    def _verification_failed(self, digest: str) -> None:
        log.warning("%s: the assembled blob hashes to %s, not %s", self.name, digest, self.layout.layer)
        if self.layout.pinned or self.stats.verify_attempts >= VERIFY_ATTEMPTS:
            # With a TOC every chunk matched, so the layer itself disagrees with its TOC: nothing to refetch.
            self.failed = f"layer {self.layout.layer[:19]} does not match its content (hashes to {digest[:19]})"
            self.verified.set()  # wakes strict readers, who then see `failed`
            return
        with self.lock:
            # Every chunk is suspect: fetch them all again, overwriting (a reader may be at the file).
            self.present[:] = bytes(len(self.present))
            self.reused[:] = bytes(len(self.reused))
            self.stale_data = True
            self.dirty = True
        self._save(force=True)
        threading.Thread(target=self._prefetch, name="prefetch-again", daemon=True).start()

    def _install(self) -> None:
        """Into the extracted-disk store, after the checks a pull makes, so `launcher pull` finds it."""
        if self.discarded:
            return
        lay = self.layout
        facts = DiskFacts()
        problems = disk_problems(self.files.path / "disk.img", f"/{lay.member}", facts)
        if problems:
            log.warning("%s: not installed in the disk store: %s", self.name, "; ".join(problems))
            return
        meta = {"layer": lay.layer, "member": lay.member, "format": facts.format, "virtual_size": facts.virtual_size}
        # The TOC's chunks (checked: the disk is verified), and the disk cut as new TOCs cut it where they differ.
        recorded = of_toc(lay)
        records = [recorded] if recorded is not None else []
        if self.chunk_index is not None:
            try:
                records = records_for(self.files.path / "disk.img", recorded)
            except OSError as exc:  # only a hint is lost
                log.warning("%s: not hashed for the chunk index: %s", self.name, exc)
        # Beside the disk, what an index rebuild reads (as `launcher pull` writes it).
        extra = {CHUNKS_FILE: records[0].render()} if records else {}
        final = self.cache.install_disk(self.files.path / "disk.img", lay.layer, lay.member, meta, extra)
        if records:
            # Before it shows as installed: a server stopped right then has recorded it.
            try:
                self.chunk_index.add_file(str(final.relative_to(self.cache.root)), *records)
            except Exception as exc:  # only a hint is lost: later images fetch these chunks
                log.warning("%s: not recorded in the chunk index: %s", self.name, exc)
        with self.lock:
            self.installed = final
            refs = list(self.refs.values())
        for ref in refs:
            record(self.cache, ref, final)
        self.files.installed(final)
        log.info("%s: installed as %s", self.name, final)

    # --- state ----------------------------------------------------------------------------------

    def _save_regularly(self) -> None:
        """Off the readers' path: a guest's read never waits for an fsync."""
        while not self.closing.wait(SAVE_INTERVAL):
            if self.dirty:
                try:
                    self._save()
                except (OSError, DiskkitError) as exc:
                    log.warning("%s: state not saved: %s", self.name, exc)

    def _save(self, force: bool = False) -> None:
        """The bitmap, after the data it vouches for is on disk."""
        if (not force and not self.dirty) or self.installed is not None:
            return
        with self.save_lock:
            if self.discarded:
                return
            with self.lock:
                present, reused = bytearray(self.present), bytearray(self.reused)
                self.dirty = False
            self.files.save(present, reused, self.status())

    def status(self) -> dict:
        with self.lock:
            present, held = sum(self.present), self.held
        return {
            "export": self.name,
            "description": self.description,
            "layer": self.layout.layer,
            "member": self.layout.member,
            "size": self.layout.size,
            "chunkSize": self.layout.chunk_size,
            "chunks": self.layout.count,
            "present": present,
            "prefetchHeld": held,
            "toc": self.layout.pinned,
            "strict": self.opts.strict,
            "verified": self.verified.is_set() and self.failed is None,
            "installed": str(self.installed) if self.installed else None,
            "failed": self.failed,
            "lastFailure": self.last_failure,
            "abandoned": self.abandoned,
            "trace": self.trace,
            "stats": asdict(self.stats),
        }

    @property
    def busy(self) -> bool:
        """Still fetching or verifying: a server waiting to exit when idle waits for this too."""
        return (self.failed is None and self.abandoned is None and self.installed is None
                and (not self.verified.is_set() or self._completing))


def _gaps(low: int, high: int, given) -> list[tuple[int, int]]:
    """The runs of [low, high) a source did not give: asked of the next source, coalesced."""
    gaps: list[tuple[int, int]] = []
    for index in range(low, high):
        if index in given:
            continue
        if gaps and gaps[-1][1] == index:
            gaps[-1] = (gaps[-1][0], index + 1)
        else:
            gaps.append((index, index + 1))
    return gaps


def _lower_priority() -> None:
    """Prefetching is background work: the guest's own reads (and the VM's CPU) come first."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError:
        pass


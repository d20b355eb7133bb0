"""Benchmark an image update on a node that has the old version: bytes fetched and seconds, v1 -> v2.

Five pairs. Four are made from bench/build.py's real-content disk (an ext4 image filled from /usr
with `mke2fs -d`, made once and cached in the workdir; --size-mb is the MiB of content in it):

  raw 1%           the ext4 image as a raw disk; v2 has 1 % of its MiBs replaced whole with new
  raw 10%          content: the aligned cases, where every changed byte lies in place and nothing moved
  qcow2 in place   the image as qcow2 (`qemu-img convert -O qcow2`); v2 is a copy changed by
                   `qemu-io` writes of 256 KiB, 1 % of the virtual size in all: three quarters at
                   random 4 KiB-aligned offsets in allocated data, which they overwrite where it
                   is, a quarter at holes between allocated clusters (`qemu-img map`), which get
                   new clusters appended to the file (and L2 table and refcount updates): the
                   clusters already there keep their offsets
  qcow2 converted  that v2 after `qemu-img convert -O qcow2`: the clusters are laid out again in
                   guest order, so everything after the first filled hole moves by whole clusters
                   (64 KiB)

The fifth is an update as distributions rebuild their cloud images:

  qcow2 rebuilt    v1 = `qemu-img convert -c -O qcow2` of a guest's raw disk (a compressed qcow2,
                   as cloud images ship); v2 = the same disk with 4 x 1 MiB of new content written
                   into its data, compressed again the same way: `qemu-img convert -c` packs the
                   compressed clusters at byte offsets, so every cluster after the first change
                   sits at another, unaligned offset of the file, and the L2 tables that point at
                   them changed. With --debian the guest is a Debian 12 root filesystem (mmdebstrap
                   --variant=minbase with the cloud kernel, systemd, udev, cloud-init and openssh,
                   from the host's apt sources) in a 2 GiB ext4 disk, made once and cached in the
                   workdir, as a cloud image is; without, the /usr ext4 image above.

Chunks that keep their identity where they move (content-defined cut points, TOC v3) are what make
the last two cases cost their change; the first three cost it with any chunking.

New content is seeded pseudo-random bytes over a 16-letter alphabet: gzip keeps about 55 % of it,
as it does of real data, and no tool can find it anywhere in v1. Every disk is built and pushed
by `diskkit build DISK -t REGISTRY/bench/delta-CASE:v1|v2` (a lazy gzip layer, one gzip member
per chunk, with its TOC), to Debian's docker-registry started here on a free 127.0.0.1 port
(bench/registry.py's). The bytes fetched are the response bodies relayed by a counting proxy
(tests/faultproxy.py) in front of the registry and in front of casync's chunk store.

Three ways to get v2's disk onto a node:

  full pull  `skopeo copy docker://PROXY/bench/delta-CASE:v2 oci:DIR:x` + `umoci unpack --rootless`
             into a fresh directory (timed as the sum of both): what a node without us fetches
  ours       `launcher pull --cache-dir CACHE --tls-verify=false PROXY/bench/delta-CASE:v2`, where
             CACHE already holds v1 (pulled once with `launcher pull`, untimed, straight from the
             registry; each run gets a fresh copy of that cache at the same path)
  casync     `casync make --store=STORE CASE.caibx v2disk` once (untimed, its defaults: 64 KiB
             average content-defined chunks, sha512-256, zstd), the store and index served by
             `python3 -m http.server` on loopback; timed:
             `casync extract --seed=v1disk --store=http://PROXY/STORE http://PROXY/CASE.caibx OUT`

The ideal is what a chunk-reusing pull cannot avoid: v2's TOC plus the gzip members of v2's
chunks whose content v1 lacks anywhere (by the chunks' content hashes in both TOCs; all-zero chunks
need no v1). Goals, printed PASS/MISS: ours fetches <= 1.2x the ideal in every case; on the aligned
(raw) cases ours fetches fewer bytes than casync, in less wall time; on the rebuilt pair ours
fetches at most 12 MiB (the issue's goal for its 154 MiB Debian layer) in less wall time than
casync. Each output is checked byte for byte against v2's disk on a variant's first run of each
case (untimed).

Runs are whole processes, --runs times, interleaved (every case, in it every variant in turn),
each after bench/registry.py's --cache preparation: warm (`sync`, then the registry's v2 blobs,
v1's disk and casync's store read into the page cache) or sync (`sync`, and as root
drop_caches). Reported per case and variant: median and best wall and CPU seconds (user+sys of
the processes and their reaped children; the proxies run in this script and are not counted),
MiB fetched, the ratio to the ideal, the peak RSS of each process. What `launcher pull --json`
says it fetched and reused is shown too when it says so. The machine's load average is printed
with the figures. The exit status is 0 unless a command fails or an output differs from v2.

Run from the project root, as root (drop_caches under --cache sync; the launcher's cache modes;
mmdebstrap's root mode, in a mount namespace of its own, for --debian):
    .venv/bin/python bench/delta.py                          # 256 MiB of content, 3 runs, warm
    .venv/bin/python bench/delta.py --cases qcow2-rebuilt --debian --runs 5
    .venv/bin/python bench/delta.py --cases raw-1,raw-10 --runs 5
    .venv/bin/python bench/delta.py --size-mb 8 --runs 1 --json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import sibling

breg = sibling.load("registry")
bb = breg.bb
MIB = bb.MIB
ROOT = bb.ROOT
sys.path.insert(0, str(ROOT))

from diskkit.layers import lazytoc  # noqa: E402  (this tree, found through ROOT)
from diskkit.oci.image import Descriptor  # noqa: E402
from tests.faultproxy import FaultProxy  # noqa: E402

DEFAULT_SIZE_MB = 256
TARGET_IDEAL_RATIO = 1.2
TARGET_REBUILT_MIB = 12  # the goal for its Debian pair (154 MiB layer, 4 x 1 MiB changed)
REBUILT_WRITES = 4
REBUILT_WRITE = 1 << 20
DEBIAN_VERSION = 1  # bump when the Debian disk is made otherwise, so a cached one is made again
DEBIAN_DISK_MB = 2048  # Debian's own cloud images have a 2 GiB disk
DEBIAN_PACKAGES = "linux-image-cloud-amd64,systemd-sysv,udev,openssh-server,cloud-init,ifupdown,isc-dhcp-client,sudo,less,vim-tiny,ca-certificates"
SEED = 31
ALPHABET = b"etaoinshrdlucmfw"  # 16 letters: 4 bits of entropy per byte, gzip keeps about 55 %
WRITE_SIZE = 256 << 10
WRITE_ALIGN = 4096
INPLACE_FRACTION = 0.01
READY_TIMEOUT = 15.0

CASES = ("raw-1", "raw-10", "qcow2-inplace", "qcow2-convert", "qcow2-rebuilt")
CASE_TITLES = {"raw-1": "raw 1%", "raw-10": "raw 10%", "qcow2-inplace": "qcow2 in place", "qcow2-convert": "qcow2 converted",
               "qcow2-rebuilt": "qcow2 rebuilt (qemu-img convert -c)"}
REBUILT = "qcow2-rebuilt"
ALIGNED = ("raw-1", "raw-10")
FULL, OURS, CASYNC = "full pull", "ours", "casync"
VARIANTS = (FULL, OURS, CASYNC)
VARIANT_TOOLS = {FULL: "skopeo copy + umoci unpack", OURS: "launcher pull, v1 cached", CASYNC: "casync extract --seed=v1"}


# --------------------------------------------------------------------------- the pairs


def new_content(rng: random.Random, size: int) -> bytes:
    """Bytes found nowhere else, compressing about as real data does."""
    table = bytes(ALPHABET[b % len(ALPHABET)] for b in range(256))
    return rng.randbytes(size).translate(table)


def file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def copy_sparse(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    bb.run_quiet(["cp", "--sparse=always", "--reflink=auto", str(src), str(dest)])


def raw_changed(v1: Path, dest: Path, percent: int, rng: random.Random) -> list[int]:
    """v1 with `percent` % of its MiBs (at least one) replaced whole; their indexes."""
    copy_sparse(v1, dest)
    size = v1.stat().st_size
    chunk = MIB
    count = -(-size // chunk)
    picked = sorted(rng.sample(range(count), max(1, round(count * percent / 100))))
    with open(dest, "r+b") as f:
        for index in picked:
            start = index * chunk
            f.seek(start)
            f.write(new_content(rng, min(chunk, size - start)))
    return picked


def write_offsets(extents: list[dict], virtual: int, writes: int, rng: random.Random) -> list[int]:
    """Guest offsets for `writes` writes: a quarter (at least one) at the start of holes that lie
    between allocated clusters, so a convert must move what follows; the rest inside allocated data,
    placed at random in proportion to each extent's length, so they overwrite clusters in place."""
    last = max((e["start"] + e["length"] for e in extents if e["data"]), default=0)
    holes = [e["start"] for e in extents if not e["data"] and e["start"] + e["length"] < last]
    data = [(e["start"], e["length"]) for e in extents if e["data"]]
    into_holes = min(len(holes), max(1, writes // 4))
    offsets = rng.sample(holes, into_holes)
    total = sum(length for _, length in data)
    for _ in range(writes - into_holes):
        at = rng.randrange(total)
        for start, length in data:
            if at < length:
                offsets.append(min(start + at, max(start, start + length - WRITE_SIZE, 0)) // WRITE_ALIGN * WRITE_ALIGN)
                break
            at -= length
    return sorted(min(o, virtual - WRITE_SIZE) for o in offsets)


def qcow2_written(v1: Path, dest: Path, scratch: Path, rng: random.Random) -> list[tuple[int, int]]:
    """v1 (qcow2) changed in place by qemu-io writes; the (guest offset, length) written."""
    copy_sparse(v1, dest)
    info = json.loads(subprocess.run(["qemu-img", "info", "--output=json", str(dest)], capture_output=True, text=True, check=True).stdout)
    extents = json.loads(subprocess.run(["qemu-img", "map", "--output=json", str(dest)], capture_output=True, text=True, check=True).stdout)
    virtual = info["virtual-size"]
    offsets = write_offsets(extents, virtual, max(1, round(virtual * INPLACE_FRACTION / WRITE_SIZE)), rng)
    cmd = ["qemu-io", "-f", "qcow2"]
    patterns = scratch / "patterns"
    patterns.mkdir()
    done = []
    for n, offset in enumerate(offsets):
        pattern = patterns / f"w{n}"
        pattern.write_bytes(new_content(rng, WRITE_SIZE))
        cmd += ["-c", f"write -q -s {pattern} {offset} {WRITE_SIZE}"]
        done.append((offset, WRITE_SIZE))
    bb.run_quiet([*cmd, str(dest)])
    shutil.rmtree(patterns)
    return done


def data_extents(path: Path) -> list[tuple[int, int]]:
    """(offset, length) of the file's data, holes left out (SEEK_DATA / SEEK_HOLE)."""
    out = []
    fd = os.open(path, os.O_RDONLY)
    try:
        at, size = 0, os.fstat(fd).st_size
        while at < size:
            try:
                start = os.lseek(fd, at, os.SEEK_DATA)
            except OSError:
                break
            at = os.lseek(fd, start, os.SEEK_HOLE)
            out.append((start, at - start))
    finally:
        os.close(fd)
    return out


def rewritten(base: Path, dest: Path, rng: random.Random) -> list[int]:
    """`base` (raw) with REBUILT_WRITES writes of REBUILT_WRITE new bytes, each at a random 4 KiB-aligned
    offset inside its data, as a guest's update writes files; the offsets."""
    copy_sparse(base, dest)
    extents = data_extents(base)
    total = sum(length for _, length in extents)
    size = base.stat().st_size
    offsets = []
    with open(dest, "r+b") as f:
        for _ in range(REBUILT_WRITES):
            at = rng.randrange(total)
            for start, length in extents:
                if at < length:
                    offset = min(start + at, size - REBUILT_WRITE) // WRITE_ALIGN * WRITE_ALIGN
                    break
                at -= length
            f.seek(offset)
            f.write(new_content(rng, REBUILT_WRITE))
            offsets.append(offset)
    return sorted(offsets)


def make_debian_disk(workdir: Path, log) -> Path:
    """A Debian 12 guest's root filesystem in a raw ext4 disk, as a cloud image holds it; cached."""
    disk, meta_path = workdir / "debian-bookworm.raw", workdir / "debian-bookworm.json"
    if disk.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("version") == DEBIAN_VERSION and meta.get("bytes") == disk.stat().st_size:
            return disk
    if os.geteuid() != 0:
        raise SystemExit("--debian makes its disk with mmdebstrap's root mode: run as root")
    scratch = Path(tempfile.mkdtemp(prefix=".debian-", dir=workdir))
    try:
        root = scratch / "root"
        log(f"making {disk.name}: mmdebstrap --variant=minbase --include={DEBIAN_PACKAGES} bookworm ...")
        # A mount namespace of its own: root mode mounts /proc, /sys and /dev inside the tree it makes.
        bb.run_quiet(["unshare", "--mount", "--propagation", "private", "mmdebstrap", "--quiet", "--mode=root", "--variant=minbase",
                      f"--include={DEBIAN_PACKAGES}", "bookworm", str(root)])
        raw = scratch / "disk.raw"
        log(f"  mke2fs -d into a {DEBIAN_DISK_MB} MiB ext4 disk ...")
        bb.run_quiet(["mke2fs", "-q", "-t", "ext4", "-F", "-d", str(root), str(raw), f"{DEBIAN_DISK_MB}M"])
        os.replace(raw, disk)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    meta_path.write_text(json.dumps({"version": DEBIAN_VERSION, "bytes": disk.stat().st_size, "packages": DEBIAN_PACKAGES}, indent=1) + "\n")
    return disk


@dataclass
class Pair:
    case: str
    v1: Path
    v2: Path
    format: str
    changes: str  # what was done to v1, in words
    repo: str = ""
    v2_layer: dict = field(default_factory=dict)  # the descriptor in v2's manifest
    chunk_size: int = 0
    chunks: int = 0
    new_chunks: int = 0  # chunks of v2 whose content v1 has nowhere
    new_members_bytes: int = 0  # their gzip members in v2's blob
    toc_bytes: int = 0
    image_bytes: int = 0  # v2's manifest + config + layers: what a full pull fetches at least
    casync_store: Path | None = None
    casync_index: Path | None = None
    casync_bytes: int = 0  # the store's chunks and the index, on disk
    v2_sha256: str = ""
    v1_bytes: int = 0
    v2_bytes: int = 0

    @property
    def ideal_bytes(self) -> int:
        return self.new_members_bytes + self.toc_bytes

    def to_json(self) -> dict:
        return {"case": self.case, "format": self.format, "changes": self.changes, "v1_bytes": self.v1_bytes, "v2_bytes": self.v2_bytes, "chunk_size": self.chunk_size, "chunks": self.chunks,
                "new_chunks": self.new_chunks, "new_members_bytes": self.new_members_bytes, "toc_bytes": self.toc_bytes,
                "ideal_bytes": self.ideal_bytes, "image_bytes": self.image_bytes, "casync_store_bytes": self.casync_bytes}


def make_pairs(base_qcow2: Path, scratch: Path, cases: list[str], log, guest_raw: Path | None = None) -> dict[str, Pair]:
    """The pairs; `guest_raw` is the rebuilt pair's guest disk (else the /usr disk as raw)."""
    rng = random.Random(SEED)
    pairs: dict[str, Pair] = {}
    raw_v1 = scratch / "raw-v1" / "disk.img"
    if any(c.startswith("raw-") for c in cases) or (REBUILT in cases and guest_raw is None):
        raw_v1.parent.mkdir()
        log("  raw v1: qemu-img convert -O raw ...")
        bb.run_quiet(["qemu-img", "convert", "-f", "qcow2", "-O", "raw", str(base_qcow2), str(raw_v1)])
    for percent in (1, 10):
        case = f"raw-{percent}"
        if case in cases:
            v2 = scratch / case / "disk.img"
            picked = raw_changed(raw_v1, v2, percent, rng)
            pairs[case] = Pair(case, raw_v1, v2, "raw", f"{len(picked)} whole MiBs replaced")
    qcow2_v1 = scratch / "qcow2-v1" / "disk.qcow2"
    inplace = scratch / "qcow2-inplace" / "disk.qcow2"
    if {"qcow2-inplace", "qcow2-convert"} & set(cases):
        copy_sparse(base_qcow2, qcow2_v1)
        log("  qcow2 v2: qemu-io writes ...")
        writes = qcow2_written(qcow2_v1, inplace, scratch, rng)
        said = f"{len(writes)} qemu-io writes of {WRITE_SIZE >> 10} KiB (in data and in holes)"
        if "qcow2-inplace" in cases:
            pairs["qcow2-inplace"] = Pair("qcow2-inplace", qcow2_v1, inplace, "qcow2", said)
        if "qcow2-convert" in cases:
            converted = scratch / "qcow2-convert" / "disk.qcow2"
            converted.parent.mkdir()
            bb.run_quiet(["qemu-img", "convert", "-f", "qcow2", "-O", "qcow2", str(inplace), str(converted)])
            pairs["qcow2-convert"] = Pair("qcow2-convert", qcow2_v1, converted, "qcow2", said + ", then qemu-img convert")
    if REBUILT in cases:
        guest = guest_raw or raw_v1
        changed = scratch / REBUILT / "changed.raw"
        changed.parent.mkdir()
        offsets = rewritten(guest, changed, rng)
        v1, v2 = scratch / REBUILT / "v1.qcow2", scratch / REBUILT / "v2.qcow2"
        log(f"  {REBUILT}: qemu-img convert -c -O qcow2, twice ...")
        for raw, out in ((guest, v1), (changed, v2)):
            bb.run_quiet(["qemu-img", "convert", "-c", "-f", "raw", "-O", "qcow2", str(raw), str(out)])
        changed.unlink()
        said = (f"{'Debian 12 guest' if guest_raw else '/usr ext4 image'}: {REBUILT_WRITES} x {REBUILT_WRITE >> 20} MiB written at "
                f"{', '.join(f'{o / MIB:.1f}' for o in offsets)} MiB, both compressed by qemu-img convert -c")
        pairs[REBUILT] = Pair(REBUILT, v1, v2, "qcow2", said)
    return {c: pairs[c] for c in cases}


def push_pair(registry: breg.Registry, pair: Pair) -> None:
    pair.repo = f"bench/delta-{pair.case}"
    for tag, disk in (("v1", pair.v1), ("v2", pair.v2)):
        bb.run_quiet([*bb.diskkit_command(), "build", str(disk), "-t", f"{registry.host}/{pair.repo}:{tag}", "--tls-verify=false"])
    _, manifest = registry.manifest(pair.repo, "v2")
    layers = manifest.get("layers") or []
    if len(layers) != 1:
        raise SystemExit(f"{pair.repo}:v2 has {len(layers)} layers; the bench expects diskkit build's one")
    pair.v2_layer = layers[0]
    pair.image_bytes = registry.pushed_bytes(pair.repo, "v2")


def stored_toc(registry: breg.Registry, repo: str, tag: str) -> tuple[lazytoc.Toc, lazytoc.TocLocation]:
    """The lazy TOC of `repo:tag`'s one layer, read from the registry's storage."""
    where = f"{repo}:{tag}"
    _, manifest = registry.manifest(repo, tag)
    desc = manifest["layers"][0]
    loc = lazytoc.location(Descriptor.from_json(desc, where), where)
    if loc is None:
        raise SystemExit(f"{where}: the layer has no lazy TOC (diskkit build makes lazy layers by default)")
    with open(registry.blob_files(repo, tag)[-1], "rb") as f:
        f.seek(loc.offset)
        stored = f.read(loc.size)
    version = lazytoc.version_for(desc["mediaType"])
    toc = lazytoc.parse(lazytoc.read_stored(stored, version, where), loc, where, version)
    if toc.members is None or toc.content_hashes is None:
        raise SystemExit(f"{where}: the TOC lists no gzip members named by content; the bench compares gzip layers")
    return toc, loc


def measure_ideal(registry: breg.Registry, pair: Pair) -> None:
    """Which of v2's chunks v1 lacks (by the content hashes both TOCs name; all-zero chunks need
    no v1), and what their gzip members and the TOC weigh in v2's blob."""
    old, _ = stored_toc(registry, pair.repo, "v1")
    toc, loc = stored_toc(registry, pair.repo, "v2")
    if toc.size != pair.v2.stat().st_size:
        raise SystemExit(f"{pair.repo}:v2: the TOC's disk is {toc.size} bytes, {pair.v2} is {pair.v2.stat().st_size}")
    hash_name, hexes = toc.content_hashes
    have = set(old.content_hashes[1])
    ranges = [toc.chunk_range(i) for i in range(toc.count)]
    new = [i for i, (start, end) in enumerate(ranges) if hexes[i] not in have and hexes[i] != lazytoc.content_hash(hash_name, bytes(end - start))]
    pair.chunk_size, pair.chunks, pair.new_chunks = toc.grid.mean, toc.count, len(new)
    pair.new_members_bytes = sum(toc.members[i][1] for i in new)
    pair.toc_bytes = loc.size


# --------------------------------------------------------------------------- servers


class FileServer:
    """`python3 -m http.server` on a free loopback port over `directory`: casync's remote store."""

    def __init__(self, directory: Path, workdir: Path):
        self.host = f"127.0.0.1:{breg.free_port()}"
        self._log = open(workdir / f"http-{self.host.rpartition(':')[2]}.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "--protocol", "HTTP/1.1",
                                      "--directory", str(directory), self.host.rpartition(":")[2]],
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=breg.die_with_parent)
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"http.server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://{self.host}/", timeout=1):
                    return
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    raise SystemExit(f"http.server on {self.host} not ready after {READY_TIMEOUT:g}s") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self._log.close()


def casync_make(pair: Pair, store_root: Path) -> None:
    pair.casync_store = store_root / f"store-{pair.case}"
    pair.casync_index = store_root / f"{pair.case}.caibx"
    bb.run_quiet(["casync", "make", f"--store={pair.casync_store}", str(pair.casync_index), str(pair.v2)])
    pair.casync_bytes = bb.tree_bytes(pair.casync_store) + pair.casync_index.stat().st_size


# --------------------------------------------------------------------------- runs


@dataclass
class Sample:
    wall_s: float
    cpu_s: float
    rss_kib: dict[str, int]
    fetched: int  # response body bytes relayed by the counting proxy
    reported: dict | None = None  # what `launcher pull --json` said it fetched and reused, if it says


@dataclass
class Result(breg.Result):
    """bench/registry.py's statistics over one pair's runs of one variant (`mode` is the cache condition)."""

    case: str = ""

    def to_json(self, ideal: int) -> dict:
        fetched = self.median("fetched")
        return {"case": self.case, "variant": self.variant, "tool": VARIANT_TOOLS[self.variant],
                "median": {"fetched_bytes": int(fetched), "wall_s": round(self.median("wall_s"), 3), "cpu_s": round(self.median("cpu_s"), 3)},
                "best": {"fetched_bytes": int(self.best("fetched")), "wall_s": round(self.best("wall_s"), 3), "cpu_s": round(self.best("cpu_s"), 3)},
                "x_ideal": round(fetched / ideal, 2) if ideal else None,
                "peak_rss_mib": {k: round(v, 1) for k, v in self.peak_rss_mib().items()},
                "samples": [asdict(s) for s in self.samples]}


class Bench:
    def __init__(self, workdir: Path, registry: breg.Registry, files: FileServer, mode: str, log):
        self.workdir, self.registry, self.mode, self.log = workdir, registry, mode, log
        self.registry_proxy = FaultProxy(registry.host)
        self.store_proxy = FaultProxy(files.host)
        self.caches = workdir / "caches"
        self.caches.mkdir()
        self.checked: set[tuple[str, str]] = set()

    def close(self) -> None:
        self.registry_proxy.close()
        self.store_proxy.close()

    def cache_path(self, pair: Pair) -> Path:
        return self.caches / pair.case

    def seed_cache(self, pair: Pair) -> None:
        """v1 in a node cache, pulled once straight from the registry; each run copies it back to
        the same path (the cache's records name absolute paths)."""
        cache = self.cache_path(pair)
        bb.run_quiet([*bb.tool_command("launcher"), "pull", "--cache-dir", str(cache), "--tls-verify=false",
                      f"{self.registry.host}/{pair.repo}:v1"])
        cache.rename(cache.with_name(cache.name + ".seed"))

    def warm_files(self, pair: Pair) -> list[Path]:
        return [*self.registry.blob_files(pair.repo, "v2"), pair.v1, *sorted(pair.casync_store.rglob("*.cacnk")), pair.casync_index]

    def commands(self, variant: str, pair: Pair, run_dir: Path) -> list[list[str]]:
        ref = f"{self.registry_proxy.host}/{pair.repo}:v2"
        if variant == FULL:
            layout = run_dir / "layout"
            return [["skopeo", "copy", "--src-tls-verify=false", f"docker://{ref}", f"oci:{layout}:x"],
                    ["umoci", "unpack", "--rootless", "--image", f"{layout}:x", str(run_dir / "bundle")]]
        if variant == OURS:
            return [[*bb.tool_command("launcher"), "pull", "--json", "--cache-dir", str(self.cache_path(pair)), "--tls-verify=false", ref]]
        store = f"http://{self.store_proxy.host}/{pair.casync_store.name}"
        return [["casync", "extract", f"--seed={pair.v1}", f"--store={store}",
                 f"http://{self.store_proxy.host}/{pair.casync_index.name}", str(run_dir / "out.img")]]

    def output(self, variant: str, pair: Pair, run_dir: Path, log_text: str) -> Path:
        if variant == FULL:
            found = [p for p in (run_dir / "bundle" / "rootfs" / "disk").iterdir() if p.is_file()]
            if len(found) != 1:
                raise SystemExit(f"{pair.repo}:v2 unpacked by umoci: expected one file in /disk, found {found}")
            return found[0]
        if variant == OURS:
            return Path(pull_json(log_text)["path"])
        return run_dir / "out.img"

    def run_once(self, variant: str, pair: Pair) -> Sample:
        run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=self.workdir))
        cache = self.cache_path(pair)
        try:
            if variant == OURS:
                shutil.rmtree(cache, ignore_errors=True)
                bb.run_quiet(["cp", "-a", "--reflink=auto", str(cache.with_name(cache.name + ".seed")), str(cache)])
            proxy = self.store_proxy if variant == CASYNC else self.registry_proxy
            breg.prepare(self.mode, self.warm_files(pair))
            before = sum(proxy.sent.values())
            wall, cpu, rss = breg.measure(self.commands(variant, pair, run_dir), run_dir / "out.log")
            fetched = sum(proxy.sent.values()) - before
            log_text = (run_dir / "out.log").read_text(errors="replace")
            reported = reported_counts(pull_json(log_text)) if variant == OURS else None
            if (pair.case, variant) not in self.checked:
                got = self.output(variant, pair, run_dir, log_text)
                if file_digest(got) != pair.v2_sha256:
                    raise SystemExit(f"{variant} of {pair.repo}:v2 gave {got}, which is not v2's disk {pair.v2} byte for byte")
                self.checked.add((pair.case, variant))
            return Sample(wall, cpu, rss, fetched, reported)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)


def pull_json(log_text: str) -> dict:
    """The object `launcher pull --json` printed (stdout and stderr share the log: find its first line)."""
    start = log_text.find("{\n")
    while start >= 0:
        if start == 0 or log_text[start - 1] == "\n":
            try:
                return json.JSONDecoder().raw_decode(log_text[start:])[0]
            except ValueError:
                pass
        start = log_text.find("{\n", start + 1)
    raise SystemExit(f"launcher pull --json printed no JSON object:\n{log_text[-2000:]}")


def reported_counts(obj: dict) -> dict | None:
    """The byte counts the pull reports about itself (fetched, reused...), wherever it nests them."""
    found = {}

    def walk(value, prefix: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{prefix}{k}.")
        elif isinstance(value, int) and not isinstance(value, bool) and any(w in prefix.lower() for w in ("fetch", "reuse")):
            found[prefix.rstrip(".")] = value

    walk(obj, "")
    return found or None


def bench(b: Bench, pairs: dict[str, Pair], runs: int, log) -> dict[tuple[str, str], Result]:
    results = {(c, v): Result(v, b.mode, [], case=c) for c in pairs for v in VARIANTS}
    for i in range(1, runs + 1):
        for case, pair in pairs.items():
            for variant in VARIANTS:
                s = b.run_once(variant, pair)
                results[(case, variant)].samples.append(s)
                log(f"  run {i}/{runs} {case:14} {variant:9} {s.fetched / MIB:9.2f} MiB {s.wall_s:7.2f} s  {max(s.rss_kib.values()) / 1024:6.1f} MiB RSS")
    return results


# --------------------------------------------------------------------------- report


def checks(pairs: dict[str, Pair], results: dict[tuple[str, str], Result]) -> list[dict]:
    out = []
    for case, pair in pairs.items():
        ours = results[(case, OURS)]
        ratio = ours.median("fetched") / pair.ideal_bytes
        out.append({"name": "ours fetched / ideal", "case": case, "value": round(ratio, 2), "unit": "x",
                    "target": f"<= {TARGET_IDEAL_RATIO:g}x", "pass": ratio <= TARGET_IDEAL_RATIO})
        if case == REBUILT:
            fetched = ours.median("fetched") / MIB
            out.append({"name": "ours fetched", "case": case, "value": round(fetched, 2), "unit": "MiB",
                        "target": f"<= {TARGET_REBUILT_MIB}", "pass": fetched <= TARGET_REBUILT_MIB})
            value = ours.median("wall_s") / results[(case, CASYNC)].median("wall_s")
            out.append({"name": "ours/casync wall", "case": case, "value": round(value, 2), "unit": "x", "target": "< 1x", "pass": value < 1})
        if case in ALIGNED:
            theirs = results[(case, CASYNC)]
            for attr, name in (("fetched", "ours/casync bytes"), ("wall_s", "ours/casync wall")):
                value = ours.median(attr) / theirs.median(attr)
                out.append({"name": name, "case": case, "value": round(value, 2), "unit": "x", "target": "< 1x", "pass": value < 1})
    return out


def print_report(pairs: dict[str, Pair], results: dict[tuple[str, str], Result], found: list[dict]) -> None:
    for case, pair in pairs.items():
        print(f"\n{CASE_TITLES[case]}: {pair.format} v2 {pair.v2_bytes / MIB:.0f} MiB, {pair.changes}; "
              f"{pair.new_chunks} of {pair.chunks} chunks ({pair.chunk_size >> 10} KiB on average) new; "
              f"ideal = their gzip members {pair.new_members_bytes / MIB:.2f} MiB + TOC {pair.toc_bytes / 1024:.0f} KiB "
              f"= {pair.ideal_bytes / MIB:.2f} MiB (image {pair.image_bytes / MIB:.1f} MiB, casync store {pair.casync_bytes / MIB:.1f} MiB)")
        print(f"  {'variant':40} {'MiB':>8} {'x ideal':>8} {'wall s':>7} {'best':>6} {'cpu s':>7} {'best':>6}  peak RSS MiB per process")
        for variant in VARIANTS:
            r = results[(case, variant)]
            fetched = r.median("fetched")
            rss = ", ".join(f"{name} {mib:.1f}" for name, mib in r.peak_rss_mib().items())
            label = f"{variant} ({VARIANT_TOOLS[variant]})"
            print(f"  {label:40} {fetched / MIB:8.2f} {fetched / pair.ideal_bytes:8.2f} {r.median('wall_s'):7.2f} {r.best('wall_s'):6.2f} "
                  f"{r.median('cpu_s'):7.2f} {r.best('cpu_s'):6.2f}  {rss}")
            said = r.samples[-1].reported
            if said:
                print(f"  {'':40} launcher says: " + ", ".join(f"{k} {v / MIB:.2f} MiB" for k, v in said.items()))
        for c in found:
            if c["case"] == case:
                print(f"    {c['name']:24} {c['value']:>8} {c['unit']:2} target {c['target']:8} {'PASS' if c['pass'] else 'MISS'}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=DEFAULT_SIZE_MB, help="MiB of /usr content in the v1 disk (default %(default)s)")
    parser.add_argument("--runs", type=int, default=bb.DEFAULT_RUNS, help="runs per case and variant, interleaved (default %(default)s)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)} (default: all)")
    parser.add_argument("--cache", choices=breg.CACHE_MODES, default="warm", help="condition before every run, as bench/registry.py's (default %(default)s)")
    parser.add_argument("--debian", action="store_true", help="the rebuilt pair's guest is a Debian 12 root filesystem made with mmdebstrap (root; cached in the workdir), not the /usr disk")
    parser.add_argument("--workdir", type=Path, default=bb.DEFAULT_WORKDIR, help="cache for the test disk, scratch (default build/bench)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    if not cases or any(c not in CASES for c in cases):
        parser.error(f"--cases takes a comma-separated list of {', '.join(CASES)}")
    workdir = bb.checked_workdir(parser, args, ("umoci", "skopeo", "docker-registry", "mke2fs", "qemu-img", "qemu-io", "casync", "cp",
                                                *(("mmdebstrap", "unshare") if args.debian else ())))
    command = shlex.join(["bench/delta.py", *argv])
    log = bb.log
    tree = bb.use_this_tree()
    disk_meta = bb.make_disk(workdir, args.size_mb, log)
    guest_raw = make_debian_disk(workdir, log) if args.debian and REBUILT in cases else None
    scratch = Path(tempfile.mkdtemp(prefix="delta-", dir=workdir))
    registry = files = b = None
    try:
        log("making the v1 -> v2 pairs ...")
        pairs = make_pairs(Path(disk_meta["path"]), scratch, cases, log, guest_raw)
        registry = breg.Registry(scratch)
        (scratch / "casync").mkdir()
        files = FileServer(scratch / "casync", scratch)
        for pair in pairs.values():
            log(f"  {pair.case}: diskkit build v1 and v2, casync make v2, launcher pull v1 ...")
            push_pair(registry, pair)
            measure_ideal(registry, pair)
            casync_make(pair, scratch / "casync")
            pair.v2_sha256 = file_digest(pair.v2)
            pair.v1_bytes, pair.v2_bytes = pair.v1.stat().st_size, pair.v2.stat().st_size
        b = Bench(scratch, registry, files, args.cache, log)
        for pair in pairs.values():
            b.seed_cache(pair)
        load_before = bb.load_average()
        log("timing ...")
        results = bench(b, pairs, args.runs, log)
    finally:
        if b is not None:
            b.close()
        for server in (files, registry):
            if server is not None:
                server.stop()
        shutil.rmtree(scratch, ignore_errors=True)

    found = checks(pairs, results)
    context = {"command": command, "tree": tree, "cpus": os.cpu_count(), "load_average_before": load_before, "debian": guest_raw is not None,
               "load_average_after": bb.load_average(), "condition": breg.describe_mode(args.cache), "runs": args.runs}
    if args.json:
        print(json.dumps({**context, "disk": disk_meta, "pairs": [p.to_json() for p in pairs.values()],
                          "results": [r.to_json(pairs[r.case].ideal_bytes) for r in results.values()], "checks": found}, indent=2))
        return 0
    print(f"$ {command}")
    print(bb.machine_line(load_before))
    print(f"v1: {disk_meta['content_bytes'] / MIB:.0f} MiB of /usr in ext4{'; the rebuilt pair: a Debian 12 guest' if guest_raw else ''}; "
          f"{args.runs} run(s) each, interleaved; {breg.describe_mode(args.cache)}")
    print("MiB: response bodies through the counting proxy (median); wall and cpu: median and best")
    print_report(pairs, results, found)
    return 0


if __name__ == "__main__":
    sys.exit(main())

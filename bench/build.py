"""Benchmark `diskkit build` against umoci on a real-content qcow2 disk.

What it measures, on one qcow2 made from real files (an ext4 image filled from /usr with
`mke2fs -d`, then `qemu-img convert -O qcow2`, no compression):

  diskkit gzip   `diskkit build disk.qcow2 -t oci:DIR:bench` (default gzip)
  umoci gzip     `umoci init` + `umoci new` + `umoci insert disk.qcow2 /disk/disk.qcow2` (gzip too)
  diskkit zstd   `diskkit build --compression zstd` (for information)
  diskkit 4x     `diskkit build` on a disk with 4x the content (flat-memory check; --no-large skips it)

Each variant runs as whole processes, --runs times, interleaved (A B C A B C ...). Reported:
median wall time, median CPU time (user+sys), median peak RSS (ru_maxrss from os.wait4, which
covers the process and the children it reaped, e.g. qemu-img; taken through a tiny helper
so this script's own memory does not leak into the figure) and the compressed output size.
Targets: umoci/diskkit wall time >= 2x, diskkit peak RSS < 150 MiB, 4x-disk RSS about the same as
the normal one. PASS/MISS is printed for each, but the exit status is 0 whatever the figures.

Generated disks are cached in the workdir (default build/bench) so reruns skip the slow part;
output layouts are deleted after every run. The diskkit measured is this checkout's (`python -m
diskkit` with it first on PYTHONPATH, byte-compiled once; use_this_tree, which every bench shares),
and the tree and the machine's load average are printed with the figures.

Run from the project root:
    .venv/bin/python bench/build.py                      # 700 MB of content, 3 runs, with the 4x disk
    .venv/bin/python bench/build.py --size-mb 200 --runs 5 --no-large --json
"""

from __future__ import annotations

import argparse
import compileall
import functools
import json
import math
import os
import shutil
import stat
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

MIB = 1 << 20
USR = Path("/usr")
# Filled in this order, so a disk holds a mix like a root filesystem's: binaries, then data, then
# libraries. /usr/local is left out: it varies too much between machines.
USR_PARTS = ("bin", "sbin", "libexec", "share", "lib", "include")
CACHE_VERSION = 2  # bump when the way disks are made changes, so cached ones are remade
DEFAULT_SIZE_MB = 700
DEFAULT_RUNS = 3
LARGE_FACTOR = 4
FILL_SLACK = 0.01  # stop filling when within 1% of the target
COPY_BATCH = 500
IMAGE_TAG = "bench"
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WORKDIR = ROOT / "build" / "bench"

TARGET_SPEEDUP = 2.0
TARGET_RSS_MIB = 150
RSS_FLAT_TOLERANCE = 1.2  # 4x-disk RSS within 20% of the normal one counts as "about the same"

# Runs argv[2:] and writes its wall time, CPU time and ru_maxrss (KiB) as JSON to argv[1].
MEASURE_HELPER = """
import json, os, sys, time
start = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        os.execvp(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
_, status, ru = os.wait4(pid, 0)
wall = time.perf_counter() - start
with open(sys.argv[1], "w") as f:
    json.dump({"status": os.waitstatus_to_exitcode(status), "wall": wall,
               "cpu": ru.ru_utime + ru.ru_stime, "maxrss": ru.ru_maxrss}, f)
"""


# --------------------------------------------------------------------------- test data


@dataclass
class Node:
    """A file or directory under /usr with what it takes on disk (hard links counted once)."""

    path: Path
    size: int
    inodes: int
    children: list["Node"] = field(default_factory=list)


def measure(path: Path, seen: set[tuple[int, int]]) -> Node:
    st = path.lstat()
    own = 0 if (st.st_dev, st.st_ino) in seen else st.st_blocks * 512
    seen.add((st.st_dev, st.st_ino))
    node = Node(path, own, 1)
    if stat.S_ISDIR(st.st_mode):
        try:
            names = sorted(os.listdir(path))
        except OSError:
            names = []
        for name in names:
            child = measure(path / name, seen)
            node.children.append(child)
            node.size += child.size
            node.inodes += child.inodes
    return node


def fill(node: Node, budget: int, picks: list[Node]) -> int:
    """In name order, take whole subtrees that fit and descend into those that do not.

    Name order (not biggest first) keeps the natural mix of small and large files. Returns the bytes taken.
    """
    if node.size <= budget:
        picks.append(node)
        return node.size
    taken = 0
    for child in node.children:
        if budget - taken <= 0:
            break
        taken += fill(child, budget - taken, picks)
    return taken


def pick_usr_content(target: int) -> list[list[Node]]:
    """Rounds of /usr paths adding up to `target` bytes; more than one round when /usr is too small."""
    seen: set[tuple[int, int]] = set()
    roots = [measure(USR / part, seen) for part in USR_PARTS if (USR / part).is_dir()]
    if sum(r.size for r in roots) == 0:
        raise SystemExit(f"nothing to copy under {USR}")
    rounds, remaining = [], target
    while remaining > target * FILL_SLACK:
        picks: list[Node] = []
        for root in roots:
            remaining -= fill(root, remaining, picks)
        if not picks:
            break
        rounds.append(picks)
    return rounds


def run_quiet(cmd: list[str], cwd: Path | None = None) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} ... failed ({proc.returncode}):\n{proc.stderr.strip()}")


def stage_content(rounds: list[list[Node]], stage: Path) -> None:
    """Copy each round under stage/rN/usr-relative-path (real copies: repeated rounds take real space)."""
    for index, picks in enumerate(rounds):
        dest = stage / f"r{index}"
        dest.mkdir(parents=True)
        paths = [str(p.path.relative_to(USR)) for p in picks]
        for start in range(0, len(paths), COPY_BATCH):
            run_quiet(["cp", "-a", "--reflink=auto", "--parents", "-t", str(dest), *paths[start : start + COPY_BATCH]], cwd=USR)


def make_disk(workdir: Path, content_mb: int, log) -> dict:
    """A cached qcow2 holding `content_mb` MiB of /usr files in ext4; returns its description."""
    name = f"usr-{content_mb}mb"
    disk, meta_path = workdir / f"{name}.qcow2", workdir / f"{name}.json"
    if disk.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("version") == CACHE_VERSION and meta.get("qcow2_bytes") == disk.stat().st_size:
            return meta
    log(f"making {disk.name}: picking {content_mb} MiB of files from {USR} ...")
    rounds = pick_usr_content(content_mb * MIB)
    content = sum(p.size for picks in rounds for p in picks)
    inodes = sum(p.inodes for picks in rounds for p in picks)
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=workdir))
    try:
        stage = scratch / "root"
        stage_content(rounds, stage)
        image_mb = math.ceil(content * 1.15 / MIB) + 64
        raw = scratch / "disk.ext4"
        log(f"  mke2fs -d ({content / MIB:.0f} MiB in {inodes} inodes, {len(rounds)} round(s)) into {image_mb} MiB ext4 ...")
        run_quiet(["mke2fs", "-q", "-t", "ext4", "-F", "-m", "0", "-N", str(int(inodes * 1.1) + 1024),
                   "-d", str(stage), str(raw), f"{image_mb}M"])
        shutil.rmtree(stage)
        log("  qemu-img convert -O qcow2 ...")
        tmp = scratch / "disk.qcow2"
        run_quiet(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(tmp)])
        os.replace(tmp, disk)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    meta = {
        "version": CACHE_VERSION,
        "path": str(disk),
        "content_mb": content_mb,
        "content_bytes": content,
        "files": inodes,
        "rounds": len(rounds),
        "picks": sum(len(picks) for picks in rounds),
        "first_picks": [str(p.path) for p in rounds[0][:20]],
        "ext4_mb": image_mb,
        "qcow2_bytes": disk.stat().st_size,
    }
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def warm_cache(path: Path) -> None:
    """Flush pending writeback (e.g. a disk just made), then read the disk once so no timed run
    pays for the first read from storage."""
    os.sync()
    with open(path, "rb") as f:
        while f.read(8 * MIB):
            pass


# --------------------------------------------------------------------------- timing


@dataclass
class Sample:
    wall_s: float
    cpu_s: float
    rss_kib: int
    output_bytes: int


@functools.cache
def use_this_tree() -> str:
    """Make every tool command run this checkout's code, and describe it (git describe).

    The venv's console scripts import whichever checkout is installed in editable mode, so tools run
    as `python -m NAME` with this tree first on PYTHONPATH (children inherit it). The modules are
    byte-compiled once, as an installed package's are; PYTHONDONTWRITEBYTECODE would otherwise make
    every run compile them again.
    """
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    for package in ("diskkit", "launcher"):
        compileall.compile_dir(ROOT / package, quiet=1)
    rev = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True, check=False)
    return rev.stdout.strip() or "unknown"


def tool_command(name: str) -> list[str]:
    """`python -m name` (diskkit or launcher) running this checkout's code."""
    use_this_tree()
    return [sys.executable, "-m", name]


def diskkit_command() -> list[str]:
    return tool_command("diskkit")


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def machine_line(load_before: str) -> str:
    """What a figure was measured on: the tree, the CPUs and how busy they were (machines are shared)."""
    return f"tree {use_this_tree()}; {os.cpu_count()} CPUs, load average {load_before} before, {load_average()} after"


def commands(variant: str, disk: Path, layout: Path) -> list[list[str]]:
    dest = f"oci:{layout}:{IMAGE_TAG}"
    if variant == "umoci gzip":
        image = f"{layout}:{IMAGE_TAG}"
        return [
            ["umoci", "init", "--layout", str(layout)],
            ["umoci", "new", "--image", image],
            ["umoci", "insert", "--image", image, str(disk), "/disk/disk.qcow2"],
        ]
    extra = ["--compression", "zstd"] if variant == "diskkit zstd" else []
    return [[*diskkit_command(), "build", str(disk), "-t", dest, *extra]]


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def run_measured(cmd: list[str], log_path: Path) -> tuple[float, float, int]:
    """Wall s, CPU s and peak RSS KiB of `cmd`, measured by a small helper process.

    ru_maxrss is inherited through exec (Linux keeps the highest RSS the process ever had, and a
    vfork()ed child shares its parent's memory), so a child spawned straight from this process would
    report at least this process's own peak. The helper is a fresh `python -I -S` (about 7 MiB).
    """
    result = log_path.with_suffix(".json")
    with open(log_path, "w+b") as log:
        proc = subprocess.run([sys.executable, "-I", "-S", "-c", MEASURE_HELPER, str(result), *cmd],
                              stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        figures = json.loads(result.read_text()) if result.is_file() else {"status": proc.returncode}
        if proc.returncode != 0 or figures["status"] != 0:
            log.seek(0)
            raise SystemExit(f"{' '.join(cmd)} failed ({figures['status']}):\n{log.read().decode(errors='replace')}")
    return figures["wall"], figures["cpu"], figures["maxrss"]


def run_once(variant: str, disk: Path, workdir: Path) -> Sample:
    """Runs the variant's processes in turn into a fresh layout; wall and CPU summed, RSS the max."""
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=workdir))
    layout = run_dir / "layout"
    wall = cpu = 0.0
    rss = 0
    try:
        for cmd in commands(variant, disk, layout):
            w, c, r = run_measured(cmd, run_dir / "out.log")
            wall, cpu, rss = wall + w, cpu + c, max(rss, r)
        return Sample(wall, cpu, rss, tree_bytes(layout))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@dataclass
class Result:
    variant: str
    disk: str
    samples: list[Sample]

    @property
    def wall_s(self) -> float:
        return statistics.median(s.wall_s for s in self.samples)

    @property
    def cpu_s(self) -> float:
        return statistics.median(s.cpu_s for s in self.samples)

    @property
    def rss_mib(self) -> float:
        return statistics.median(s.rss_kib for s in self.samples) / 1024

    @property
    def output_mib(self) -> float:
        return statistics.median(s.output_bytes for s in self.samples) / MIB

    def to_json(self) -> dict:
        return {
            "variant": self.variant,
            "disk": self.disk,
            "median": {"wall_s": round(self.wall_s, 3), "cpu_s": round(self.cpu_s, 3),
                       "rss_mib": round(self.rss_mib, 1), "output_mib": round(self.output_mib, 1)},
            "samples": [asdict(s) for s in self.samples],
        }


def bench(variants: list[str], disk: Path, runs: int, workdir: Path, log) -> dict[str, Result]:
    results = {v: Result(v, disk.name, []) for v in variants}
    for i in range(runs):
        for variant in variants:
            sample = run_once(variant, disk, workdir)
            log(f"  run {i + 1}/{runs} {variant:13} {sample.wall_s:7.2f} s  {sample.rss_kib / 1024:7.1f} MiB")
            results[variant].samples.append(sample)
    return results


# --------------------------------------------------------------------------- report


def checks(results: dict[str, Result]) -> list[dict]:
    dk, um = results["diskkit gzip"], results["umoci gzip"]
    out = [
        {"name": "umoci/diskkit time", "value": round(um.wall_s / dk.wall_s, 2), "unit": "x",
         "target": f">= {TARGET_SPEEDUP:g}x", "pass": um.wall_s / dk.wall_s >= TARGET_SPEEDUP},
        {"name": "diskkit peak RSS", "value": round(dk.rss_mib, 1), "unit": "MiB",
         "target": f"< {TARGET_RSS_MIB} MiB", "pass": dk.rss_mib < TARGET_RSS_MIB},
    ]
    large = results.get("diskkit gzip 4x")
    if large:
        ratio = large.rss_mib / dk.rss_mib
        out.append({"name": "RSS 4x disk / normal", "value": round(ratio, 2), "unit": "x",
                    "target": f"~1x (<= {RSS_FLAT_TOLERANCE:g}x)", "pass": ratio <= RSS_FLAT_TOLERANCE})
    return out


def print_table(disks: list[dict], results: dict[str, Result], found: list[dict], runs: int, load_before: str) -> None:
    print(machine_line(load_before))
    for d in disks:
        print(f"{Path(d['path']).name}: {d['qcow2_bytes'] / MIB:.0f} MiB qcow2, "
              f"{d['content_bytes'] / MIB:.0f} MiB in {d['files']} files+dirs from {USR}")
    print(f"\nmedian of {runs} run(s); RSS = ru_maxrss, the largest single process (diskkit or a qemu-img it ran; umoci: any of its 3 steps)\n")
    print(f"{'variant':16} {'disk':18} {'wall s':>8} {'cpu s':>8} {'RSS MiB':>8} {'out MiB':>8}  runs")
    for r in results.values():
        print(f"{r.variant:16} {r.disk:18} {r.wall_s:8.2f} {r.cpu_s:8.2f} {r.rss_mib:8.1f} {r.output_mib:8.1f}  {len(r.samples)}")
    print()
    for c in found:
        print(f"{c['name']:22} {c['value']:>8} {c['unit']:4} target {c['target']:18} {'PASS' if c['pass'] else 'MISS'}")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def checked_workdir(parser: argparse.ArgumentParser, args, tools: tuple[str, ...]) -> Path:
    """What every bench script checks first: positive counts, the tools on PATH; the workdir made."""
    if args.size_mb < 1 or args.runs < 1:
        parser.error("--size-mb and --runs must be positive")
    for tool in tools:
        if not shutil.which(tool):
            parser.error(f"{tool} not found on PATH")
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=DEFAULT_SIZE_MB, help="MiB of /usr content in the test disk (default %(default)s)")
    parser.add_argument("--workdir", type=Path, default=DEFAULT_WORKDIR, help="cache for the test disks and scratch for outputs (default build/bench)")
    parser.add_argument("--runs", type=int, default=DEFAULT_RUNS, help="runs per variant, interleaved (default %(default)s)")
    parser.add_argument("--no-large", action="store_true", help=f"skip the {LARGE_FACTOR}x disk (flat-memory check)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    args = parser.parse_args(argv)
    workdir = checked_workdir(parser, args, ("umoci", "mke2fs", "qemu-img"))
    disks = [make_disk(workdir, args.size_mb, log)]
    if not args.no_large:
        disks.append(make_disk(workdir, args.size_mb * LARGE_FACTOR, log))

    disk = Path(disks[0]["path"])
    warm_cache(disk)
    load_before = load_average()
    log(f"timing on {disk.name} ...")
    results = bench(["diskkit gzip", "umoci gzip", "diskkit zstd"], disk, args.runs, workdir, log)
    if not args.no_large:
        large = Path(disks[1]["path"])
        warm_cache(large)
        log(f"timing on {large.name} ...")
        big = bench(["diskkit gzip"], large, args.runs, workdir, log)["diskkit gzip"]
        big.variant = "diskkit gzip 4x"
        results[big.variant] = big

    found = checks(results)
    if args.json:
        print(json.dumps({"tree": use_this_tree(), "cpus": os.cpu_count(), "load_average_before": load_before,
                          "load_average_after": load_average(), "runs": args.runs, "disks": disks, "results": [r.to_json() for r in results.values()],
                          "checks": found}, indent=2))
    else:
        print_table(disks, results, found, args.runs, load_before)
    return 0


if __name__ == "__main__":
    sys.exit(main())

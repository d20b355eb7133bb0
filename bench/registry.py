"""Benchmark diskkit against umoci + skopeo when pushing to and pulling from a real registry.

Uses the same real-content qcow2 as bench/build.py (an ext4 image filled from /usr, made once and
cached in the workdir) and a CNCF distribution registry (`docker-registry serve`) that this script
starts on a free 127.0.0.1 port: plain HTTP, filesystem storage in a temporary directory under the
workdir, delete enabled. The registry is stopped and its storage deleted at the end.

  build+push  diskkit   `diskkit build disk.qcow2 -t 127.0.0.1:PORT/bench/ours-N:v1 --tls-verify=false`
              skopeo    `umoci init` + `umoci new` + `umoci insert` into a layout, then
                        `skopeo copy --dest-tls-verify=false oci:LAYOUT:bench docker://127.0.0.1:PORT/bench/skopeo-N:v1`
                        (timed as the sum of the four processes)
  pull        diskkit   `diskkit push --tls-verify=false docker://127.0.0.1:PORT/bench/pull:v1 oci:DIR:x`
              skopeo    `skopeo copy --src-tls-verify=false docker://127.0.0.1:PORT/bench/pull:v1 oci:DIR:x`
                        (the same image for both, pushed once beforehand by diskkit)

Every push goes to a fresh repository (N = run number) and, once measured, its manifest and layer
links are deleted from the registry, so no run can skip or cross-repository-mount a blob an earlier
run sent (skopeo remembers blob locations in its blob-info cache and would otherwise mount). Pulls
go to a fresh directory, deleted after the run, as are the umoci layouts.

Each variant runs as whole processes, --runs times, interleaved (ours, theirs, ours, theirs, ...),
under each --cache condition, prepared before every run:

  warm   `sync`, then the blobs the run reads (the pull image's in the registry's storage, or the
         source disk) read once, so they come from the page cache
  sync   `sync`, then as root `echo 3 > /proc/sys/vm/drop_caches` (everything comes from the
         device, the tools' own files too); not as root the caches stay and the output says so

Reported per condition: median and best wall time and CPU time (user+sys), the peak RSS of each
process (ru_maxrss of the process and the children it reaped, measured by bench/build.py's helper;
the largest over the runs), the command line, and the ratios with PASS/MISS against the issue's
targets: skopeo/diskkit build+push time >= 3x, skopeo/diskkit pull time >= 1.5x, every diskkit
process < 150 MiB peak RSS. The exit status is 0 unless a command fails.

The diskkit measured is the one in this tree (PYTHONPATH), its modules byte-compiled first as an
installed package's are; the machine's load average is printed too, for runs on shared machines.

Run from the project root:
    .venv/bin/python bench/registry.py                  # 700 MB of content, 3 runs, warm and sync
    .venv/bin/python bench/registry.py --what pull --cache warm --runs 7
    .venv/bin/python bench/registry.py --size-mb 200 --runs 5 --json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

import sibling

bb = sibling.load("build")
MIB = bb.MIB

TARGET_PUSH_SPEEDUP = 3.0
TARGET_PULL_SPEEDUP = 1.5
TARGET_RSS_MIB = 150
READY_TIMEOUT = 15.0
PULL_REPO = "bench/pull"
TAG = "v1"
MANIFEST_ACCEPT = ", ".join([
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
])

OURS_PUSH, THEIRS_PUSH = "diskkit build+push", "umoci+skopeo push"
OURS_PULL, THEIRS_PULL = "diskkit pull", "skopeo pull"
VARIANTS = {"push": [OURS_PUSH, THEIRS_PUSH], "pull": [OURS_PULL, THEIRS_PULL]}
CACHE_MODES = ("warm", "sync")
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


# --------------------------------------------------------------------------- registry


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """In the child: SIGTERM when this script dies, so a crashed run leaves no registry behind."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Registry:
    """A `docker-registry serve` on 127.0.0.1:free port, storage in a temp dir under `workdir`."""

    def __init__(self, workdir: Path, access_log: bool = False):
        self.dir = Path(tempfile.mkdtemp(prefix="registry-", dir=workdir))
        self.host = f"127.0.0.1:{free_port()}"
        self.log_path = self.dir / "registry.log"
        config = {
            "version": "0.1",
            "log": {"level": "error", "accesslog": {"disabled": not access_log}},
            "storage": {
                "filesystem": {"rootdirectory": str(self.dir / "storage")},
                "delete": {"enabled": True},
                "maintenance": {"uploadpurging": {"enabled": False}},
            },
            "http": {"addr": self.host, "secret": "diskkit-bench"},
        }
        config_path = self.dir / "config.yml"
        config_path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(["docker-registry", "serve", str(config_path)], stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"docker-registry exited with {self.proc.returncode}:\n{self.log_path.read_text(errors='replace')}")
            try:
                with urllib.request.urlopen(f"http://{self.host}/v2/", timeout=1) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError) as e:
                last = repr(e)
            time.sleep(0.05)
        raise SystemExit(f"docker-registry on {self.host} not ready after {READY_TIMEOUT:g}s ({last})")

    def _request(self, method: str, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
        req = urllib.request.Request(f"http://{self.host}{path}", method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def manifest(self, repo: str, ref: str) -> tuple[str, dict]:
        status, headers, body = self._request("GET", f"/v2/{repo}/manifests/{ref}", {"Accept": MANIFEST_ACCEPT})
        if status != 200:
            raise SystemExit(f"GET {repo}:{ref} from the registry: HTTP {status} {body[:200]!r}")
        return headers["Docker-Content-Digest"], json.loads(body)

    def pushed_bytes(self, repo: str, ref: str) -> int:
        _, manifest = self.manifest(repo, ref)
        return manifest["config"]["size"] + sum(layer["size"] for layer in manifest.get("layers") or [])

    def forget(self, repo: str, ref: str) -> None:
        """Delete the manifest and the repository's blob links (the data stays until the storage goes)."""
        digest, manifest = self.manifest(repo, ref)
        for desc in [manifest["config"], *(manifest.get("layers") or [])]:
            status, _, body = self._request("DELETE", f"/v2/{repo}/blobs/{desc['digest']}")
            if status != 202:
                raise SystemExit(f"DELETE blob {desc['digest']} in {repo}: HTTP {status} {body[:200]!r}")
        status, _, body = self._request("DELETE", f"/v2/{repo}/manifests/{digest}")
        if status != 202:
            raise SystemExit(f"DELETE manifest {digest} in {repo}: HTTP {status} {body[:200]!r}")

    def blob_files(self, repo: str, ref: str) -> list[Path]:
        """Where the registry's filesystem driver keeps the image's config and layers."""
        _, manifest = self.manifest(repo, ref)
        hexes = [desc["digest"].removeprefix("sha256:") for desc in [manifest["config"], *(manifest.get("layers") or [])]]
        return [self.dir / "storage/docker/registry/v2/blobs/sha256" / h[:2] / h / "data" for h in hexes]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# --------------------------------------------------------------------------- conditions


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access(DROP_CACHES, os.W_OK)


def describe_mode(mode: str) -> str:
    if mode == "warm":
        return "warm: sync, then the blobs the run reads (registry storage or source disk) read into the page cache, before every run"
    if can_drop_caches():
        return "sync: sync; echo 3 > /proc/sys/vm/drop_caches (as root: cold caches), before every run"
    return "sync: sync before every run; NOT root, so the page cache was NOT dropped (warm reads)"


def prepare(mode: str, warm_files: list[Path]) -> None:
    """The state every timed run starts from: no writeback pending, then caches warm or dropped."""
    os.sync()
    if mode == "sync":
        if can_drop_caches():
            DROP_CACHES.write_text("3\n")
        return
    for path in warm_files:
        with open(path, "rb") as f:
            while f.read(8 * MIB):
                pass


# --------------------------------------------------------------------------- timing


def commands(variant: str, disk: Path, host: str, run: int, run_dir: Path) -> tuple[list[list[str]], str | None]:
    """The processes of one run, and the repository it pushes to (None for pulls)."""
    dk = bb.diskkit_command()
    if variant == OURS_PUSH:
        repo = f"bench/ours-{run}"
        return [[*dk, "build", str(disk), "-t", f"{host}/{repo}:{TAG}", "--tls-verify=false"]], repo
    if variant == THEIRS_PUSH:
        repo = f"bench/skopeo-{run}"
        layout = run_dir / "layout"
        image = f"{layout}:{bb.IMAGE_TAG}"
        return [
            ["umoci", "init", "--layout", str(layout)],
            ["umoci", "new", "--image", image],
            ["umoci", "insert", "--image", image, str(disk), "/disk/disk.qcow2"],
            ["skopeo", "copy", "--dest-tls-verify=false", f"oci:{image}", f"docker://{host}/{repo}:{TAG}"],
        ], repo
    src, dest = f"docker://{host}/{PULL_REPO}:{TAG}", f"oci:{run_dir / 'pulled'}:x"
    if variant == OURS_PULL:
        return [[*dk, "push", "--tls-verify=false", src, dest]], None
    return [["skopeo", "copy", "--src-tls-verify=false", src, dest]], None


def process_name(cmd: list[str]) -> str:
    """`diskkit build`, `umoci insert`, `skopeo copy`: the program and its subcommand."""
    program = Path(cmd[0]).name
    if program.startswith("python") and cmd[1:2] == ["-m"]:
        program, cmd = cmd[2], cmd[2:]
    elif program.startswith("python") and cmd[1:2] and cmd[1].endswith(".py"):
        return Path(cmd[1]).name  # a bench script
    return f"{program} {cmd[1]}" if len(cmd) > 1 else program


@dataclass
class Sample:
    wall_s: float
    cpu_s: float
    rss_kib: dict[str, int]  # peak RSS of each of the run's processes
    bytes: int  # pushed: config + layers in the registry; pulled: the output layout


def measure(cmds: list[list[str]], log_path: Path) -> tuple[float, float, dict[str, int]]:
    """Wall and CPU seconds summed over the processes, which run one after the other; RSS each."""
    wall = cpu = 0.0
    rss: dict[str, int] = {}
    for cmd in cmds:
        w, c, r = bb.run_measured(cmd, log_path)
        wall, cpu = wall + w, cpu + c
        name = process_name(cmd)
        rss[name] = max(rss.get(name, 0), r)
    return wall, cpu, rss


def run_once(variant: str, mode: str, disk: Path, registry: Registry, run: int, workdir: Path, warm: dict[str, list[Path]]) -> Sample:
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=workdir))
    try:
        cmds, repo = commands(variant, disk, registry.host, run, run_dir)
        prepare(mode, warm["push" if repo else "pull"])
        # A build record of an earlier run would let diskkit mount the layer from that run's
        # repository instead of sending it: every run starts with none (what a CI runner has).
        os.environ["XDG_CACHE_HOME"] = str(run_dir / "xdg-cache")
        wall, cpu, rss = measure(cmds, run_dir / "out.log")
        if repo:
            size = registry.pushed_bytes(repo, TAG)
            registry.forget(repo, TAG)
        else:
            size = bb.tree_bytes(run_dir / "pulled")
        return Sample(wall, cpu, rss, size)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


@dataclass
class Result:
    variant: str
    mode: str
    samples: list[Sample]

    def median(self, attr: str) -> float:
        return statistics.median(getattr(s, attr) for s in self.samples)

    def best(self, attr: str) -> float:
        return min(getattr(s, attr) for s in self.samples)

    @property
    def wall_s(self) -> float:
        return self.median("wall_s")

    def peak_rss_mib(self) -> dict[str, float]:
        """Each process's largest peak RSS over the runs."""
        out: dict[str, float] = {}
        for s in self.samples:
            for name, kib in s.rss_kib.items():
                out[name] = max(out.get(name, 0.0), kib / 1024)
        return out

    def to_json(self) -> dict:
        size = self.median("bytes") / MIB
        return {
            "variant": self.variant,
            "cache": self.mode,
            "median": {"wall_s": round(self.wall_s, 3), "cpu_s": round(self.median("cpu_s"), 3),
                       "mib": round(size, 1), "mib_per_s": round(size / self.wall_s, 1)},
            "best": {"wall_s": round(self.best("wall_s"), 3), "cpu_s": round(self.best("cpu_s"), 3)},
            "peak_rss_mib": {k: round(v, 1) for k, v in self.peak_rss_mib().items()},
            "samples": [asdict(s) for s in self.samples],
        }


def bench(disk: Path, registry: Registry, runs: int, workdir: Path, variants: list[str], modes: list[str], warm: dict[str, list[Path]], log) -> dict[tuple[str, str], Result]:
    """Every run goes through the conditions and, in each, through the variants in turn (ours, theirs)."""
    results = {(m, v): Result(v, m, []) for m in modes for v in variants}
    for i in range(1, runs + 1):
        for mode in modes:
            for variant in variants:
                s = run_once(variant, mode, disk, registry, i, workdir, warm)
                log(f"  run {i}/{runs} {mode:4} {variant:19} {s.wall_s:7.2f} s  {max(s.rss_kib.values()) / 1024:7.1f} MiB")
                results[(mode, variant)].samples.append(s)
    return results


# --------------------------------------------------------------------------- report


def ratio_check(name: str, theirs: Result, ours: Result, target: float) -> dict:
    value = theirs.wall_s / ours.wall_s
    best = theirs.best("wall_s") / ours.best("wall_s")
    return {"name": name, "cache": ours.mode, "value": round(value, 2), "best": round(best, 2), "unit": "x",
            "target": f">= {target:g}x", "pass": value >= target}


def rss_check(result: Result, limit: float = TARGET_RSS_MIB) -> dict:
    name, rss = max(result.peak_rss_mib().items(), key=lambda kv: kv[1])
    return {"name": f"{name} peak RSS", "cache": result.mode, "value": round(rss, 1), "unit": "MiB",
            "target": f"< {limit:g} MiB", "pass": rss < limit}


def checks(results: dict[tuple[str, str], Result], modes: list[str], variants: list[str]) -> list[dict]:
    out = []
    for mode in modes:
        if OURS_PUSH in variants:
            out.append(ratio_check("build+push skopeo/ours", results[(mode, THEIRS_PUSH)], results[(mode, OURS_PUSH)], TARGET_PUSH_SPEEDUP))
        if OURS_PULL in variants:
            out.append(ratio_check("pull skopeo/ours", results[(mode, THEIRS_PULL)], results[(mode, OURS_PULL)], TARGET_PULL_SPEEDUP))
        for variant in (OURS_PUSH, OURS_PULL):
            if variant in variants:
                out.append(rss_check(results[(mode, variant)]))
    return out


def print_check(c: dict) -> None:
    best = f" (best {c['best']}x)" if "best" in c else ""
    verdict = "-" if c["pass"] is None else "PASS" if c["pass"] else "MISS"  # None: a figure for the record, no target
    print(f"  {c['name']:36} {c['value']:>8} {c['unit']:4} target {c['target']:10} {verdict}{best}")


def print_results(results: dict[tuple[str, str], Result], modes: list[str], found: list[dict]) -> None:
    """One table per cache condition, its checks under it."""
    for mode in modes:
        print(f"\n{describe_mode(mode)}")
        print(f"  {'variant':20} {'wall s':>7} {'best':>6} {'cpu s':>7} {'best':>6} {'MiB':>7} {'MiB/s':>7}  peak RSS MiB per process")
        for (m, _), r in results.items():
            if m != mode:
                continue
            size = r.median("bytes") / MIB
            rss = ", ".join(f"{name} {mib:.1f}" for name, mib in r.peak_rss_mib().items())
            sized = f"{size:7.1f} {size / r.wall_s:7.1f}" if size else f"{'-':>7} {'-':>7}"
            print(f"  {r.variant:20} {r.wall_s:7.2f} {r.best('wall_s'):6.2f} {r.median('cpu_s'):7.2f} {r.best('cpu_s'):6.2f} {sized}  {rss}")
        print()
        for c in found:
            if c["cache"] == mode:
                print_check(c)


def push_pull_image(registry: Registry, disk: Path) -> None:
    """The image every pull variant reads, pushed once by diskkit."""
    bb.log(f"registry on {registry.host}; pushing the pull image {PULL_REPO}:{TAG} with diskkit ...")
    # Its build record goes with the registry's storage, not into the user's own cache (every timed
    # run gets a fresh one of its own: run_once).
    os.environ["XDG_CACHE_HOME"] = str(registry.dir / "xdg-cache")
    bb.run_quiet([*bb.diskkit_command(), "build", str(disk), "-t", f"{registry.host}/{PULL_REPO}:{TAG}", "--tls-verify=false"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=bb.DEFAULT_SIZE_MB, help="MiB of /usr content in the test disk (default %(default)s)")
    parser.add_argument("--runs", type=int, default=bb.DEFAULT_RUNS, help="runs per variant and condition, interleaved (default %(default)s)")
    parser.add_argument("--what", choices=("all", "push", "pull"), default="all", help="which comparisons to run (default %(default)s)")
    parser.add_argument("--cache", choices=("both", *CACHE_MODES), default="both", help="conditions before every run (default %(default)s; see above)")
    parser.add_argument("--workdir", type=Path, default=bb.DEFAULT_WORKDIR, help="cache for the test disk, scratch for outputs and registry storage (default build/bench)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    args = parser.parse_args(argv)
    workdir = bb.checked_workdir(parser, args, ("umoci", "skopeo", "docker-registry", "mke2fs", "qemu-img"))
    command = shlex.join(["bench/registry.py", *argv])
    modes = list(CACHE_MODES) if args.cache == "both" else [args.cache]
    variants = VARIANTS["push"] + VARIANTS["pull"] if args.what == "all" else VARIANTS[args.what]
    log = bb.log
    tree = bb.use_this_tree()
    disk_meta = bb.make_disk(workdir, args.size_mb, log)
    disk = Path(disk_meta["path"])
    bb.warm_cache(disk)
    load_before = bb.load_average()

    registry = Registry(workdir)
    try:
        push_pull_image(registry, disk)
        warm = {"push": [disk], "pull": registry.blob_files(PULL_REPO, TAG)}
        log(f"timing on {disk.name} ...")
        results = bench(disk, registry, args.runs, workdir, variants, modes, warm, log)
    finally:
        registry.stop()

    found = checks(results, modes, variants)
    context = {"command": command, "tree": tree, "cpus": os.cpu_count(), "load_average_before": load_before,
               "load_average_after": bb.load_average(), "caches_dropped": "sync" in modes and can_drop_caches()}
    if args.json:
        print(json.dumps({**context, "runs": args.runs, "disk": disk_meta, "registry": "distribution " + registry.host,
                          "conditions": {m: describe_mode(m) for m in modes},
                          "results": [r.to_json() for r in results.values()], "checks": found}, indent=2))
        return 0
    print(f"$ {command}")
    print(bb.machine_line(load_before))
    print(f"{disk.name}: {disk_meta['qcow2_bytes'] / MIB:.0f} MiB qcow2, {disk_meta['content_bytes'] / MIB:.0f} MiB in "
          f"{disk_meta['files']} files+dirs; registry {registry.host} (distribution, plain HTTP); {args.runs} run(s) each, interleaved")
    print("wall and cpu: median and best; MiB = pushed blobs / pulled layout")
    print_results(results, modes, found)
    return 0


if __name__ == "__main__":
    sys.exit(main())

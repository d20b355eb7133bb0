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

Each variant runs as whole processes, --runs times, interleaved (ours, theirs, ours, theirs, ...);
writeback is flushed (sync) before each run. Reported: median wall time, CPU time (user+sys) and
peak RSS (ru_maxrss of each process and the children it reaped, measured by bench/build.py's helper).
Targets: skopeo/diskkit build+push time >= 3x, skopeo/diskkit pull time >= 1x, every diskkit
process < 150 MiB peak RSS. PASS/MISS is printed; the exit status is 0 unless a command fails.

Run from the project root:
    .venv/bin/python bench/registry.py                  # 700 MB of content, 3 runs
    .venv/bin/python bench/registry.py --size-mb 200 --runs 5 --json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
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
TARGET_PULL_SPEEDUP = 1.0
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
VARIANTS = [OURS_PUSH, THEIRS_PUSH, OURS_PULL, THEIRS_PULL]


# --------------------------------------------------------------------------- registry


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
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
                                     stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
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


@dataclass
class Sample:
    wall_s: float
    cpu_s: float
    rss_kib: int  # the largest of the run's processes
    bytes: int  # pushed: config + layers in the registry; pulled: the output layout


def run_once(variant: str, disk: Path, registry: Registry, run: int, workdir: Path) -> Sample:
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=workdir))
    try:
        cmds, repo = commands(variant, disk, registry.host, run, run_dir)
        os.sync()  # no run pays for the previous one's writeback
        wall = cpu = 0.0
        rss = 0
        for cmd in cmds:
            w, c, r = bb.run_measured(cmd, run_dir / "out.log")
            wall, cpu, rss = wall + w, cpu + c, max(rss, r)
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
    samples: list[Sample]

    def median(self, attr: str) -> float:
        return statistics.median(getattr(s, attr) for s in self.samples)

    @property
    def wall_s(self) -> float:
        return self.median("wall_s")

    @property
    def rss_mib(self) -> float:
        return self.median("rss_kib") / 1024

    def to_json(self) -> dict:
        return {
            "variant": self.variant,
            "median": {"wall_s": round(self.wall_s, 3), "cpu_s": round(self.median("cpu_s"), 3),
                       "rss_mib": round(self.rss_mib, 1), "mib": round(self.median("bytes") / MIB, 1),
                       "mib_per_s": round(self.median("bytes") / MIB / self.wall_s, 1)},
            "samples": [asdict(s) for s in self.samples],
        }


def bench(disk: Path, registry: Registry, runs: int, workdir: Path, log) -> dict[str, Result]:
    results = {v: Result(v, []) for v in VARIANTS}
    for i in range(1, runs + 1):
        for variant in VARIANTS:
            s = run_once(variant, disk, registry, i, workdir)
            log(f"  run {i}/{runs} {variant:19} {s.wall_s:7.2f} s  {s.rss_kib / 1024:7.1f} MiB")
            results[variant].samples.append(s)
    return results


# --------------------------------------------------------------------------- report


def checks(results: dict[str, Result]) -> list[dict]:
    push = results[THEIRS_PUSH].wall_s / results[OURS_PUSH].wall_s
    pull = results[THEIRS_PULL].wall_s / results[OURS_PULL].wall_s
    out = [
        {"name": "build+push skopeo/ours", "value": round(push, 2), "unit": "x",
         "target": f">= {TARGET_PUSH_SPEEDUP:g}x", "pass": push >= TARGET_PUSH_SPEEDUP},
        {"name": "pull skopeo/ours", "value": round(pull, 2), "unit": "x",
         "target": f">= {TARGET_PULL_SPEEDUP:g}x", "pass": pull >= TARGET_PULL_SPEEDUP},
    ]
    for variant in (OURS_PUSH, OURS_PULL):
        rss = results[variant].rss_mib
        out.append({"name": f"{variant} RSS", "value": round(rss, 1), "unit": "MiB",
                    "target": f"< {TARGET_RSS_MIB} MiB", "pass": rss < TARGET_RSS_MIB})
    return out


def print_table(disk: dict, host: str, results: dict[str, Result], found: list[dict], runs: int) -> None:
    print(f"{Path(disk['path']).name}: {disk['qcow2_bytes'] / MIB:.0f} MiB qcow2, "
          f"{disk['content_bytes'] / MIB:.0f} MiB in {disk['files']} files+dirs; registry {host} (distribution, plain HTTP)")
    print(f"\nmedian of {runs} run(s); RSS = ru_maxrss of the largest process; MiB = pushed blobs / pulled layout\n")
    print(f"{'variant':20} {'wall s':>8} {'cpu s':>8} {'RSS MiB':>8} {'MiB':>8} {'MiB/s':>8}  runs")
    for r in results.values():
        size = r.median("bytes") / MIB
        print(f"{r.variant:20} {r.wall_s:8.2f} {r.median('cpu_s'):8.2f} {r.rss_mib:8.1f} {size:8.1f} {size / r.wall_s:8.1f}  {len(r.samples)}")
    print()
    for c in found:
        print(f"{c['name']:26} {c['value']:>8} {c['unit']:4} target {c['target']:10} {'PASS' if c['pass'] else 'MISS'}")


def push_pull_image(registry: Registry, disk: Path) -> None:
    """The image every pull variant reads, pushed once by diskkit."""
    bb.log(f"registry on {registry.host}; pushing the pull image {PULL_REPO}:{TAG} with diskkit ...")
    bb.run_quiet([*bb.diskkit_command(), "build", str(disk), "-t", f"{registry.host}/{PULL_REPO}:{TAG}", "--tls-verify=false"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=bb.DEFAULT_SIZE_MB, help="MiB of /usr content in the test disk (default %(default)s)")
    parser.add_argument("--runs", type=int, default=bb.DEFAULT_RUNS, help="runs per variant, interleaved (default %(default)s)")
    parser.add_argument("--workdir", type=Path, default=bb.DEFAULT_WORKDIR, help="cache for the test disk, scratch for outputs and registry storage (default build/bench)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    args = parser.parse_args(argv)
    workdir = bb.checked_workdir(parser, args, ("umoci", "skopeo", "docker-registry", "mke2fs", "qemu-img"))
    log = bb.log
    disk_meta = bb.make_disk(workdir, args.size_mb, log)
    disk = Path(disk_meta["path"])
    bb.warm_cache(disk)

    registry = Registry(workdir)
    try:
        push_pull_image(registry, disk)
        log(f"timing on {disk.name} ...")
        results = bench(disk, registry, args.runs, workdir, log)
    finally:
        registry.stop()

    found = checks(results)
    if args.json:
        print(json.dumps({"runs": args.runs, "disk": disk_meta, "registry": "distribution " + registry.host,
                          "results": [r.to_json() for r in results.values()], "checks": found}, indent=2))
    else:
        print_table(disk_meta, registry.host, results, found, args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())

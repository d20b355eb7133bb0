"""Benchmark the launcher's node side: pull+extract against skopeo+umoci, and 20 VMs from one image.

Uses bench/build.py's real-content qcow2 (an ext4 image filled from /usr, made once and cached in
the workdir) and a CNCF distribution registry started by bench/registry.py's helper on a free
127.0.0.1 port.

  pull+extract  launcher  `launcher pull --cache-dir FRESH --tls-verify=false HOST/bench/pull:v1`
                          (download, verify, decompress, write the disk sparse, qemu-img checks)
                skopeo    `skopeo copy docker://HOST/bench/pull:v1 oci:DIR:x` + `umoci unpack`
                          (timed as the sum of both processes; what a node without us would run)
  20 VMs        the test guest image is pushed, then 20 VMIs referencing it are started one after
                another with `launcher run --wait-for 'DISKKIT-TESTGUEST DONE'` as the unprivileged
                qemu user (libvirt session, TCG); a disk serial `hold-N` keeps every guest up until
                all 20 run. Reported: how often the registry served the layer (its access log), the
                bytes the cache's bases and the 20 overlays occupy, against 20 private copies.

Runs are whole processes, interleaved (ours, theirs, ...), under bench/registry.py's --cache
conditions (warm: sync, the pull image's blobs read into the page cache; sync: sync and, as root,
drop_caches), each applied before every run. Printed: the command line, median and best wall and
CPU time, each process's peak RSS, the ratio with PASS/MISS. Targets: skopeo+umoci / launcher >= 6x,
every launcher process < 150 MiB; one download for 20 VMs. The launcher measured is this tree's.

A third variant, `floor` (bench/pullfloor.py), does only the work no verified, durable pull can
skip (blob digest, member pins, inflate on every core, the content's sha256, direct write, fsync),
reading the blob from the registry's storage instead of the network: skopeo+umoci / floor is the
most any such pull could show on this machine, and launcher / floor what our pull spends beyond.
A fourth, `floor, no disk` (--discard), leaves the disk unwritten: the checks' and inflate's part.
A fifth, `floor over HTTP` (--http), does the floor's work on the blob as the registry serves it
(one GET, http.client): the least any pull over the network can do here, the registry's CPU on the
same cores included; launcher / floor over HTTP is what our pull spends beyond a download's floor.

Run from the project root, as root (it creates the qemu user's scratch directories):
    .venv/bin/python bench/launch.py                       # 700 MB of content, 3 runs, 20 VMs
    .venv/bin/python bench/launch.py --vms 0 --cache warm --runs 5
    .venv/bin/python bench/launch.py --vms 5 --runs 1 --json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pwd
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sibling

breg = sibling.load("registry")
bb = breg.bb
MIB = bb.MIB
TARGET_PULL_SPEEDUP = 6.0  # issue 26 item 5
ROOT = Path(__file__).resolve().parent.parent
GUEST = ROOT / "build" / "testguest" / "testguest-poweroff.qcow2"


def launcher_command() -> list[str]:
    return bb.tool_command("launcher")


def pull_commands(variant: str, host: str, run_dir: Path, floor: tuple[Path, Path]) -> list[list[str]]:
    ref = f"{host}/{breg.PULL_REPO}:{breg.TAG}"
    if variant == OURS:
        return [[*launcher_command(), "pull", "--cache-dir", str(run_dir / "cache"), "--tls-verify=false", ref]]
    if variant in (FLOOR, COMPUTE, HTTP_FLOOR):
        options = {COMPUTE: ["--discard"], HTTP_FLOOR: ["--http", f"http://{host}/v2/{breg.PULL_REPO}/blobs/{layer_digest(floor[1])}"]}.get(variant, [])
        return [[sys.executable, str(ROOT / "bench" / "pullfloor.py"), *options, *map(str, floor), str(run_dir)]]
    layout = run_dir / "layout"
    return [
        ["skopeo", "copy", "--src-tls-verify=false", f"docker://{ref}", f"oci:{layout}:x"],
        ["umoci", "unpack", "--rootless", "--image", f"{layout}:x", str(run_dir / "bundle")],
    ]


OURS, THEIRS, FLOOR, COMPUTE, HTTP_FLOOR = "launcher", "skopeo+umoci", "floor", "floor, no disk", "floor over HTTP"
VARIANTS = (OURS, THEIRS, FLOOR, HTTP_FLOOR, COMPUTE)


def layer_digest(manifest: Path) -> str:
    return json.loads(manifest.read_text())["layers"][-1]["digest"]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(8 * MIB):
            digest.update(piece)
    return digest.hexdigest()


def output_disk(variant: str, run_dir: Path) -> str:
    """The sha256 of the disk a run left behind, read after its timing: every variant must give the pushed disk."""
    if variant == OURS:
        return sha256_file(next((run_dir / "cache" / "disks").rglob("disk.img")))
    if variant == THEIRS:
        return sha256_file(next((run_dir / "bundle" / "rootfs" / "disk").iterdir()))
    return json.loads((run_dir / "out.log").read_text().strip().splitlines()[-1])["content"]


def bench_pull(host: str, runs: int, workdir: Path, modes: list[str], warm: list[Path], floor: tuple[Path, Path], expected: str, log) -> dict:
    results = {(m, v): breg.Result(v, m, []) for m in modes for v in VARIANTS}
    for i in range(1, runs + 1):
        for mode in modes:
            for variant in VARIANTS:
                run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=workdir))
                try:
                    cmds = pull_commands(variant, host, run_dir, floor)
                    breg.prepare(mode, warm)
                    wall, cpu, rss = breg.measure(cmds, run_dir / "out.log")
                    if variant != COMPUTE and (got := output_disk(variant, run_dir)) != expected:
                        raise SystemExit(f"{variant} left a disk hashing to {got}, not the pushed disk's {expected}")
                    results[(mode, variant)].samples.append(breg.Sample(wall, cpu, rss, 0))
                    log(f"  run {i}/{runs} {mode:4} {variant:14} {wall:7.2f} s  {max(rss.values()) / 1024:7.1f} MiB")
                finally:
                    shutil.rmtree(run_dir, ignore_errors=True)
    return results


def pull_checks(results: dict, modes: list[str]) -> list[dict]:
    out = []
    for mode in modes:
        out.append(breg.ratio_check("pull+extract skopeo+umoci/launcher", results[(mode, THEIRS)], results[(mode, OURS)], TARGET_PULL_SPEEDUP))
        out.append(breg.rss_check(results[(mode, OURS)]))
        for name, theirs, ours in (("skopeo+umoci/floor (the most possible)", THEIRS, FLOOR), ("launcher/floor (beyond the work)", OURS, FLOOR),
                                   ("launcher/floor over HTTP (beyond a download's)", OURS, HTTP_FLOOR),
                                   ("floor over HTTP/floor (the download)", HTTP_FLOOR, FLOOR),
                                   ("skopeo+umoci/floor with no disk", THEIRS, COMPUTE)):
            out.append({**breg.ratio_check(name, results[(mode, theirs)], results[(mode, ours)], 0), "target": "-", "pass": None})
    return out


VMI = """apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: {name}
spec:
  domain:
    resources:
      requests:
        memory: 128Mi
    devices:
      disks:
        - name: root
          serial: hold-{hold}
          disk:
            bus: virtio
  volumes:
    - name: root
      containerDisk:
        image: {image}
"""


def allocated(path: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def bench_vms(registry, count: int, workdir: Path, log) -> dict:
    qemu = pwd.getpwuid(107)
    scratch = Path(tempfile.mkdtemp(prefix="vms-", dir=workdir))
    os.chmod(scratch, 0o755)
    cache, home = scratch / "cache", scratch / "home"
    for d in (cache, home):
        d.mkdir()
        os.chown(d, qemu.pw_uid, qemu.pw_gid)
    image = f"{registry.host}/bench/guest:v1"
    bb.run_quiet([*bb.diskkit_command(), "build", str(GUEST), "-t", image, "--tls-verify=false"])
    _, manifest = registry.manifest("bench/guest", "v1")
    layer = manifest["layers"][0]["digest"]
    as_qemu = ["setpriv", "--reuid=107", "--regid=107", "--clear-groups", "env", f"HOME={home}", "XDG_RUNTIME_DIR=", "CI=true"]
    names = [f"bench-{i:02d}" for i in range(count)]
    started: list[str] = []
    t0 = time.monotonic()
    try:
        for name in names:
            vmi = scratch / f"{name}.yaml"
            vmi.write_text(VMI.format(name=name, hold=900, image=image))
            cmd = [*as_qemu, *launcher_command(), "run", "--cache-dir", str(cache), "--tls-verify=false",
                   "--wait-for", "DISKKIT-TESTGUEST DONE", "--timeout", "300", str(vmi)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"launcher run {name} failed:\n{proc.stderr}")
            started.append(name)
            log(f"  {name} up ({time.monotonic() - t0:.1f} s)")
        listing = json.loads(subprocess.run([*as_qemu, *launcher_command(), "ls", "--json", "--cache-dir", str(cache)],
                                            capture_output=True, text=True, check=True).stdout)
        running = sum(vm["state"] == "running" for vm in listing["vms"])
        bases = allocated(cache / "disks")
        overlays = allocated(cache / "run")
    finally:
        for name in started:
            subprocess.run([*as_qemu, *launcher_command(), "stop", "--cache-dir", str(cache), name], capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)
    access = registry.log_path.read_text(errors="replace")
    downloads = sum(1 for line in access.splitlines() if f"GET /v2/bench/guest/blobs/{layer}" in line and '" 200 ' in line)
    base_size = GUEST.stat().st_size
    return {
        "vms": count, "running_together": running, "layer_downloads": downloads,
        "bases_mib": round(bases / MIB, 1), "overlays_mib": round(overlays / MIB, 2),
        "private_copies_mib": round(count * base_size / MIB, 1),
        "seconds_to_start_all": round(time.monotonic() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=int, default=bb.DEFAULT_SIZE_MB, help="MiB of /usr content in the pull disk (default %(default)s)")
    parser.add_argument("--runs", type=int, default=bb.DEFAULT_RUNS, help="pull runs per variant and condition, interleaved (default %(default)s)")
    parser.add_argument("--cache", choices=("both", *breg.CACHE_MODES), default="both", help="conditions before every pull run, as bench/registry.py's (default %(default)s)")
    parser.add_argument("--vms", type=int, default=20, help="VMs started from one image (default %(default)s; 0 skips)")
    parser.add_argument("--workdir", type=Path, default=bb.DEFAULT_WORKDIR, help="cache for the test disk and scratch (default build/bench)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    args = parser.parse_args(argv)
    workdir = bb.checked_workdir(parser, args, ("umoci", "skopeo", "docker-registry", "mke2fs", "qemu-img", "setpriv"))
    if args.vms and (os.geteuid() != 0 or not GUEST.is_file()):
        parser.error("the VM part runs as root (it starts VMs as the qemu user) and needs build/testguest (scripts/setup.sh)")
    command = shlex.join(["bench/launch.py", *argv])
    modes = list(breg.CACHE_MODES) if args.cache == "both" else [args.cache]
    log = bb.log
    tree = bb.use_this_tree()
    disk_meta = bb.make_disk(workdir, args.size_mb, log)
    disk = Path(disk_meta["path"])
    bb.warm_cache(disk)
    load_before = bb.load_average()
    registry = breg.Registry(workdir, access_log=True)
    try:
        breg.push_pull_image(registry, disk)
        manifest = workdir / "pull-manifest.json"
        manifest.write_text(json.dumps(registry.manifest(breg.PULL_REPO, breg.TAG)[1]))
        blobs = registry.blob_files(breg.PULL_REPO, breg.TAG)
        log("pull+extract ...")
        pulls = bench_pull(registry.host, args.runs, workdir, modes, blobs, (blobs[-1], manifest), sha256_file(disk), log)
        vms = None
        if args.vms:
            log(f"{args.vms} VMs from one image ...")
            vms = bench_vms(registry, args.vms, workdir, log)
    finally:
        registry.stop()

    checks = pull_checks(pulls, modes)
    if vms:
        checks.append({"name": f"layer downloads for {vms['vms']} VMs", "value": vms["layer_downloads"], "unit": "", "target": "1", "pass": vms["layer_downloads"] == 1})
    context = {"command": command, "tree": tree, "cpus": os.cpu_count(), "load_average_before": load_before,
               "load_average_after": bb.load_average(), "caches_dropped": "sync" in modes and breg.can_drop_caches()}
    if args.json:
        print(json.dumps({**context, "disk": disk_meta, "runs": args.runs, "conditions": {m: breg.describe_mode(m) for m in modes},
                          "pull": [r.to_json() for r in pulls.values()], "vms": vms, "checks": checks}, indent=2))
        return 0
    print(f"$ {command}")
    print(bb.machine_line(load_before))
    print(f"{disk.name}: {disk_meta['qcow2_bytes'] / MIB:.0f} MiB qcow2; {args.runs} run(s) each, interleaved; wall and cpu: median and best")
    breg.print_results(pulls, modes, [c for c in checks if "cache" in c])
    if vms:
        print(f"\n{vms['vms']} VMs from one image ({vms['running_together']} running together, started in {vms['seconds_to_start_all']} s):")
        print(f"  layer downloads {vms['layer_downloads']}; on disk: bases {vms['bases_mib']} MiB + overlays {vms['overlays_mib']} MiB"
              f" ({vms['vms']} private copies would be {vms['private_copies_mib']} MiB)")
        for c in checks:
            if "cache" not in c:
                breg.print_check(c)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark N VMs of one image started at once on one node: pulled and lazy.

The test guest as a raw disk (its own 64 MiB), built with `diskkit build --lazy` and pushed once to a
CNCF distribution registry on a free 127.0.0.1 port with its access log on. For each N (default 1,
4, 8) and each mode, N `launcher run --console --wait-for 'DISKKIT-TESTGUEST DONE'` processes of N
VMIs referencing that one image are started together, as the unprivileged qemu user on libvirt's
session daemon (TCG unless KVM makes progress), each against the same fresh cache:

  pulled  `--no-lazy`: every run finds the image missing (IfNotPresent) and pulls it; the cache's
          lock makes one of them download and the others wait for its disk
  lazy    `--lazy`: every run asks the node's disk server for the image's export (the first starts
          the server); the guests read it over NBD while the server fills it from the registry

A disk serial `hold-900` keeps every guest up until the round ends (`launcher stop` for each).

Reported per round: seconds from the start to each VM's first console line (median and the last
one: all running) and to `DISKKIT-TESTGUEST DONE` on every console (all booted); the peak RSS of
each `launcher run` process (ru_maxrss of the process and the children it reaped, measured by
bench/build.py's helper; the largest of the N, and the sum) and its CPU time (the median), and the
disk server's (VmHWM, and its CPU time until the VMs were stopped); each qemu's CPU time then (median); from the
registry's access log, how many GETs of the layer's blob it answered and how many bytes of it
it sent, as a multiple of the blob's size (one download for all: 1 full GET when pulled, about 1.0x
when lazy); how many disk server processes and exports served the round (one of each for all). A
round whose runs fail is reported with the first failures: that is where the node stops.

Anchor: KubeVirt's CI starts 100 cirros containerDisk VMIs with a P50 of 15-20 s to Running on a
cluster; this is one node, with TCG unless KVM is usable.

Run from the project root, as root (it creates the qemu user's scratch directories):
    .venv/bin/python bench/density.py                        # N = 1, 4, 8; pulled and lazy
    .venv/bin/python bench/density.py --vms 12,16 --modes lazy
    .venv/bin/python bench/density.py --vms 2 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import sibling

blazy = sibling.load("lazy")
launch = sibling.load("launch")
breg = blazy.breg
bb = breg.bb
MIB = bb.MIB
ROOT = Path(__file__).resolve().parent.parent
GUEST = ROOT / "build" / "testguest" / "testguest-poweroff.qcow2"
MODES = ("pulled", "lazy")
REPO = "bench/density"
DONE = "DISKKIT-TESTGUEST DONE"
HOLD = 900
RUN_TIMEOUT = 1800


ACCESS_LINE = re.compile(r'"GET /v2/(?P<repo>[^ ]+)/blobs/(?P<digest>[^ ?]+)[^"]*" (?P<status>\d{3}) (?P<bytes>\d+|-)')


def layer_served(log_text: str, repo: str, digest: str) -> tuple[int, int, int]:
    """GETs of one blob the registry answered with data (200/206) in `log_text`, how many of them
    were whole downloads (200: a pull reads a lazy layer's TOC with a range first), and the bytes sent."""
    gets = whole = sent = 0
    for m in ACCESS_LINE.finditer(log_text):
        if m["repo"] == repo and m["digest"] == digest and m["status"] in ("200", "206"):
            gets += 1
            whole += m["status"] == "200"
            sent += 0 if m["bytes"] == "-" else int(m["bytes"])
    return gets, whole, sent


@dataclass
class Vm:
    """One `launcher run`: when its console said what, how it ended, its peak RSS."""

    name: str
    first_line_s: float | None = None
    done_s: float | None = None
    status: int | None = None
    rss_kib: int | None = None
    cpu_s: float | None = None
    error: str = ""
    stderr: list[str] = field(default_factory=list)


def follow(proc: subprocess.Popen, vm: Vm, started: float) -> None:
    for line in proc.stdout:
        now = time.monotonic() - started
        if vm.first_line_s is None and line.strip():
            vm.first_line_s = now
        if vm.done_s is None and DONE in line:
            vm.done_s = now


def server_pids(cache: Path) -> set[int]:
    """Disk servers of this cache alive now (the qemu user's `launcher serve --cache-dir CACHE`)."""
    pids = set()
    needle = ["serve", "--cache-dir", str(cache)]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            args = [a.decode(errors="replace") for a in argv]
            if any(args[i:i + 3] == needle for i in range(len(args))):
                pids.add(int(proc.name))
    return pids


def cpu_seconds(pid: int) -> float | None:
    """User+sys CPU time `pid` has used so far (/proc/PID/stat's utime and stime)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return None


def qemu_cpu_seconds(names: list[str]) -> list[float]:
    """CPU time each running VM's qemu has used so far (found by its `-name guest=default_NAME`: the
    VMIs have no namespace, and KubeVirt names a domain `<namespace>_<name>`)."""
    wanted = {f"guest=default_{name}".encode() for name in names}
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (proc / "cmdline").read_bytes().split(b"\0")
                if argv and b"qemu-system" in argv[0] and any(a.split(b",")[0] in wanted for a in argv):
                    if (cpu := cpu_seconds(int(proc.name))) is not None:
                        found.append(cpu)
    return found


def peak_rss_kib(pid: int) -> int | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return None


class ServerWatch(threading.Thread):
    """Every disk server process of the round, and each one's peak RSS and CPU time as last seen."""

    def __init__(self, cache: Path):
        super().__init__(daemon=True)
        self.cache, self.seen, self.cpu, self.stopping = cache, {}, {}, threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.2):
            self.sample()

    def sample(self) -> None:
        for pid in server_pids(self.cache):
            rss = peak_rss_kib(pid)
            if rss is not None:
                self.seen[pid] = max(rss, self.seen.get(pid, 0))
            if (cpu := cpu_seconds(pid)) is not None:
                self.cpu[pid] = cpu

    def stop(self) -> None:
        self.stopping.set()
        self.join()
        self.sample()


def round_once(scratch, registry, image: str, layer: tuple[str, int], count: int, mode: str, log) -> dict:
    """N runs of one image started together into a fresh cache; the figures of the round."""
    tag = f"{mode}-{count}"
    cache = scratch.fresh_cache(f"cache-{tag}")
    vms = [Vm(f"d{count}-{mode[0]}-{i:02d}") for i in range(count)]
    log_mark = registry.log_path.stat().st_size
    watch = ServerWatch(cache)
    watch.start()
    procs, threads = [], []
    for vm in vms:
        vmi = scratch.root / f"{vm.name}.yaml"
        vmi.write_text(launch.VMI.format(name=vm.name, hold=HOLD, image=image))
    os.sync()
    started = time.monotonic()
    try:
        for vm in vms:
            command = scratch.command("run", "--cache-dir", str(cache), "--tls-verify=false", "--lazy" if mode == "lazy" else "--no-lazy",
                                      "--console", "--wait-for", DONE, "--timeout", str(RUN_TIMEOUT), str(scratch.root / f"{vm.name}.yaml"))
            result = scratch.root / f"{vm.name}.rss.json"
            errors = open(scratch.root / f"{vm.name}.err", "w+")
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", bb.MEASURE_HELPER, str(result), *command],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors, text=True, errors="replace")
            procs.append((vm, proc, result, errors))
            threads.append(threading.Thread(target=follow, args=(proc, vm, started), daemon=True))
            threads[-1].start()
        for (vm, proc, result, errors), thread in zip(procs, threads):
            proc.wait()
            thread.join()
            figures = json.loads(result.read_text()) if result.is_file() else {"status": proc.returncode, "maxrss": None, "cpu": None}
            vm.status, vm.rss_kib, vm.cpu_s = figures["status"], figures["maxrss"], figures["cpu"]
            errors.seek(0)
            vm.stderr = errors.read().strip().splitlines()
            errors.close()
            if vm.status != 0 or vm.done_s is None:
                vm.error = (vm.stderr[-1:] or [f"exit status {vm.status}"])[0]
        qemu_cpu = qemu_cpu_seconds([vm.name for vm in vms])
        exports = None
        if mode == "lazy":
            status = blazy.server_status(cache)
            exports = len(status["exports"]) if status else 0
    finally:
        for vm, proc, _, _ in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for vm, proc, _, _ in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
            if proc.poll() is None:
                proc.kill()
        watch.stop()
        stop_round(scratch, cache, [vm.name for vm in vms])
    with open(registry.log_path, "rb") as f:
        f.seek(log_mark)
        gets, whole, sent = layer_served(f.read().decode(errors="replace"), REPO, layer[0])
    ok = [vm for vm in vms if not vm.error]
    firsts = [vm.first_line_s for vm in ok]
    dones = [vm.done_s for vm in ok]
    rss = [vm.rss_kib for vm in ok if vm.rss_kib]
    out = {
        "vms": count, "mode": mode, "running": len(ok),
        "first_line_median_s": round(statistics.median(firsts), 1) if firsts else None,
        "all_first_line_s": round(max(firsts), 1) if len(ok) == count else None,
        "all_done_s": round(max(dones), 1) if len(ok) == count else None,
        "launcher_rss_max_mib": round(max(rss) / 1024, 1) if rss else None,
        "launcher_rss_sum_mib": round(sum(rss) / 1024, 1) if rss else None,
        "launcher_cpu_median_s": round(statistics.median(vm.cpu_s for vm in ok), 1) if ok else None,
        "servers": len(watch.seen) if mode == "lazy" else None,
        "server_rss_mib": round(max(watch.seen.values()) / 1024, 1) if watch.seen else None,
        "qemu_cpu_median_s": round(statistics.median(qemu_cpu), 1) if qemu_cpu else None,
        "server_cpu_s": round(sum(watch.cpu.values()), 1) if watch.cpu else None,
        "exports": exports,
        "layer_gets": gets, "layer_downloads": whole, "layer_served_x": round(sent / layer[1], 2),
        "failures": [f"{vm.name}: {vm.error}" for vm in vms if vm.error][:3],
        "load_average_after": bb.load_average(),
    }
    log(f"  {count:3} {mode:6} all running {out['all_first_line_s']} s, all done {out['all_done_s']} s, {len(ok)}/{count} ok,"
        f" layer GETs {gets} ({out['layer_served_x']}x), servers {out['servers']}, exports {exports}; load {out['load_average_after']}")
    for failure in out["failures"]:
        log(f"    {failure}")
    return out


def stop_round(scratch, cache: Path, names: list[str]) -> None:
    """Every VM of the round stopped, its disk server ended, the cache gone."""
    stops = [subprocess.Popen(scratch.command("stop", "--cache-dir", str(cache), name), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for name in names]
    for proc in stops:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=300)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for pid in server_pids(cache):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while server_pids(cache) and time.monotonic() < deadline:
        time.sleep(0.1)
    shutil.rmtree(cache, ignore_errors=True)


def checks(rounds: list[dict]) -> list[dict]:
    out = []
    for r in rounds:
        name = f"N={r['vms']} {r['mode']}"
        out.append({"name": f"{name}: running", "value": r["running"], "target": str(r["vms"]), "pass": r["running"] == r["vms"]})
        if r["mode"] == "pulled":
            out.append({"name": f"{name}: layer downloads", "value": r["layer_downloads"], "target": "1",
                        "pass": r["layer_downloads"] == 1 and r["layer_served_x"] < 1.5})
        else:
            out.append({"name": f"{name}: disk servers, exports", "value": f"{r['servers']}, {r['exports']}", "target": "1, 1",
                        "pass": r["servers"] == 1 and r["exports"] == 1})
            # Ranges may overlap a little at chunk edges; a second fill would be about 2x.
            out.append({"name": f"{name}: layer bytes sent", "value": f"{r['layer_served_x']}x", "target": "< 1.5x",
                        "pass": r["layer_served_x"] < 1.5})
    return out


def print_table(rounds: list[dict], found: list[dict], command: str, load_before: str, layer_mib: float) -> None:
    print(f"$ {command}")
    print(bb.machine_line(load_before))
    print(f"test guest (raw, 64 MiB) built --lazy, layer {layer_mib:.1f} MiB; N `launcher run` processes started together as the"
          " qemu user (libvirt session); seconds from their start\n")
    head = (f"{'N':>3} {'mode':6} {'ok':>5} {'1st line':>9} {'all 1st':>8} {'all DONE':>9} {'launcher RSS/VM':>16} {'CPU/VM':>7} {'qemu CPU':>9} {'server RSS':>11} {'srv CPU':>8}"
            f" {'layer GETs':>11} {'sent':>6} {'servers':>8} {'load after':>16}")
    print(head)
    for r in rounds:
        def f(v, fmt="{:.1f}"):
            return "-" if v is None else fmt.format(v)
        servers = "-" if r["servers"] is None else f"{r['servers']}/{r['exports']}"
        print(f"{r['vms']:>3} {r['mode']:6} {r['running']:>2}/{r['vms']:<2} {f(r['first_line_median_s']):>9} {f(r['all_first_line_s']):>8}"
              f" {f(r['all_done_s']):>9} {f(r['launcher_rss_max_mib'], '{:.1f} MiB'):>16} {f(r['launcher_cpu_median_s'], '{:.1f} s'):>7} {f(r['qemu_cpu_median_s'], '{:.1f} s'):>9} {f(r['server_rss_mib'], '{:.1f} MiB'):>11} {f(r['server_cpu_s'], '{:.1f} s'):>8}"
              f" {r['layer_gets']:>11} {r['layer_served_x']:>5}x {servers:>8} {r['load_average_after']:>16}")
        for failure in r["failures"]:
            print(f"      {failure}")
    print("\n1st line: median over the VMs; all 1st / all DONE: the last VM's first console line / DISKKIT-TESTGUEST DONE;"
          " launcher RSS/VM: the largest `launcher run` peak; CPU/VM: the median `launcher run`'s user+sys (qemu's not counted); qemu CPU: the median VM's qemu at the end (after its DONE); srv CPU: the disk server's, until the VMs were stopped; servers: disk server processes/exports")
    print()
    for c in found:
        print(f"{c['name']:32} {c['value']!s:>10}  target {c['target']:7} {'PASS' if c['pass'] else 'MISS'}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vms", default="1,4,8", help="comma-separated counts of VMs started together (default %(default)s)")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of pulled and lazy (default %(default)s)")
    parser.add_argument("--workdir", type=Path, default=bb.DEFAULT_WORKDIR, help="cache for the disk and scratch (default build/bench)")
    parser.add_argument("--guest", type=Path, default=GUEST, help="the test guest's qcow2 (default build/testguest/testguest-poweroff.qcow2)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    args = parser.parse_args(argv)
    try:
        counts = [int(n) for n in args.vms.split(",")]
    except ValueError:
        parser.error("--vms takes comma-separated counts, e.g. 1,4,8")
    modes = args.modes.split(",")
    if any(n < 1 for n in counts) or not modes or any(m not in MODES for m in modes):
        parser.error("--vms counts must be positive and --modes of pulled, lazy")
    args.size_mb, args.runs = 64, 1
    workdir = bb.checked_workdir(parser, args, ("docker-registry", "qemu-img", "setpriv", "virsh"))
    if os.geteuid() != 0 or not args.guest.is_file():
        parser.error("runs as root (it starts VMs as the qemu user) and needs the test guest (scripts/setup.sh builds build/testguest)")
    blazy.GUEST = args.guest.resolve()  # the raw disk is made from it
    command = shlex.join(["bench/density.py", *argv])
    log = bb.log
    bb.use_this_tree()
    disk = blazy.padded_guest(workdir, 64 * MIB, log)  # the guest's own size: nothing padded
    load_before = bb.load_average()
    registry = breg.Registry(workdir, access_log=True)
    scratch = blazy.QemuScratch()
    rounds = []
    try:
        image = f"{registry.host}/{REPO}:v1"
        bb.run_quiet([*bb.diskkit_command(), "build", "--lazy", "--tls-verify=false", str(disk), "-t", image])
        _, manifest = registry.manifest(REPO, "v1")
        layer = (manifest["layers"][0]["digest"], manifest["layers"][0]["size"])
        # One untimed boot first, so starting libvirt's session daemon is charged to no round.
        blazy.boot_once(scratch, image, False, "warm-up")
        for count in counts:
            for mode in modes:
                rounds.append(round_once(scratch, registry, image, layer, count, mode, log))
    finally:
        scratch.close()
        registry.stop()
    found = checks(rounds)
    if args.json:
        print(json.dumps({"command": command, "tree": bb.use_this_tree(), "cpus": os.cpu_count(), "load_average_before": load_before,
                          "load_average_after": bb.load_average(), "layer_bytes": layer[1], "rounds": rounds, "checks": found}, indent=2))
    else:
        print_table(rounds, found, command, load_before, layer[1] / MIB)
    return 0


if __name__ == "__main__":
    sys.exit(main())

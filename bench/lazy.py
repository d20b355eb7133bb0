"""Benchmark booting before the image has arrived: lazy (NBD from the registry) against a full pull.

The test guest as a raw disk, once at its own 64 MiB and once padded with pseudo-random data to
4 GiB (same content, extra data at the end that every full pull must move), each built with
`diskkit build --lazy` (TOC v2, seekable gzip) and pushed to a CNCF distribution registry on a free 127.0.0.1 port.

  lazy   `launcher run --lazy --console VMI` with a fresh cache: the run starts the node's disk
         server, which exports the disk over NBD and fetches byte ranges as the guest reads them
         (with --node-server the server is already running, untimed, as a node daemon would be)
  full   `launcher run --no-lazy --console VMI` with a fresh cache: the whole layer is pulled,
         verified and extracted before the VM is defined
  local  the floor: `launcher run --no-lazy --console VMI` of the small image already pulled into
         the cache (untimed), so the guest boots from a local file: what no lazy boot can beat. The
         guest reads the same bytes of either image before its first line, so the small one stands
         for both; `full large / local` is the best full/lazy ratio this machine allows

With `--link RTT_MS,MBIT` (the node's link: `--link 20,100`) every request goes through a proxy
(tests/faultproxy.py) that waits one round trip per new connection and per request and passes the
answers of all connections at one shared rate, as a node's one link to its registry does; the
`local` row's pull goes through it too, untimed. Then `lazy / local` is the figure that counts: a
lazy boot over the link against a boot from a file in the cache (target 1.2x for the test guest).
`--no-full` leaves the full pulls out (over the link one of 4 GiB takes minutes a run).

With `--cloud-guest` the guest is the real one the suite boots (tests/cloudguest.py: Debian 12 with
systemd and cloud-init, images/cloudguest/build.sh, found in $DISKKIT_CLOUDGUEST_DIR or
/var/cache/diskkit-test/cloudguest and never built here), as its qcow2, with a NoCloud disk:
`lazy` against `local`, timed to its `login:` prompt on the console (target 1.1x over the link).

Neither boot follows a boot-read trace (`launcher test --record-trace`): the bench's node trusts no
signing key, so its disk server prefetches the disk's head and then where the guest reads.

Timed: from the `launcher run` process starting to the guest's first console line on its stdout,
run as the unprivileged qemu user through libvirt's session daemon (TCG unless KVM makes progress).
For lazy runs the share of the 4 GiB blob already fetched at that moment is reported too.
Variants are interleaved, one fresh cache per run, writeback flushed before each; medians printed.
One untimed boot comes first, so starting libvirt's session daemon is charged to no variant.
Targets (issue "Lazy images v2"): the 4 GiB image boots lazily within 1.2x of the 64 MiB one, and
at least 8x faster than a full pull of the 4 GiB image.

Run from the project root, as root (it creates the qemu user's scratch directories):
    .venv/bin/python bench/lazy.py
    .venv/bin/python bench/lazy.py --runs 1 --large-mb 1024 --json
    .venv/bin/python bench/lazy.py --link 20,100
    .venv/bin/python bench/lazy.py --link 20,100 --no-full
    .venv/bin/python bench/lazy.py --link 20,100 --cloud-guest
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import sibling

breg = sibling.load("registry")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.faultproxy import FaultProxy, Link  # noqa: E402

bb = breg.bb
MIB = bb.MIB
GUEST = ROOT / "build" / "testguest" / "testguest-poweroff.qcow2"
QEMU_UID = 107
TARGET_SIZE_RATIO = 1.2  # lazy large / lazy small
TARGET_FULL_RATIO = 8.0  # full large / lazy large
TARGET_LINK_RATIO = 1.2  # over the link: lazy large / local
TARGET_CLOUD_RATIO = 1.1  # over the link: the Debian guest, lazy / local
CLOUD_IMAGE = "cloudguest.qcow2"
LOGIN = b"login:"
FIRST_LINE_TIMEOUT = 900.0

def vmi_text(memory: str = "128Mi", cloud_config: str | None = None) -> str:
    """The VMI each run boots ({name} and {image} left to fill): the containerDisk, and for the cloud
    guest a NoCloud disk with `cloud_config`. JSON, which is YAML."""
    disks = [{"name": "root", "disk": {"bus": "virtio"}}]
    volumes = [{"name": "root", "containerDisk": {"image": "{image}"}}]
    if cloud_config is not None:
        disks.append({"name": "cloudinit", "disk": {"bus": "virtio"}})
        volumes.append({"name": "cloudinit", "cloudInitNoCloud": {"userData": cloud_config}})
    doc = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "{name}"},
           "spec": {"domain": {"resources": {"requests": {"memory": memory}}, "devices": {"disks": disks}}, "volumes": volumes}}
    return json.dumps(doc, indent=2).replace("{", "{{").replace("}", "}}").replace("{{name}}", "{name}").replace("{{image}}", "{image}")


VMI = vmi_text()
CLOUD_VMI = vmi_text("1Gi", "#cloud-config\ntimezone: UTC\n")


def cloud_guest_image() -> Path | None:
    """The suite's Debian guest where tests/cloudguest.py keeps it; None when it was never built."""
    env = os.environ.get("DISKKIT_CLOUDGUEST_DIR")
    found = (Path(env) if env else Path(os.environ.get("DISKKIT_TEST_CACHE", "/var/cache/diskkit-test")) / "cloudguest") / CLOUD_IMAGE
    return found if found.is_file() else None


def padded_guest(workdir: Path, size: int, log, guest: Path = GUEST) -> Path:
    """The test guest as raw, padded to `size` with seeded pseudo-random bytes; made once, cached."""
    out = workdir / f"lazy-guest-{size // MIB}m.img"
    if out.is_file() and out.stat().st_size == size:
        return out
    log(f"making {out.name} ...")
    tmp = out.with_name(out.name + ".tmp")
    bb.run_quiet(["qemu-img", "convert", "-f", "qcow2", "-O", "raw", str(guest), str(tmp)])
    if tmp.stat().st_size > size:
        raise SystemExit(f"the test guest is larger than {size} bytes")
    rng = random.Random(size)
    with open(tmp, "ab") as f:
        while (left := size - f.tell()) > 0:
            f.write(rng.randbytes(min(left, 8 << 20)))
    tmp.replace(out)
    return out


class QemuScratch:
    """The qemu user's HOME (one libvirt session daemon for the bench) and a fresh cache per run."""

    def __init__(self):
        # Under /tmp: libvirt's and the disk server's unix socket paths must stay under 108 bytes.
        self.root = Path(tempfile.mkdtemp(prefix="dkl-"))
        os.chmod(self.root, 0o755)
        self.home = self.root / "home"
        self._mkdir(self.home)

    def _mkdir(self, path: Path) -> Path:
        path.mkdir()
        os.chown(path, QEMU_UID, QEMU_UID)
        return path

    def fresh_cache(self, name: str) -> Path:
        return self._mkdir(self.root / name)

    def command(self, *args: str) -> list[str]:
        # PYTHONPATH: this checkout's code, whichever one the venv was installed from.
        return ["setpriv", f"--reuid={QEMU_UID}", f"--regid={QEMU_UID}", "--clear-groups", "env", f"HOME={self.home}",
                "XDG_RUNTIME_DIR=", "CI=true", f"PYTHONPATH={ROOT}", sys.executable, "-m", "launcher", *args]

    def close(self) -> None:
        for pidfile in self.root.glob("**/.cache/libvirt/*.pid"):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pidfile.read_text().strip()), signal.SIGTERM)
        shutil.rmtree(self.root, ignore_errors=True)


def server_status(cache: Path) -> dict | None:
    from diskkit.errors import DiskkitError
    from launcher.diskserver.control import request

    with contextlib.suppress(OSError, ValueError, DiskkitError):
        return request(cache / "serve" / "control.sock", {"op": "status"}, timeout=10)
    return None


def start_server(scratch: QemuScratch, cache: Path) -> None:
    """The node's disk server for `cache`, up before the clock starts; `boot_once` stops it after."""
    subprocess.Popen(scratch.command("serve", "--cache-dir", str(cache), "--tls-verify=false", "--exit-when-idle", "600"),
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 30
    while server_status(cache) is None:
        if time.monotonic() > deadline:
            raise SystemExit("launcher serve did not answer within 30 s")
        time.sleep(0.05)


def console_until(proc: subprocess.Popen, marker: bytes | None) -> float | None:
    """When (monotonic) the console shows `marker` (None: its first line that is not empty); None
    if the run ends first. Read as bytes as they come: a login prompt ends no line."""
    seen = b""
    fd = proc.stdout.fileno()
    while True:
        piece = os.read(fd, 65536)
        if not piece:
            return None
        seen += piece
        if marker is None:
            if any(line.strip() for line in seen.split(b"\n")[:-1]):
                return time.monotonic()
        elif marker in seen:
            return time.monotonic()
        seen = seen[-4096:]


def boot_once(scratch: QemuScratch, image: str, lazy: bool, run_id: str, node_server: bool = False, pulled: bool = False,
              vmi_text: str = VMI, marker: bytes | None = None) -> dict:
    """Seconds from `launcher run` to the first console line (or `marker` on the console); then the
    VM and any server are stopped. With `pulled` the image is pulled into the cache first, before the clock starts."""
    cache = scratch.fresh_cache(f"cache-{run_id}")
    if pulled:
        subprocess.run(scratch.command("pull", "--cache-dir", str(cache), "--tls-verify=false", image), check=True, capture_output=True)
    if lazy and node_server:
        start_server(scratch, cache)
    vmi = scratch.root / f"{run_id}.yaml"
    # A short VM name: libvirt's monitor socket lies under the scratch directory and a unix socket's path holds 107 bytes.
    vmi.write_text(vmi_text.format(name="".join(part[:2] if n == 0 else part[:1] for n, part in enumerate(run_id.split("-"))), image=image))
    command = scratch.command("run", "--cache-dir", str(cache), "--tls-verify=false", "--lazy" if lazy else "--no-lazy",
                              "--console", "--timeout", str(int(FIRST_LINE_TIMEOUT)), str(vmi))
    os.sync()
    started = time.monotonic()
    # stderr to a file: a full pipe nobody reads would stop the run.
    errors = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=errors)
    fetched = None
    try:
        shown = console_until(proc, marker)
        if shown is None:
            errors.seek(0)
            raise SystemExit(f"launcher run ({run_id}) ended before the console showed {marker or 'a line'}:\n{errors.read()[-4000:]}")
        seconds = shown - started
        # The console goes on: read it to its end, or a full pipe would keep the run from stopping.
        threading.Thread(target=lambda: proc.stdout.read(), daemon=True).start()
        status = server_status(cache) if lazy else None
        if status and status["exports"]:
            export = status["exports"][0]
            fetched = export["present"] / export["chunks"]
    finally:
        proc.send_signal(signal.SIGTERM)  # destroys the domain and removes its overlay
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        status = server_status(cache)
        if status:
            with contextlib.suppress(OSError):
                os.kill(status["pid"], signal.SIGTERM)
            deadline = time.monotonic() + 30
            while (cache / "serve" / "control.sock").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        shutil.rmtree(cache, ignore_errors=True)
        errors.close()
    return {"seconds": seconds, "fetched": fetched, "started": started}


def write_timeline(path: Path, proxy: FaultProxy, sample: dict) -> None:
    """The proxy's events from the run's start to its measure (and half a second on), in seconds since the start."""
    start, end = sample["started"], sample["started"] + sample["seconds"]
    events = [{"at": round(at - start, 4), "event": kind, "request": number, "connection": connection, "method": method,
               "target": target, "range": range_}
              for (kind, number, connection, method, target, range_), at in zip(list(proxy.timeline), list(proxy.times))
              if start <= at <= end + 0.5]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"measured_s": round(sample["seconds"], 3), "events": events}, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small-mb", type=int, default=64, help="the small image's disk, MiB (default %(default)s: the guest itself)")
    parser.add_argument("--large-mb", type=int, default=4096, help="the large image's disk, MiB (default %(default)s)")
    parser.add_argument("--runs", type=int, default=3, help="runs per variant, interleaved (default %(default)s)")
    parser.add_argument("--workdir", type=Path, default=bb.DEFAULT_WORKDIR, help="cache for the disks and scratch (default build/bench)")
    parser.add_argument("--guest", type=Path, default=GUEST, help="the test guest's testguest-poweroff.qcow2 (default build/testguest's)")
    parser.add_argument("--node-server", action="store_true", help="lazy runs find the node's disk server running (started untimed)")
    parser.add_argument("--link", metavar="RTT_MS,MBIT", help="every request through a proxy modelling the node's link: "
                        "this round trip per connection and per request, this rate shared by all connections (e.g. 20,100)")
    parser.add_argument("--no-full", action="store_true", help="leave the full pulls out (lazy and local only)")
    parser.add_argument("--cloud-guest", action="store_true", help="the suite's Debian cloud guest instead of the test guest, "
                        "timed to its login prompt (lazy, local, and full unless --no-full)")
    parser.add_argument("--timeline", type=Path, metavar="DIR", help="with --link: each lazy run's requests through the proxy, "
                        "with when they arrived and were answered (seconds since `launcher run` started), as DIR/RUN.json")
    parser.add_argument("--no-warm-up", action="store_true", help="time the first boot too (the warm-up boot fills the page "
                        "cache and libvirt's: its figures are not comparable; for checking the bench runs, not for its figures)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    args = parser.parse_args(argv)
    if args.timeline is not None and not args.link:
        parser.error("--timeline needs --link (the proxy keeps the timeline)")
    link = None
    if args.link:
        try:
            rtt_ms, mbit = (float(v) for v in args.link.split(","))
        except ValueError:
            parser.error("--link takes RTT_MS,MBIT, e.g. 20,100")
        if rtt_ms < 0 or mbit <= 0:
            parser.error("--link: a round trip of 0 ms or more and a rate above 0 Mbit/s")
        link = Link(rtt=rtt_ms / 1000, rate=mbit * 1e6 / 8)
    args.size_mb = args.small_mb
    workdir = bb.checked_workdir(parser, args, ("docker-registry", "qemu-img", "setpriv", "virsh"))
    if os.geteuid() != 0 or not args.guest.is_file():
        parser.error("runs as root (it starts VMs as the qemu user) and needs build/testguest (scripts/setup.sh)")
    if args.large_mb <= args.small_mb:
        parser.error("--large-mb must be larger than --small-mb")
    cloud = cloud_guest_image() if args.cloud_guest else None
    if args.cloud_guest and cloud is None:
        parser.error("--cloud-guest needs the suite's cloud guest, built by tests/test_cloudguest.py (images/cloudguest/build.sh)")
    log = bb.log
    disks = {"small": padded_guest(workdir, args.small_mb * MIB, log, args.guest)}  # the warm-up boots it too
    if cloud is not None:
        disks["cloud"] = cloud
        variants = [("lazy", "cloud"), *([] if args.no_full else [("full", "cloud")]), ("local", "cloud")]
    else:
        disks["large"] = padded_guest(workdir, args.large_mb * MIB, log, args.guest)
        variants = [(mode, label) for mode in ("lazy", *(() if args.no_full else ("full",))) for label in ("small", "large")]
        variants.append(("local", "small"))
    measure = "its login prompt" if cloud is not None else "the first console line"
    load_before = bb.load_average()
    registry = breg.Registry(workdir)
    proxy = FaultProxy(registry.host, link=link) if link is not None else None
    scratch = QemuScratch()
    samples: dict[tuple[str, str], list[dict]] = {variant: [] for variant in variants}
    try:
        images = {}
        for label, disk in disks.items():
            log(f"pushing {disk.name} (--lazy) ...")
            images[label] = f"{registry.host}/bench/lazy-{label}:v1"
            bb.run_quiet([*bb.diskkit_command(), "build", "--lazy", "--tls-verify=false", str(disk), "-t", images[label]])
            if proxy is not None:
                images[label] = images[label].replace(registry.host, proxy.host)  # pushed directly, read over the link
        if not args.no_warm_up:
            boot_once(scratch, images["small"], False, "warm-up")
        for i in range(1, args.runs + 1):
            for (mode, label), found in samples.items():
                kind = {"vmi_text": CLOUD_VMI, "marker": LOGIN} if label == "cloud" else {}
                sample = boot_once(scratch, images[label], mode == "lazy", f"{mode}-{label}-{i}", args.node_server,
                                   pulled=mode == "local", **kind)
                found.append(sample)
                if args.timeline is not None and mode == "lazy":
                    write_timeline(args.timeline / f"{mode}-{label}-{i}.json", proxy, sample)
                share = f", {sample['fetched']:.1%} of the blob fetched" if sample["fetched"] is not None else ""
                log(f"  run {i} {mode:5} {label:5} {sample['seconds']:.2f} s{share}")
    finally:
        scratch.close()
        if proxy is not None:
            proxy.close()
        registry.stop()

    med = {key: statistics.median(s["seconds"] for s in found) for key, found in samples.items()}
    best = {key: min(s["seconds"] for s in found) for key, found in samples.items()}
    lazy_label = "cloud" if cloud is not None else "large"
    local_label = "cloud" if cloud is not None else "small"
    shares = [s["fetched"] for s in samples[("lazy", lazy_label)] if s["fetched"] is not None]
    fetched = statistics.median(shares) if shares else None
    local_ratio = med[("lazy", lazy_label)] / med[("local", local_label)]
    checks = []
    if cloud is None:
        size_ratio = med[("lazy", "large")] / med[("lazy", "small")]
        checks.append({"name": f"lazy {args.large_mb} MiB / lazy {args.small_mb} MiB", "value": round(size_ratio, 2),
                       "target": f"<= {TARGET_SIZE_RATIO:g}x", "pass": size_ratio <= TARGET_SIZE_RATIO})
    if not args.no_full:
        full_ratio = med[("full", lazy_label)] / med[("lazy", lazy_label)]
        checks.append({"name": f"full / lazy, {'the cloud guest' if cloud is not None else f'{args.large_mb} MiB'}", "value": round(full_ratio, 2),
                       "target": f">= {TARGET_FULL_RATIO:g}x" if cloud is None else "", "pass": full_ratio >= TARGET_FULL_RATIO if cloud is None else None})
    if link is not None:
        target = TARGET_CLOUD_RATIO if cloud is not None else TARGET_LINK_RATIO
        checks.append({"name": f"lazy {'cloud guest' if cloud is not None else f'{args.large_mb} MiB'} / local, over the link",
                       "value": round(local_ratio, 2), "target": f"<= {target:g}x", "pass": local_ratio <= target})
    if args.json:
        print(json.dumps({"tree": bb.use_this_tree(), "cpus": os.cpu_count(), "load_average_before": load_before,
                          "load_average_after": bb.load_average(), "runs": args.runs, "node_server": args.node_server, "link": args.link,
                          "guest": "cloud" if cloud is not None else "test", "measure": measure,
                          "sizes_mib": {label: disk.stat().st_size // MIB for label, disk in disks.items()},
                          "median_s": {f"{m}-{l}": round(v, 2) for (m, l), v in med.items()},
                          "best_s": {f"{m}-{l}": round(v, 2) for (m, l), v in best.items()},
                          "samples_s": {f"{m}-{l}": [round(s["seconds"], 2) for s in found] for (m, l), found in samples.items()},
                          "lazy_fetched_at_measure": fetched, "lazy_local_ratio": round(local_ratio, 2), "checks": checks}, indent=2))
        return 0
    print(bb.machine_line(load_before))
    server = "the node's disk server already running" if args.node_server else "the disk server started by the run"
    if link is not None:
        server += f"; every request over a modelled link ({link.rtt * 1000:g} ms round trip, {link.rate * 8 / 1e6:g} Mbit/s shared)"
    what = (f"the cloud guest ({CLOUD_IMAGE}, {disks['cloud'].stat().st_size / MIB:.0f} MiB)" if cloud is not None
            else f"test guest (raw) at {args.small_mb} MiB and {args.large_mb} MiB")
    print(f"{what}, built --lazy; seconds from `launcher run` to {measure}, median (best) of {args.runs} run(s); lazy with {server}\n")
    for (mode, label) in samples:
        print(f"{mode:6} {label:6} {med[(mode, label)]:8.2f} ({best[(mode, label)]:.2f})"
              + ("  (already pulled: the guest boots from a file in the cache)" if mode == "local" else ""))
    if fetched is not None:
        print(f"\nlazy {lazy_label}: {fetched:.1%} of the blob had arrived at {measure}")
    print()
    for c in checks:
        verdict = "" if c["pass"] is None else ("PASS" if c["pass"] else "MISS")
        print(f"{c['name']:44} {c['value']:>8}  {('target ' + c['target']) if c['target'] else '':14} {verdict}")
    if link is None:
        print(f"{'lazy / local':44} {round(local_ratio, 2):>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark the pod network's NIC: a VM with the launcher's NIC against one without (and against
qemu's own user-mode stack, which the launcher used before, for comparison).

Each run boots the test guest (build/testguest: kernel, initramfs, TCG) straight under qemu, with
  none   no NIC;
  nic    what `launcher run` gives a masquerade interface: the VM's pod switch (launcher.network,
         started by its backend as the launcher starts it, with its passt) on a unix socket, qemu's
         -netdev stream to it; the page fetched through a forward, as `launcher port-forward` opens it;
  slirp  -netdev user on 10.0.2.0/24, hostfwd 127.0.0.1:PORT -> guest 80 (the launcher's NIC before:
         it maps its gateway onto the host's 127.0.0.1, see docs/security.md).
Measured from qemu's start, from the guest's serial console: boot (DISKKIT-TESTGUEST DONE), first
packet (NET-LEASE: the DHCP exchange done), and the throughput of one 16 MiB HTTP fetch from the
guest's busybox httpd through the forward (a disk with serial net-bench makes the guest write the file,
after DONE, so the 16 MiB of urandom it costs under TCG is not counted as the NIC's share of the boot).
As root, qemu and the switch run as the qemu user (UID 107), as a root launcher runs them. Variants
interleave run by run; medians are printed, and the NIC's share of the boot:
(median boot with the NIC - median boot without) / median boot without, target < 10 %.

    .venv/bin/python bench/network.py --runs 5
    .venv/bin/python bench/network.py --runs 3 --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from launcher.network import backend, bindings, pod  # noqa: E402
from launcher.spec.network import Interface  # noqa: E402

GUEST = ROOT / "build" / "testguest"
CMDLINE = (ROOT / "images" / "testguest" / "cmdline").read_text().strip()  # testguest.qcow2's own
VARIANTS = ("none", "nic", "slirp")
TARGET_OVERHEAD = 0.10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def disk(workdir: Path, name: str) -> Path:
    path = workdir / name
    with open(path, "wb") as f:
        f.truncate(1 << 20)
    return path


def qemu_command(workdir: Path, variant: str, port: int, sock: Path) -> list[str]:
    args = [shutil.which("qemu-system-x86_64") or "qemu-system-x86_64", "-accel", "tcg", "-machine", "q35", "-m", "256",
            "-nodefaults", "-display", "none", "-monitor", "none", "-serial", "stdio", "-no-reboot",
            "-kernel", str(GUEST / "vmlinuz"), "-initrd", str(GUEST / "initrd.img"), "-append", CMDLINE]
    for i, serial in enumerate(("hold-600", "net-bench")):
        args += ["-drive", f"file={disk(workdir, f'd{i}.img')},format=raw,if=none,id=d{i}",
                 "-device", f"virtio-blk-pci,drive=d{i},serial={serial}"]
    if variant == "slirp":
        args += ["-netdev", f"user,id=n0,net=10.0.2.0/24,hostfwd=tcp:127.0.0.1:{port}-:80"]
    elif variant == "nic":
        args += ["-netdev", f"stream,id=n0,server=off,addr.type=unix,addr.path={sock}"]
    if variant != "none":
        args += ["-device", "virtio-net-pci,netdev=n0,romfile="]
    return args


QEMU_UID = 107
AS_USER = ["setpriv", f"--reuid={QEMU_UID}", f"--regid={QEMU_UID}", "--clear-groups"] if os.geteuid() == 0 else []
OWNER = (QEMU_UID, QEMU_UID) if os.geteuid() == 0 else (os.geteuid(), os.getegid())


def fetch(variant: str, port: int, entry: dict | None) -> int:
    if variant == "slirp":
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/blob", timeout=120) as reply:
            return len(reply.read())
    with backend.open_forward(entry, "tcp", 80, timeout=120) as forward:
        forward.sock.sendall(b"GET /blob HTTP/1.0\r\n\r\n")
        size = 0
        while chunk := forward.sock.recv(1 << 16):
            size += len(chunk)
        return size


def one_run(variant: str) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix=f"netbench-{variant}-"))
    workdir.chmod(0o755)
    port, sock = free_port(), workdir / "0.sock"
    qemu = None
    started = backend.Started()
    try:
        command = qemu_command(workdir, variant, port, sock)
        if AS_USER:
            for path in (workdir, *workdir.iterdir()):
                os.chown(path, QEMU_UID, QEMU_UID)
        began = time.monotonic()
        if variant == "nic":
            # as launcher.runtime.vms: the switch started, qemu started, then the switch's word awaited
            started = backend.start([bindings.plan(Interface("default", 0, "masquerade"), pod.read())], [sock], OWNER)
        qemu = subprocess.Popen([*AS_USER, *command], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        started.wait()
        seen: dict[str, float] = {}
        wanted = {"DISKKIT-TESTGUEST DONE": "boot", "NET-LEASE": "lease", "NET-HTTPD": "httpd"}
        ready = threading.Event()

        def read() -> None:
            for line in qemu.stdout:
                text = line.decode(errors="replace")
                for mark, key in wanted.items():
                    if mark in text and key not in seen:
                        seen[key] = time.monotonic() - began
                if "boot" in seen and (variant == "none" or "httpd" in seen):
                    ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(300):
            raise SystemExit(f"{variant}: the guest did not come up: {seen}")
        result = {"variant": variant, "boot_s": seen["boot"]}
        if variant != "none":
            result["lease_s"] = seen["lease"]
            start = time.monotonic()
            size = fetch(variant, port, started.entries[0] if started.entries else None)
            result["fetch_mib_s"] = size / (1 << 20) / (time.monotonic() - start)
        return result
    finally:
        if qemu is not None:
            qemu.kill()
            qemu.wait()
        backend.stop(started.entries)
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    for tool in ("qemu-system-x86_64", "passt"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is missing (scripts/setup.sh installs it)")
    if not (GUEST / "vmlinuz").exists():
        raise SystemExit(f"no test guest in {GUEST}: bash images/testguest/build.sh {GUEST}")
    results = {v: [] for v in VARIANTS}
    print(f"{os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} before", file=sys.stderr)
    for i in range(args.runs):
        for variant in VARIANTS:
            results[variant].append(one_run(variant))
            print(f"run {i + 1} {variant}: {results[variant][-1]}", file=sys.stderr)
    summary = {}
    for variant, runs in results.items():
        summary[variant] = {key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "variant"}
    overhead = (summary["nic"]["boot_s"] - summary["none"]["boot_s"]) / summary["none"]["boot_s"]
    summary["nic_overhead"] = overhead
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for variant in VARIANTS:
            print(f"{variant:6} " + "  ".join(f"{k} {v:.2f}" for k, v in summary[variant].items()))
        print(f"NIC share of the boot (nic vs none): {overhead * 100:+.1f} % "
              f"{'PASS' if overhead < TARGET_OVERHEAD else 'MISS'} (target < {TARGET_OVERHEAD * 100:.0f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

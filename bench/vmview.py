"""What one VM, one view costs at a VM's start: the libvirt side of a root `launcher run` on a host with
no system daemon, for

  shared    one session daemon of the qemu user (107) for every VM, already running: how VMs ran before
            (every qemu 107, every monitor in one HOME);
  own-cold  a session daemon of the VM's own, as the VM's own uid in a user namespace where it is 107
            (launcher.runtime.vmuser, launcher.runtime.sessiond), probing qemu's capabilities itself;
  own-warm  the same, given the capabilities an earlier daemon probed: what the launcher does.

Each run defines the test guest's domain (a qcow2 overlay over the guest's disk, which root hands qemu
open: virDomainFDAssociate), starts it and times `start` (from before the daemon's start, for the own
variants, to libvirt's create() returning) and `done` (to DISKKIT-TESTGUEST DONE on the guest's
console, TCG). Variants interleave run by run; medians are printed, and what own-warm adds to a start.

    .venv/bin/python bench/vmview.py --runs 5          (as root)
    .venv/bin/python bench/vmview.py --runs 3 --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from launcher.runtime import sessiond, vmuser  # noqa: E402
from launcher.runtime.runner import Libvirt  # noqa: E402

VARIANTS = ("shared", "own-cold", "own-warm")
QEMU_UID = 107


def guest_disk() -> Path:
    return Path(os.environ.get("DISKKIT_TESTGUEST_DIR") or ROOT / "build" / "testguest") / "testguest.qcow2"


def domain_xml(name: str, overlay: Path, base: Path, log: Path) -> str:
    return f"""<domain type='qemu'><name>{name}</name><memory unit='MiB'>128</memory><vcpu>1</vcpu>
<os><type arch='x86_64' machine='q35'>hvm</type></os>
<devices><disk type='file' device='disk'><driver name='qemu' type='qcow2'/><source file='{overlay}'/>
<backingStore type='file'><format type='qcow2'/><source file='{base}' fdgroup='base'/><backingStore/></backingStore>
<target dev='vda' bus='virtio'/></disk>
<serial type='file'><source path='{log}'/></serial><console type='file'><source path='{log}'/></console></devices></domain>"""


def vm_files(work: Path, name: str, ids: tuple[int, int], base: Path) -> tuple[Path, Path]:
    """The VM's overlay and console log, its qemu's, in a directory only it (and root) may enter."""
    run = work / name
    run.mkdir()
    os.chown(run, 0, ids[1])
    run.chmod(0o710)
    overlay = run / "disk.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "qcow2", str(overlay)], check=True)
    console = run / "console"
    console.mkdir()
    log = console / "console.log"
    log.touch()
    for path in (overlay, console, log):
        os.chown(path, *ids)
    return overlay, log


def wait_done(log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while b"DISKKIT-TESTGUEST DONE" not in log.read_bytes():
        if time.monotonic() > deadline:
            raise SystemExit(f"the guest did not finish: {log.read_bytes()[-500:]!r}")
        time.sleep(0.02)


def shared_daemon(work: Path) -> str:
    home = work / "shared-home"
    home.mkdir()
    os.chown(home, QEMU_UID, QEMU_UID)
    subprocess.run(["setpriv", f"--reuid={QEMU_UID}", f"--regid={QEMU_UID}", "--clear-groups", "--", "libvirtd", "--daemon",
                    "--timeout=600"], env={"HOME": str(home), "PATH": os.environ["PATH"]}, cwd="/", check=True)
    sock = home / ".cache" / "libvirt" / "libvirt-sock"
    while not sock.exists():
        time.sleep(0.02)
    return f"qemu+unix:///session?socket={sock}"


def one_run(variant: str, work: Path, base: Path, shared_uri: str, empty: Path, run: int) -> dict:
    name = f"bench-{variant}-{run}"
    began = time.monotonic()
    allocation = None
    if variant == "shared":
        ids, lv = (QEMU_UID, QEMU_UID), Libvirt(shared_uri)
    else:
        allocation = vmuser.allocate(name, work)
        ids = allocation.user.ids
    overlay, log = vm_files(work, name, ids, base)
    prepared = time.monotonic() - began  # the overlay: the same for every variant, not counted
    try:
        started = time.monotonic()
        if allocation is not None:
            kept = sessiond.CAPS_TEMPLATE
            sessiond.CAPS_TEMPLATE = empty if variant == "own-cold" else kept
            try:
                lv = Libvirt(sessiond.start(allocation.user))
            finally:
                sessiond.CAPS_TEMPLATE = kept
        fd = os.open(base, os.O_RDONLY)
        try:
            lv.start(name, domain_xml(name, overlay, base, log), {"base": [fd]},
                     defined=(lambda: sessiond.keep_capabilities(allocation.user)) if variant == "own-warm" else None)
        finally:
            os.close(fd)
        start_s = time.monotonic() - started
        wait_done(log)
        done_s = time.monotonic() - started
        lv.destroy(name)
        lv.close()
    finally:
        if allocation is not None:
            allocation.close()
            vmuser.release(allocation.user)
    return {"variant": variant, "start_s": start_s, "done_s": done_s, "overlay_s": prepared}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("as root: a root launcher's VMs are what is measured")
    work = Path(tempfile.mkdtemp(prefix="vmview-bench-"))
    work.chmod(0o711)
    base = work / "base.qcow2"
    shutil.copy(guest_disk(), base)
    base.chmod(0o600)  # root's alone: qemu reads it only through the open file it is handed
    empty = work / "no-caps"
    empty.mkdir()
    shared_uri = shared_daemon(work)
    results = []
    try:
        # One unmeasured run each first: the shared daemon's probe, and the warm variant's copy.
        for variant in ("shared", "own-warm"):
            one_run(variant, work, base, shared_uri, empty, -1)
        for run in range(args.runs):
            for variant in VARIANTS:
                results.append(one_run(variant, work, base, shared_uri, empty, run))
    finally:
        for daemon in ("libvirtd", "virtlogd"):  # the shared daemon this run started
            try:
                os.kill(int((work / "shared-home" / ".cache" / "libvirt" / f"{daemon}.pid").read_text()), 15)
            except (OSError, ValueError):
                pass
        shutil.rmtree(work, ignore_errors=True)
    medians = {v: {k: statistics.median(r[k] for r in results if r["variant"] == v) for k in ("start_s", "done_s")} for v in VARIANTS}
    if args.json:
        print(json.dumps({"runs": results, "medians": medians}, indent=2))
        return
    for variant in VARIANTS:
        print(f"{variant:9s} start {medians[variant]['start_s']:.2f} s   to DONE {medians[variant]['done_s']:.2f} s")
    print(f"own-warm adds {medians['own-warm']['start_s'] - medians['shared']['start_s']:+.2f} s to a start"
          f" ({medians['own-warm']['done_s'] / medians['shared']['done_s'] - 1:+.0%} to DONE); own-cold"
          f" {medians['own-cold']['start_s'] - medians['shared']['start_s']:+.2f} s")


if __name__ == "__main__":
    main()

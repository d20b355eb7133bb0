"""A `launcher run` killed with SIGKILL at each stage of a run (pull, overlay, define, boot, following
the console): `status`, `stop` and `gc` then tell the truth and leave a clean node, and the next run of
the same VMI works (issue: the node under faults and at scale, item 3).

Each stage is held or observed from outside, never through a hook in the launcher: a stalled blob
request (tests/faultproxy.py) holds the pull; a stopped (SIGSTOP) libvirt session daemon holds the
launcher between its overlays and the domain's definition; libvirt's own list and the guest's
console show the boot and the console stages."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

from tests import leftovers
from tests.faultproxy import Fault
from tests.lazyhost import wait_for
from tests.vmhost import DONE, NOREG, QemuUser, assert_clean

NAME = "killed"
DOMAIN = f"default_{NAME}"


def _daemon_pids(user: QemuUser) -> list[int]:
    """The qemu user's libvirt session daemon (monolithic or modular)."""
    def comm(pid: int) -> str:
        with contextlib.suppress(OSError):
            return Path(f"/proc/{pid}/comm").read_text().strip()
        return ""
    return [pid for pid in leftovers.processes_of(user.home) if comm(pid) in ("libvirtd", "virtqemud")]


def _domains(user: QemuUser, *flags: str) -> list[str]:
    return user.virsh("list", "--name", *flags).split()


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def _qemu_of_domain(user: QemuUser) -> list[int]:
    return [pid for pid in leftovers.processes_of(user.root)
            if f"guest={DOMAIN}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes()]


def _the_truth_then_clean(user: QemuUser, stage: str) -> None:
    """What status, stop and gc say after the kill, and the node they leave."""
    running = DOMAIN in _domains(user)
    defined = DOMAIN in _domains(user, "--all")
    status = user.launcher("status", NAME)
    if running:
        assert (status.code, status.out.strip()) == (0, "running"), (stage, status)
    elif defined:  # defined, never started: the launcher died between the two
        assert (status.code, status.out.strip()) == (1, "stopped"), (stage, status)
    else:
        assert status.code != 0, (stage, status)
    stopped = user.launcher("stop", NAME)
    assert stopped.code == 0, (stage, stopped)
    assert stopped.out.strip() == (f"VM {NAME} was stopped" if running else f"VM {NAME} is not running"), (stage, stopped)
    assert user.launcher("status", NAME).code != 0, stage
    swept = user.launcher("gc")
    assert swept.code == 0, (stage, swept)
    assert_clean(user, DOMAIN)
    assert not _qemu_of_domain(user), stage
    cache = user.cache
    assert not list((cache / "locks").glob(f"vm-{DOMAIN}*")), (stage, os.listdir(cache / "locks"))
    assert not [p for p in (cache / "partial").rglob("*") if p.is_file()], stage
    # gc removed every disk no VM uses: a half-pulled one was never installed, so none is there either.
    assert not list((cache / "disks").rglob("disk.img")), stage


def test_a_run_killed_at_each_stage_leaves_the_truth_and_a_clean_node(qemu_user, registry, fault_proxy, guest_image):
    proxy = fault_proxy(registry)
    vmi = qemu_user.write_vmi(NAME, guest_image.replace(registry.host, proxy.host), serial="hold-600")
    run_dir = qemu_user.cache / "run" / DOMAIN
    record = qemu_user.cache / "vms" / f"{DOMAIN}.json"
    qemu_user.virsh("list")  # the session daemon is up before the first stage

    def start() -> subprocess.Popen:
        return qemu_user.popen("run", NOREG, "--no-lazy", "--console", vmi)

    # pull: the layer's request waits at the proxy.
    proxy.add(Fault("GET", r"/blobs/sha256:", "stall", times=1, arg=120))
    proc = start()
    try:
        wait_for(lambda: not proxy.pending or proc.poll() is not None, 120, "the run to ask for its layer")
        assert proc.poll() is None, proc.stderr.read()
        _kill(proc)
    finally:
        proxy.clear()
        if proc.poll() is None:
            proc.kill()
    _the_truth_then_clean(qemu_user, "pull")

    # overlay: pulled, the overlays made and the VM recorded; the libvirt daemon, stopped while the
    # layer was on its way (all the launcher asks libvirt before then is asked), holds the definition.
    daemons = _daemon_pids(qemu_user)
    assert daemons, "no libvirt session daemon of the qemu user"
    proxy.add(Fault("GET", r"/blobs/sha256:", "stall", times=1, arg=2))
    proc = start()
    stopped = False
    try:
        wait_for(lambda: not proxy.pending or proc.poll() is not None, 120, "the run to ask for its layer")
        for pid in daemons:
            os.kill(pid, signal.SIGSTOP)
        stopped = True
        wait_for(lambda: proc.poll() is not None or record.exists(), 120, "the run's record")
        assert proc.poll() is None, proc.stderr.read()
        assert list((run_dir / "root").glob("*.qcow2")), list(run_dir.rglob("*"))
        # What libvirt would have been given; defined below as a daemon that finished the definition
        # after its client died would have it.
        xml = (run_dir / "domain.xml").read_text()
        _kill(proc)
    finally:
        proxy.clear()
        if stopped:
            for pid in daemons:
                os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    _the_truth_then_clean(qemu_user, "overlay")
    (qemu_user.root / "late.xml").write_text(xml)
    qemu_user.virsh("define", str(qemu_user.root / "late.xml"))

    # boot: the domain runs (libvirt lists it as running), the guest has not reached its console yet.
    # The run replaces the shut-off definition of its own VMI (its UUID) left above.
    proc = start()
    try:
        wait_for(lambda: proc.poll() is not None or DOMAIN in _domains(qemu_user), 180, "the domain to run")
        assert proc.poll() is None, proc.stderr.read()
        _kill(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    _the_truth_then_clean(qemu_user, "boot")

    # console: the guest has printed what the launcher follows.
    proc = start()
    try:
        seen = ""
        while "HOLD seconds=600" not in seen:
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
            seen += line
        _kill(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    _the_truth_then_clean(qemu_user, "console")

    # The next run of the same VMI boots and ends as ever.
    plain = qemu_user.write_vmi(NAME, guest_image)
    result = qemu_user.launcher("run", NOREG, "--no-lazy", "--console", plain)
    assert result.code == 0 and DONE in result.out, result.err
    assert_clean(qemu_user, DOMAIN)

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
from typing import Iterator

from tests import leftovers, stacks
from tests.faultproxy import Fault
from tests.lazyhost import wait_for
from tests.vmhost import DONE, NOREG, QemuUser, assert_clean

NAME = "killed"
DOMAIN = f"default_{NAME}"


def daemon_pids(user: QemuUser) -> list[int]:
    """The qemu user's libvirt session daemon (monolithic or modular)."""
    def comm(pid: int) -> str:
        with contextlib.suppress(OSError):
            return Path(f"/proc/{pid}/comm").read_text().strip()
        return ""
    return [pid for pid in leftovers.processes_of(user.home) if comm(pid) in ("libvirtd", "virtqemud")]


def domains(user: QemuUser, *flags: str) -> list[str]:
    return user.virsh("list", "--name", *flags).split()


def _qemu_of_domain(user: QemuUser) -> list[int]:
    return [pid for pid in leftovers.processes_of(user.root)
            if f"guest={DOMAIN}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes()]


def _the_truth_then_clean(user: QemuUser, stage: str) -> None:
    """What status, stop and gc say after the kill, and the node they leave."""
    running = DOMAIN in domains(user)
    defined = DOMAIN in domains(user, "--all")
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


class Stages:
    """Runs of one VMI, each held or seen at one stage and handed to the test there."""

    def __init__(self, user: QemuUser, proxy, vmi: Path, *run_args: str):
        self.user, self.proxy, self.vmi, self.run_args = user, proxy, vmi, run_args
        self.run_dir = user.cache / "run" / DOMAIN
        self.record = user.cache / "vms" / f"{DOMAIN}.json"
        user.virsh("list")  # the session daemon is up before the first stage
        self.daemons = daemon_pids(user)
        assert self.daemons, "no libvirt session daemon of the qemu user"

    def _start(self) -> subprocess.Popen:
        return self.user.popen("run", NOREG, "--no-lazy", "--console", *self.run_args, self.vmi)

    @contextlib.contextmanager
    def pull(self) -> Iterator[subprocess.Popen]:
        """The layer's request waits at the proxy."""
        self.proxy.add(Fault("GET", r"/blobs/sha256:", "stall", times=1, arg=120))
        proc = self._start()
        try:
            wait_for(lambda: not self.proxy.pending or proc.poll() is not None, 120, "the run to ask for its layer")
            assert proc.poll() is None, proc.stderr.read()
            yield proc
        finally:
            self.proxy.clear()
            reap(proc)

    @contextlib.contextmanager
    def overlay(self) -> Iterator[tuple[subprocess.Popen, str]]:
        """Pulled, the overlays made and the VM recorded; the libvirt daemon, stopped while the layer
        was on its way (all the launcher asks libvirt before that is asked), holds the definition.
        Yields the domain XML the launcher is giving libvirt; the daemon goes on when the block ends."""
        self.proxy.add(Fault("GET", r"/blobs/sha256:", "stall", times=1, arg=2))
        proc = self._start()
        stopped = False
        try:
            wait_for(lambda: not self.proxy.pending or proc.poll() is not None, 120, "the run to ask for its layer")
            for pid in self.daemons:
                os.kill(pid, signal.SIGSTOP)
            stopped = True
            wait_for(lambda: proc.poll() is not None or self.record.exists(), 120, "the run's record")
            assert proc.poll() is None, proc.stderr.read()
            assert list((self.run_dir / "root").glob("*.qcow2")), list(self.run_dir.rglob("*"))
            yield proc, (self.run_dir / "domain.xml").read_text()
        finally:
            self.proxy.clear()
            if stopped:
                for pid in self.daemons:
                    os.kill(pid, signal.SIGCONT)
            reap(proc)

    @contextlib.contextmanager
    def boot(self) -> Iterator[subprocess.Popen]:
        """The domain runs (libvirt lists it as running), the guest has not reached its console yet."""
        proc = self._start()
        try:
            wait_for(lambda: proc.poll() is not None or DOMAIN in domains(self.user), 180, "the domain to run")
            assert proc.poll() is None, proc.stderr.read()
            yield proc
        finally:
            reap(proc)

    @contextlib.contextmanager
    def console(self) -> Iterator[subprocess.Popen]:
        """The guest has printed what the launcher follows."""
        proc = self._start()
        try:
            seen = ""
            while "HOLD seconds=" not in seen:
                line = proc.stdout.readline()
                assert line, proc.stderr.read()
                seen += line
            yield proc
        finally:
            reap(proc)


def reap(proc: subprocess.Popen, *others: int) -> None:
    """The launcher's end, however the block ended; one that does not end is killed, and the failure
    tells where it and `others` (the daemon it talks to) were (tests/stacks.py)."""
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the launcher did not end within 120 s:\n{stacks.kill_telling(proc, *others)}") from None


def test_a_run_killed_at_each_stage_leaves_the_truth_and_a_clean_node(qemu_user, registry, fault_proxy, guest_image):
    proxy = fault_proxy(registry)
    vmi = qemu_user.write_vmi(NAME, guest_image.replace(registry.host, proxy.host), serial="hold-600")
    stages = Stages(qemu_user, proxy, vmi)
    with stages.pull() as proc:
        proc.kill()
    _the_truth_then_clean(qemu_user, "pull")

    with stages.overlay() as (proc, xml):
        proc.kill()
    # As if the daemon completed a definition sent just before the kill: defined, never started.
    late = qemu_user.root / "late.xml"
    late.write_text(xml)
    qemu_user.virsh("define", str(late))
    _the_truth_then_clean(qemu_user, "overlay")
    # And so left after `stop` removed the record (the definition landed late): the next run, of the
    # same VMI (its UUID), replaces it.
    qemu_user.virsh("define", str(late))

    with stages.boot() as proc:
        proc.kill()
    _the_truth_then_clean(qemu_user, "boot")

    with stages.console() as proc:
        proc.kill()
    _the_truth_then_clean(qemu_user, "console")

    # The next run of the same VMI boots and ends as ever.
    plain = qemu_user.write_vmi(NAME, guest_image)
    result = qemu_user.launcher("run", NOREG, "--no-lazy", "--console", plain)
    assert result.code == 0 and DONE in result.out, result.err
    assert_clean(qemu_user, DOMAIN)


def test_a_run_terminated_at_each_stage_exits_clean(qemu_user, registry, fault_proxy, guest_image):
    """SIGTERM (a pod's deletion) at each stage: exit 130 (interrupted), the guest shut down within
    --grace-period, and nothing of the run left without a gc."""
    proxy = fault_proxy(registry)
    vmi = qemu_user.write_vmi(NAME, guest_image.replace(registry.host, proxy.host), serial="hold-600")
    stages = Stages(qemu_user, proxy, vmi, "--grace-period", "5")

    def terminated(stage: str, proc: subprocess.Popen) -> None:
        assert proc.wait(timeout=120) == 130, (stage, proc.stderr.read())
        assert_clean(qemu_user, DOMAIN)
        assert not _qemu_of_domain(qemu_user), stage

    with stages.pull() as proc:
        proc.terminate()
    terminated("pull", proc)
    with stages.overlay() as (proc, _xml):  # pulls again: nothing was installed above
        proc.terminate()  # blocked on the stopped daemon: the signal is handled once it answers
    terminated("overlay", proc)
    for stage in (stages.boot, stages.console):
        with stage() as proc:
            proc.terminate()
        terminated(stage.__name__, proc)

"""A LAZY `launcher run` (its disk served over NBD by the node's disk server) killed with SIGKILL or
ended with SIGTERM at each stage: the export being opened (its head read from the registry), the
domain being defined, the boot, the console (issue: the node under faults and at scale, item 3).

Afterwards `status`, `stop`, `gc` and `launcher serve --status` tell the truth, and the disk server
holds no reference of the dead run: it keeps serving a qemu that still runs, and once no VM uses it,
it exits by itself (--exit-when-idle) within its idle time plus one fetch timeout; no qemu of the
run is left after `stop`. Each stage is reached from outside as in tests/test_killed_launcher.py: a
stalled range request at the proxy holds the export's opening, a stopped (SIGSTOP) libvirt session
daemon holds the definition, libvirt's list and the guest's console show the boot and the console."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from tests.faultproxy import Fault
from tests.lazyhost import QEMU_UID, build_lazy_image, disk_server, padded_guest, wait_for
from tests.test_killed_launcher import daemon_pids, domains, reap
from tests.testguest import ensure_testguest
from tests.vmhost import DONE, NOREG, QemuUser, assert_clean, qemu_scratch

NAME = "killed-lazy"
DOMAIN = f"default_{NAME}"
IDLE, FETCH_TIMEOUT = 15, 30  # idle: long enough for a run on a loaded machine to ask before the server leaves
# What the server may take to leave once no VM uses it: its idle time, one fetch timeout (a fill whose
# registry went quiet is given up after that), and the rest of a 64 MiB fill from a loopback registry
# on a loaded machine.
EXIT_BOUND = IDLE + FETCH_TIMEOUT + 90
SPAWNED_BOUND = 30 + 30 + 90  # the same for a server `launcher run` starts: idle 30 s, fetch timeout 30 s


@pytest.fixture(scope="module")
def user():
    with qemu_scratch("e2e-klazy-") as root:
        yield QemuUser(root)


@pytest.fixture(scope="module")
def lazy_guest(registry, user) -> str:
    raw = padded_guest(ensure_testguest() / "testguest-poweroff.qcow2", user.root / "guest-64m.img", 64 << 20)
    return build_lazy_image(raw, f"{registry.host}/killed/lazy:v1")


def qemu_of_domain(user: QemuUser) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if f"guest={DOMAIN}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
    return found


class LazyStages:
    """Lazy runs of one VMI, each held or seen at one stage, with a disk server of the test's own
    (as the qemu user, exiting when idle) that the run finds and uses."""

    def __init__(self, user: QemuUser, proxy, vmi: Path, *run_args: str):
        self.user, self.proxy, self.vmi, self.run_args = user, proxy, vmi, run_args
        self.record = user.cache / "vms" / f"{DOMAIN}.json"
        self.run_dir = user.cache / "run" / DOMAIN
        user.virsh("list")
        self.daemons = daemon_pids(user)
        assert self.daemons, "no libvirt session daemon of the qemu user"
        self.server: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        return self.user.popen("run", NOREG, "--lazy", "--console", *self.run_args, self.vmi)

    @contextlib.contextmanager
    def _served(self) -> Iterator[None]:
        with disk_server(self.user.cache, "--exit-when-idle", str(IDLE), "--fetch-timeout", str(FETCH_TIMEOUT),
                         user=QEMU_UID, env=self.user.env) as server:
            self.server = server
            yield

    def _without_the_disk(self) -> None:
        """Before a run that must read the disk through the proxy: the disk a stage before completed
        and installed goes (`launcher gc`), or the run would take it from the node."""
        swept = self.user.launcher("gc")
        assert swept.code == 0, swept

    def _wait_for_the_head(self, proc: subprocess.Popen) -> None:
        """Until the server asks the proxy for the disk's head (the stalled request). A run that gets as
        far as its record without that read took the disk from the node: a stage before left it there."""
        wait_for(lambda: not self.proxy.pending or proc.poll() is not None or self.record.exists(), 120,
                 "the server to ask for the head")
        assert proc.poll() is None, proc.stderr.read()
        if self.proxy.pending:
            proc.terminate()  # its VM is on its way: ended now, not left to the stages after
            held = sorted(str(p.relative_to(self.user.cache)) for p in (self.user.cache / "disks").rglob("disk.img"))
            raise AssertionError(f"the run read no blob through the proxy; the node holds {held}")

    @contextlib.contextmanager
    def opening(self) -> Iterator[subprocess.Popen]:
        """The run waits for the server's answer, the server for the head of the disk."""
        self._without_the_disk()
        with self._served():
            self.proxy.add(Fault("GET", r"/blobs/sha256:", "stall", times=1, arg=4))
            proc = self._start()
            try:
                self._wait_for_the_head(proc)
                yield proc
            finally:
                self.proxy.clear()
                reap(proc, *self.daemons)
            self.after(proc)

    @contextlib.contextmanager
    def define(self) -> Iterator[subprocess.Popen]:
        """Export open, overlay made over it, the VM recorded; the stopped daemon holds the definition."""
        self._without_the_disk()
        with self._served():
            self.proxy.add(Fault("GET", r"/blobs/sha256:", "stall", times=1, arg=2))
            proc = self._start()
            stopped = False
            try:
                self._wait_for_the_head(proc)
                for pid in self.daemons:
                    os.kill(pid, signal.SIGSTOP)
                stopped = True
                wait_for(lambda: proc.poll() is not None or self.record.exists(), 120, "the run's record")
                assert proc.poll() is None, proc.stderr.read()
                assert list((self.run_dir / "root").glob("*.qcow2")), list(self.run_dir.rglob("*"))
                yield proc
            finally:
                self.proxy.clear()
                if stopped:
                    for pid in self.daemons:
                        os.kill(pid, signal.SIGCONT)
                reap(proc, *self.daemons)
            self.after(proc)

    @contextlib.contextmanager
    def boot(self) -> Iterator[subprocess.Popen]:
        with self._served():
            proc = self._start()
            try:
                wait_for(lambda: proc.poll() is not None or DOMAIN in domains(self.user), 300, "the domain to run")
                assert proc.poll() is None, proc.stderr.read()
                yield proc
            finally:
                reap(proc, *self.daemons)
            self.after(proc)

    @contextlib.contextmanager
    def console(self) -> Iterator[subprocess.Popen]:
        with self._served():
            proc = self._start()
            try:
                seen = ""
                while "HOLD seconds=" not in seen:
                    line = proc.stdout.readline()
                    assert line, proc.stderr.read()
                    seen += line
                yield proc
            finally:
                reap(proc, *self.daemons)
            self.after(proc)

    def after(self, proc: subprocess.Popen) -> None:
        """Set by the test: what it checks once the run is gone, with its server still started."""


def serve_status(user: QemuUser) -> dict:
    result = user.launcher("serve", "--status", "--json", "--cache-dir", user.cache)
    assert result.code == 0, result.err
    return json.loads(result.out)


def the_truth_then_clean(user: QemuUser, stages: LazyStages, stage: str) -> None:
    server = stages.server
    running = DOMAIN in domains(user)
    assert running == (stage in ("boot", "console")), (stage, domains(user, "--all"))
    status = user.launcher("status", NAME)
    if running:
        assert (status.code, status.out.strip()) == (0, "running"), (stage, status)
        assert server.poll() is None, (stage, (user.cache.parent / f"serve-{user.cache.name}.log").read_text(errors="replace")[-3000:])
        # The dead run's qemu still reads through the server: it is connected, and stays served.
        assert serve_status(user)["connections"] >= 1, stage
    else:
        assert status.code != 0, (stage, status)
    stopped = user.launcher("stop", NAME)
    assert stopped.code == 0, (stage, stopped)
    assert stopped.out.strip() == (f"VM {NAME} was stopped" if running else f"VM {NAME} is not running"), (stage, stopped)
    assert user.launcher("status", NAME).code != 0, stage
    assert not qemu_of_domain(user), stage
    if server.poll() is None:
        assert serve_status(user)["connections"] == 0, stage
    # No VM uses the server now and the dead run's announced client is not waited for: it leaves by itself.
    code = server.wait(timeout=EXIT_BOUND)
    log = (user.cache.parent / f"serve-{user.cache.name}.log").read_text(errors="replace")
    assert code == 0, log
    # Why it left (the disk it completed may be installed after that line, on its way out).
    exiting = [line for line in log.splitlines() if line.endswith(": exiting")]
    assert exiting, (stage, log[-2000:])
    if stage == "opening":
        # The run it was opened for is gone, no VM ever came (later stages read the disk's header for the
        # overlay): the server lingers no longer than after a VM.
        assert "the run that asked for a disk is gone before its VM connected" in exiting[-1], (stage, log[-2000:])
    # A run under load may have started a server of its own too (`run --lazy` starts one when none
    # answers it at once): that one leaves after its own idle time and fetch timeout (launcher.diskserver.spawn).
    wait_for(lambda: not [p for p in (user.cache / "serve").iterdir() if p.is_socket()], SPAWNED_BOUND, "every disk server of the cache to leave")
    swept = user.launcher("gc")
    assert swept.code == 0, (stage, swept)
    assert_clean(user, DOMAIN)
    assert not list((user.cache / "locks").glob(f"vm-{DOMAIN}*")), stage


@pytest.mark.parametrize("stage", ["opening", "define", "boot", "console"])
def test_a_lazy_run_killed_at_a_stage_leaves_the_truth_and_a_clean_node(user, registry, fault_proxy, lazy_guest, stage):
    proxy = fault_proxy(registry)
    vmi = user.write_vmi(NAME, lazy_guest.replace(registry.host, proxy.host), serial="hold-600")
    stages = LazyStages(user, proxy, vmi, "--retry-times", "8", "--retry-delay", "0.2")
    stages.after = lambda proc: the_truth_then_clean(user, stages, stage)
    with getattr(stages, stage)() as proc:
        proc.kill()


@pytest.mark.parametrize("stage", ["opening", "define", "boot", "console"])
def test_a_lazy_run_terminated_at_a_stage_exits_clean_and_releases_the_server(user, registry, fault_proxy, lazy_guest, stage):
    """SIGTERM (a pod's deletion): exit 130, the guest shut down within --grace-period, nothing of the
    run left, and the server, used by no VM, leaves by itself."""
    proxy = fault_proxy(registry)
    vmi = user.write_vmi(NAME, lazy_guest.replace(registry.host, proxy.host), serial="hold-600")
    stages = LazyStages(user, proxy, vmi, "--grace-period", "5", "--retry-times", "8", "--retry-delay", "0.2")

    def after(proc: subprocess.Popen) -> None:
        assert proc.returncode == 130, (stage, proc.returncode, proc.stderr.read())
        assert_clean(user, DOMAIN)
        assert not qemu_of_domain(user), stage
        assert stages.server.wait(timeout=EXIT_BOUND) == 0, stage

    stages.after = after
    with getattr(stages, stage)() as proc:
        proc.terminate()  # at the define stage, handled once the stopped daemon goes on

    # The next lazy run of the same VMI boots and ends as ever.
    if stage == "console":
        plain = user.write_vmi(NAME, lazy_guest)
        with disk_server(user.cache, "--exit-when-idle", str(IDLE), user=QEMU_UID, env=user.env):
            result = user.launcher("run", NOREG, "--lazy", "--console", plain)
        assert result.code == 0 and DONE in result.out, result.err
        assert_clean(user, DOMAIN)

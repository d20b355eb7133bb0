"""A root `launcher run` on libvirt's system daemon (`qemu:///system`, a private one: tests.systemlibvirt)
killed with SIGKILL while it pulls and once the domain runs: `status`, `stop` and `gc` then tell the
truth and leave a clean node, as tests/test_killed_launcher.py checks for the qemu user on its session
daemon (issue: the node under faults and at scale, item 3). Each libvirt start as root re-probes QEMU
here (tens of seconds), so only the two stages that differ most are walked: nothing of libvirt's yet,
and a running qemu that libvirt's system daemon owns."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.faultproxy import Fault
from tests.lazyhost import wait_for
from tests.systemlibvirt import system_libvirtd
from tests.test_system_libvirt import write_vmi
from tests.vmhost import NOREG

NAME = "root-killed"
DOMAIN = f"default_{NAME}"


@pytest.fixture(scope="module")
def daemon():
    with system_libvirtd() as d:
        yield d


def qemu_of_domain() -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"guest={DOMAIN}".encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            pass
    return found


def running(daemon) -> bool:
    return DOMAIN in daemon.virsh("list", "--name").split()


@pytest.mark.parametrize("stage", ["pull", "boot"])
def test_a_root_run_killed_at_a_stage_leaves_the_truth_and_a_clean_node(daemon, registry, fault_proxy, guest_image, stage):
    cache = daemon.root / f"cache-{stage}"  # the daemon's scratch is traversable by qemu.conf's user, pytest's tmp_path is not
    cache.mkdir()
    env = {**os.environ, "CI": "true", "DISKKIT_CACHE": str(cache)}
    proxy = fault_proxy(registry)
    vmi = write_vmi(daemon.root, NAME, guest_image.replace(registry.host, proxy.host), hold=600)
    if stage == "pull":
        proxy.add(Fault("GET", r"/blobs/sha256:", "stall", times=1, arg=120))
    proc = subprocess.Popen(daemon.launcher_command("run", NOREG, "--no-lazy", "--console", "--timeout", "900", vmi), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        if stage == "pull":
            wait_for(lambda: not proxy.pending or proc.poll() is not None, 120, "the run to ask for its layer")
        else:
            wait_for(lambda: proc.poll() is not None or running(daemon), 600, "the domain to run")
        assert proc.poll() is None, proc.stderr.read()
        proc.kill()
        proc.wait()
    finally:
        proxy.clear()
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    was_running = running(daemon)
    assert was_running == (stage == "boot")
    status = daemon.launcher("status", NAME, env={"DISKKIT_CACHE": str(cache)})
    if was_running:
        assert (status.code, status.out.strip()) == (0, "running"), status
        assert qemu_of_domain(), "libvirt's qemu went with the launcher"
    else:
        assert status.code != 0, status
    stopped = daemon.launcher("stop", NAME, env={"DISKKIT_CACHE": str(cache)})
    assert stopped.code == 0, stopped
    assert stopped.out.strip() == (f"VM {NAME} was stopped" if was_running else f"VM {NAME} is not running"), stopped
    assert daemon.launcher("status", NAME, env={"DISKKIT_CACHE": str(cache)}).code != 0
    assert daemon.launcher("gc", env={"DISKKIT_CACHE": str(cache)}).code == 0
    assert DOMAIN not in daemon.domains()
    assert not qemu_of_domain()
    assert not (cache / "run" / DOMAIN).exists() and not (cache / "vms" / f"{DOMAIN}.json").exists()
    assert not list((cache / "locks").glob(f"vm-{DOMAIN}*"))
    assert not [p for p in (cache / "partial").rglob("*") if p.is_file()]
    assert not list((cache / "disks").rglob("disk.img"))

"""`launcher pause` / `launcher unpause`, as `virtctl pause vmi` / `virtctl unpause vmi`
(pkg/virtctl/pause/pause.go, pkg/virtctl/unpause/unpause.go): virt-api's refusals in its words
(PauseVMIRequestHandler and UnpauseVMIRequestHandler in pkg/virt-api/rest/lifecycle.go, the messages
of pkg/virt-api/rest/subresource.go), and the VMI's Paused condition reasons virt-handler sets
(pkg/virt-handler/vm.go: PausedByUser, PausedIOError) in `launcher status`.

What the guest sees is read from the guest itself: the test guest in echo mode answers each line
typed on its serial console; a line typed while the VM is paused is answered only once it is unpaused.
The pause for an I/O error (a full filesystem) is tests/test_overlay_full.py's; what status, ls,
gc and the refusals make of a VM's record and its domain state, tests/test_bookkeeping.py's (no guest)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time

import pytest

from launcher.runtime.conditions import Paused, pause_refusal, paused_condition, unpause_refusal
from launcher.runtime.iopause import RESUME_AFTER
from launcher.spec.vmi import parse_vmi
from tests.conftest import launcher_command
from tests.lazyhost import wait_for
from tests.test_launcher_console import read_until
from tests.vmhost import NOREG, QEMU_UID, QemuUser, assert_clean

NAME = "pausevm"
DOMAIN = f"default_{NAME}"


def attach(user: QemuUser) -> subprocess.Popen:
    proc = subprocess.Popen(launcher_command("console", NAME, user=str(QEMU_UID)), env={**os.environ, "CI": "true", **user.env},
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    read_until(proc.stderr, b"^]\n")
    return proc


def type_line(console: subprocess.Popen, line: str) -> None:
    console.stdin.write(line.encode() + b"\n")
    console.stdin.flush()


def read_for(stream, seconds: float) -> bytes:
    """What `stream` carries within `seconds` (a paused guest should say nothing)."""
    seen = b""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([stream], [], [], left)
        if ready:
            chunk = os.read(stream.fileno(), 4096)
            if not chunk:
                break
            seen += chunk
    return seen


def test_a_detached_vm_is_paused_and_unpaused_as_virtctl_does(qemu_user, guest_image):
    """What the guest and libvirt do; what status, ls and gc make of a paused VM, and the refusals, are
    tests/test_bookkeeping.py's."""
    vmi = qemu_user.write_vmi(NAME, guest_image, serial="hold-600-echo")
    doc = json.loads(vmi.read_text())
    doc["spec"]["livenessProbe"] = {"guestAgentPing": {}}  # the one probe a pause goes with
    vmi.write_text(json.dumps(doc))
    started = qemu_user.launcher("run", NOREG, "--no-lazy", "--detach", "--wait-for", "ECHO ready", "--timeout", "300", vmi)
    assert started.code == 0, started.err
    console = None
    try:
        # What `launcher pause` checks, as virt-api checks the VMI's (test_the_recorded_liveness_probe_decides_the_pause).
        assert json.loads((qemu_user.cache / "vms" / f"{DOMAIN}.json").read_text())["livenessProbe"] == "guestAgentPing"
        console = attach(qemu_user)
        type_line(console, "before the pause")
        read_until(console.stdout, b"ECHO before the pause")

        paused = qemu_user.launcher("pause", NAME)
        assert (paused.code, paused.out.strip()) == (0, f"VMI {NAME} was paused"), paused.err
        assert qemu_user.virsh("domstate", "--reason", DOMAIN).strip() == "paused (user)"

        # The guest is frozen: the line waits in the serial port, unanswered...
        type_line(console, "during the pause")
        assert b"ECHO during the pause" not in read_for(console.stdout, 5)

        unpaused = qemu_user.launcher("unpause", NAME)
        assert (unpaused.code, unpaused.out.strip()) == (0, f"VMI {NAME} was unpaused"), unpaused.err
        # ... and is answered once the guest runs again.
        read_until(console.stdout, b"ECHO during the pause")
        assert qemu_user.virsh("domstate", DOMAIN).strip() == "running"

        # A paused VM is stopped clean. Its guest cannot answer the power button: KubeVirt waits out the
        # grace period (pkg/virt-handler/vm.go), which --force --grace-period=0 skips.
        assert qemu_user.launcher("pause", NAME).code == 0
        stopped = qemu_user.launcher("stop", "--force", "--grace-period=0", NAME)
        assert stopped.code == 0 and stopped.out.strip() == f"VM {NAME} was stopped", stopped
    finally:
        if console is not None:
            console.kill()
            console.wait()
        qemu_user.launcher("stop", NAME)
    assert_clean(qemu_user, DOMAIN)


USER = Paused("PausedByUser", "VMI was paused by user")
IO = Paused("PausedIOError", "vda: no space left on device (/c/run/d/root/disk.qcow2)")


@pytest.mark.parametrize("running, condition, pause, unpause", [
    (False, None, "VM is not running", "VMI is not running"),  # sic: vmNotRunning in pause, vmiNotRunning in unpause
    (True, None, None, "VMI is not paused"),
    (True, USER, "VMI is already paused", None),
    (True, IO, "VMI is already paused", None),  # KubeVirt resumes a VMI an I/O error paused
])
def test_the_refusals_are_virt_apis(running, condition, pause, unpause):
    assert pause_refusal(running, condition) == pause
    assert unpause_refusal(running, condition) == unpause


@pytest.mark.parametrize("probe, refusal", [
    (None, None), ("guestAgentPing", None),
    *((kind, "Pausing VMIs with a non-GuestAgentPing LivenessProbe is not supported") for kind in ("exec", "httpGet", "tcpSocket", "other")),
])
def test_a_liveness_probe_a_frozen_guest_would_fail_forbids_the_pause(probe, refusal):
    assert pause_refusal(True, None, probe) == refusal
    assert pause_refusal(False, None, probe) == "VM is not running"  # virt-api checks the phase first


def test_the_liveness_probes_handler_is_read_from_the_spec():
    def vmi(probe):
        spec = {"domain": {"devices": {}, "resources": {"requests": {"memory": "128Mi"}}}, **({"livenessProbe": probe} if probe is not None else {})}
        return parse_vmi({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "v"}, "spec": spec})

    assert vmi(None).liveness_probe is None
    assert vmi({"tcpSocket": {"port": 22}, "initialDelaySeconds": 5}).liveness_probe == "tcpSocket"
    assert vmi({"guestAgentPing": {}}).liveness_probe == "guestAgentPing"


def test_the_paused_condition_is_virt_handlers():
    assert paused_condition("user") == USER
    assert paused_condition("ioerror", IO.message) == IO
    assert paused_condition("ioerror") == Paused("PausedIOError", "VMI was paused, low-level IO error detected")
    assert paused_condition("other") is None  # virt-handler: "Domain is paused for unknown reason": no condition
    assert paused_condition(None) is None


def test_a_launcher_following_its_vm_leaves_a_users_pause_alone(qemu_user, guest_image):
    """The foreground `run` resumes a VM an I/O error paused (launcher.runtime.iopause), never one the user paused."""
    vmi = qemu_user.write_vmi(NAME, guest_image, serial="hold-600")
    proc = qemu_user.popen("run", NOREG, "--no-lazy", vmi)
    try:
        # Until libvirt has started its vCPUs the domain is paused, starting up: a pause then is left alone
        # (launcher.runtime.pausing suspends a running domain only), and the start goes on.
        wait_for(lambda: proc.poll() is None and qemu_user.launcher("status", NAME).code == 0
                 and qemu_user.virsh("domstate", DOMAIN).strip() == "running", 300, "the VM to run")
        assert qemu_user.launcher("pause", NAME).code == 0
        # Three times the launcher's first resume of a VM an I/O error paused (one paused for want of
        # space is resumed at once): a pause taken for either would have been undone by now.
        time.sleep(RESUME_AFTER[0] * 3)
        assert qemu_user.launcher("status", NAME).out.strip() == "paused (PausedByUser): VMI was paused by user"
        assert proc.poll() is None
        assert qemu_user.launcher("unpause", NAME).code == 0
        assert qemu_user.launcher("status", NAME).out.strip() == "running"
        assert qemu_user.launcher("stop", NAME).code == 0
        out, err = proc.communicate(timeout=120)
        assert "resuming" not in err and "paused" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_clean(qemu_user, DOMAIN)

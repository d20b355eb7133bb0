"""`launcher pause` / `launcher unpause`, as `virtctl pause vmi` / `virtctl unpause vmi`
(pkg/virtctl/pause/pause.go, pkg/virtctl/unpause/unpause.go): virt-api's refusals in its words
(PauseVMIRequestHandler and UnpauseVMIRequestHandler in pkg/virt-api/rest/lifecycle.go, the messages
of pkg/virt-api/rest/subresource.go), and the VMI's Paused condition reasons virt-handler sets
(pkg/virt-handler/vm.go: PausedByUser, PausedIOError) in `launcher status`.

What the guest sees is read from the guest itself: the test guest in echo mode answers each line
typed on its serial console; a line typed while the VM is paused is answered only once it is unpaused.
The pause for an I/O error (a full filesystem) is tests/test_overlay_full.py's."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time

import pytest

from diskkit.errors import Exit
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
    vmi = qemu_user.write_vmi(NAME, guest_image, serial="hold-600-echo")
    started = qemu_user.launcher("run", NOREG, "--no-lazy", "--detach", "--wait-for", "ECHO ready", "--timeout", "300", vmi)
    assert started.code == 0, started.err
    console = None
    try:
        console = attach(qemu_user)
        type_line(console, "before the pause")
        read_until(console.stdout, b"ECHO before the pause")

        paused = qemu_user.launcher("pause", NAME)
        assert (paused.code, paused.out.strip()) == (0, f"VMI {NAME} was paused"), paused.err
        status = qemu_user.launcher("status", NAME)
        # Healthy to a pod's probe: KubeVirt keeps a user-paused VMI Running (isPausedButHealthy).
        assert (status.code, status.out.strip()) == (0, "paused (PausedByUser): VMI was paused by user"), status.err
        answer = json.loads(qemu_user.launcher("status", "--json", NAME).out)
        assert (answer["state"], answer["reason"], answer["message"]) == ("paused", "PausedByUser", "VMI was paused by user")
        assert qemu_user.virsh("domstate", "--reason", DOMAIN).strip() == "paused (user)"
        assert f"{DOMAIN}" in (listed := qemu_user.launcher("ls").out) and "paused" in listed, listed
        # A paused VM is a live one: gc leaves it and its disk.
        collected = json.loads(qemu_user.launcher("gc", "--json").out)
        assert collected["vms_cleaned"] == [] and collected["removed"] == [], collected
        assert qemu_user.launcher("status", NAME).out.startswith("paused (PausedByUser)")

        again = qemu_user.launcher("pause", NAME)
        assert (again.code, again.err.strip()) == (Exit.FAILED, f"launcher: {NAME}: VMI is already paused"), again
        refused = json.loads(qemu_user.launcher("pause", "--json", NAME).out)
        assert refused["error"]["message"] == f"{NAME}: VMI is already paused"

        # The guest is frozen: the line waits in the serial port, unanswered...
        type_line(console, "during the pause")
        assert b"ECHO during the pause" not in read_for(console.stdout, 5)

        unpaused = qemu_user.launcher("unpause", "--json", NAME)
        assert unpaused.code == 0, unpaused.err
        assert json.loads(unpaused.out) == {"name": NAME, "domain": DOMAIN, "unpaused": True, "was": "PausedByUser",
                                            "pausedAgain": None, "message": f"VMI {NAME} was unpaused"}
        # ... and is answered once the guest runs again.
        read_until(console.stdout, b"ECHO during the pause")
        status = qemu_user.launcher("status", NAME)
        assert (status.code, status.out.strip()) == (0, "running"), status.err
        assert json.loads(qemu_user.launcher("status", "--json", NAME).out)["reason"] is None

        not_paused = qemu_user.launcher("unpause", NAME)
        assert (not_paused.code, not_paused.err.strip()) == (Exit.FAILED, f"launcher: {NAME}: VMI is not paused"), not_paused

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
    for command in ("pause", "unpause"):
        gone = qemu_user.launcher(command, NAME)
        assert (gone.code, gone.err.strip()) == (Exit.NOT_FOUND, f"launcher: {NAME}: no VM of this name was started from this cache (yet)")


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


def test_a_vm_with_a_tcp_liveness_probe_is_not_paused(qemu_user, guest_image):
    vmi = qemu_user.write_vmi(NAME, guest_image, serial="hold-600")
    doc = json.loads(vmi.read_text())
    doc["spec"]["livenessProbe"] = {"tcpSocket": {"port": 22}}
    vmi.write_text(json.dumps(doc))
    started = qemu_user.launcher("run", NOREG, "--no-lazy", "--detach", vmi)
    assert started.code == 0, started.err
    try:
        refused = qemu_user.launcher("pause", NAME)
        assert (refused.code, refused.err.strip()) == (
            Exit.FAILED, f"launcher: {NAME}: Pausing VMIs with a non-GuestAgentPing LivenessProbe is not supported"), refused
        assert qemu_user.launcher("status", NAME).out.strip() == "running"
    finally:
        qemu_user.launcher("stop", NAME)
    assert_clean(qemu_user, DOMAIN)


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

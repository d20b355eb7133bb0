"""launcher run end to end: the test guest pushed to a real registry, booted through libvirt's
session daemon as the unprivileged qemu user (UID 107), its serial console read back."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests.conftest import launcher_command, run, run_diskkit
from tests.imagecraft import Member, dir_, write_layout
from tests.testguest import ensure_testguest, parse_console
from tests.vmhost import DONE, NOREG, QEMU_UID, assert_clean


def test_boot_from_the_registry_and_start_clean_every_time(qemu_user, guest_image):
    vmi = qemu_user.write_vmi("guest", guest_image)
    first = qemu_user.launcher("run", NOREG, "--console", "--timeout", "180", vmi)
    assert first.code == 0, first.err
    console = parse_console(first.out)
    assert console["ready"] and console["done"], first.out
    assert console["disks"]["vda"]["size"] == 64 << 20
    assert console["disks"]["vda"]["head"].startswith("33c0")  # the guest's own MBR
    assert console["stamps"]["vda"] == (0, 1)
    assert "default_guest stopped" in first.err
    # Which accelerator, and why not KVM: qemu's user (107) cannot open /dev/kvm, or there is none.
    (said,) = [line for line in first.err.splitlines() if line.startswith("launcher: accelerator: ")]
    assert said.startswith("launcher: accelerator: TCG (software emulation): "), said
    assert_clean(qemu_user, "default_guest")
    pulled = json.loads(qemu_user.launcher("pull", NOREG, "--json", guest_image).out)
    base = Path(pulled["path"])
    digest = hashlib.sha256(base.read_bytes()).hexdigest()
    # Re-created: the stamp the guest wrote went with the overlay; the shared base never changed.
    # The VMI comes on stdin this time, as `kubectl apply -f -` takes it.
    second = subprocess.run(launcher_command("run", NOREG, "--console", "--timeout", "180", "-", user=str(QEMU_UID)), input=vmi.read_text(),
                            capture_output=True, text=True, env={**os.environ, "CI": "true", **qemu_user.env}, timeout=300)
    assert second.returncode == 0, second.stderr
    assert parse_console(second.stdout)["stamps"]["vda"] == (0, 1)
    assert hashlib.sha256(base.read_bytes()).hexdigest() == digest
    # The tag came from the node's cache (IfNotPresent): said, with the digest it boots.
    assert f"launcher: note: docker://{guest_image}: cached {pulled['digest']} (imagePullPolicy IfNotPresent)" in second.stderr, second.stderr


def test_custom_path_from_a_local_layout(qemu_user):
    layout = qemu_user.root / "custom"
    assert run_diskkit("build", ensure_testguest() / "testguest-poweroff.qcow2", "--path", "/images/vm/root.qcow2", "-t", f"oci:{layout}:v1").code == 0
    run("chmod", "-R", "a+rX", layout)
    # An explicit host-model under TCG, rendered as KubeVirt renders it with useEmulation: libvirt
    # starts it (its TCG host-model), where it used to be dropped silently.
    vmi = qemu_user.write_vmi("custom", f"oci:{layout}:v1", path="/images/vm/root.qcow2", domain={"cpu": {"model": "host-model"}})
    result = qemu_user.launcher("run", "--console", "--timeout", "180", vmi)
    assert result.code == 0, result.err
    assert parse_console(result.out)["disks"]["vda"]["size"] == 64 << 20


def test_two_vms_at_once_share_one_base(qemu_user, guest_image):
    names = ["twin-a", "twin-b"]
    try:
        for name in names:
            vmi = qemu_user.write_vmi(name, guest_image, serial="hold-120")
            result = qemu_user.launcher("run", NOREG, "--json", "--wait-for", DONE, "--timeout", "180", vmi)
            assert result.code == 0, result.err
            assert f"default_{name} is running" in result.err
            ran = json.loads(result.out)
            assert ran["exitCode"] == 0 and ran["accel"]["accelerator"] in ("kvm", "tcg") and ran["accel"]["reason"], ran
        listing = json.loads(qemu_user.launcher("ls", "--json").out)
        states = {vm["domain"]: vm["state"] for vm in listing["vms"]}
        assert states["default_twin-a"] == states["default_twin-b"] == "running"
        assert {vm["domain"]: vm["accel"] for vm in listing["vms"]}["default_twin-b"] == ran["accel"]  # kept in the VM's record
        shared = [disk for disk in listing["disks"] if {"default_twin-a", "default_twin-b"} <= set(disk["usedBy"])]
        assert len(shared) == 1
        for name in names:
            overlay = qemu_user.cache / "run" / f"default_{name}" / "root" / "disk.qcow2"
            info = json.loads(run("qemu-img", "info", "-U", "--output=json", overlay).stdout)
            assert info["backing-filename"] == shared[0]["path"]
            assert overlay.stat().st_mode & 0o777 == 0o640
            assert overlay.stat().st_blocks * 512 < 4 << 20  # an overlay, not a copy
        # gc keeps the disks the records of running VMs name (usedBy, above, is read from them): tests/test_bookkeeping.py.
    finally:
        for name in names:
            qemu_user.launcher("stop", name)
    for name in names:
        assert_clean(qemu_user, f"default_{name}")


def _until_done(proc) -> str:
    seen = ""
    deadline = time.monotonic() + 180
    while DONE not in seen:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, proc.stderr.read()
        seen += line
        assert time.monotonic() < deadline, seen
    return seen


def test_sigterm_destroys_a_guest_that_ignores_the_power_button(qemu_user, guest_image):
    # This guest leaves the ACPI power button unanswered: it is destroyed when the grace period ends.
    vmi = qemu_user.write_vmi("term", guest_image, serial="hold-120-ignore-acpi")
    proc = qemu_user.popen("run", NOREG, "--console", "--grace-period", "3", vmi)
    _until_done(proc)
    assert (qemu_user.cache / "run" / "default_term" / "root" / "disk.qcow2").is_file()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 130
    err = proc.stderr.read()
    assert "default_term: shutting down (up to 3 s)" in err and "still running after 3 s; destroying it" in err, err
    assert "ACPI-POWEROFF" not in proc.stdout.read()
    assert_clean(qemu_user, "default_term")


def test_sigterm_presses_the_power_button_and_waits_the_vmis_grace_period(qemu_user, guest_image):
    # The grace period comes from the VMI (pkg/virt-controller/services/template.go gracePeriodInSeconds)
    # when --grace-period is not given; the guest powers off by itself well within it.
    vmi = qemu_user.write_vmi("acpi", guest_image, serial="hold-120")
    doc = json.loads(vmi.read_text())
    doc["spec"]["terminationGracePeriodSeconds"] = 90
    vmi.write_text(json.dumps(doc))
    proc = qemu_user.popen("run", NOREG, "--console", vmi)
    _until_done(proc)
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 130
    took = time.monotonic() - began
    err, out = proc.stderr.read(), proc.stdout.read()
    assert "default_acpi: shutting down (up to 90 s)" in err and "default_acpi: the guest powered off" in err, err + out
    assert "destroying it" not in err
    assert "DISKKIT-TESTGUEST ACPI-POWEROFF" in out
    assert took < 90, took  # not the grace period's end: the guest's own power-off
    assert_clean(qemu_user, "default_acpi")


def test_a_guest_that_stops_before_the_text_is_a_failed_guest_in_json_too(qemu_user, guest_image):
    # The test guest powers off once its checks are done: what --wait-for waits for never comes.
    vmi = qemu_user.write_vmi("gone", guest_image)
    result = qemu_user.launcher("run", NOREG, "--json", "--wait-for", "NEVER-PRINTED", "--timeout", "300", vmi)
    assert result.code == 3, result.err  # Exit.GUEST_FAILED, not the 4 of a timeout
    error = json.loads(result.out)["error"]
    assert (error["kind"], error["retryable"]) == ("guest_failed", False), error
    assert error["message"] == "default_gone: the guest stopped before 'NEVER-PRINTED' appeared on the console", error
    assert_clean(qemu_user, "default_gone")


def test_wait_for_text_that_never_comes_times_out_and_cleans_up(qemu_user, guest_image):
    vmi = qemu_user.write_vmi("never", guest_image, serial="hold-120")
    # Meant to expire: long enough for the pull and the domain's start (seconds here), no longer.
    result = qemu_user.launcher("run", NOREG, "--wait-for", "login:", "--timeout", "12", vmi)
    assert result.code == 4  # Exit.TIMEOUT
    assert "'login:' did not appear on the console after 12 s; the domain was destroyed" in result.err
    assert_clean(qemu_user, "default_never")


def test_bad_images_are_refused_before_any_domain_is_defined(qemu_user, tmp_path):
    data = (ensure_testguest() / "testguest-poweroff.qcow2").read_bytes()
    cases = {
        "escape": ([[Member("../escape.txt", b"x"), dir_("disk"), Member("disk/a.qcow2", data)]], "escapes the image root"),
        "twofiles": ([[dir_("disk"), Member("disk/a.qcow2", data), Member("disk/b.qcow2", data)]], "more than one file found in folder /disk"),
    }
    backed = qemu_user.root / "backed.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", "-b", "/etc/passwd", "-F", "raw", backed)
    cases["backing"] = ([[dir_("disk"), Member("disk/d.qcow2", backed.read_bytes())]], "expected no backing file, but found /etc/passwd")
    for name, (layers, expected) in cases.items():
        layout = write_layout(qemu_user.root / f"bad-{name}", layers)
        run("chmod", "-R", "a+rX", layout)
        vmi = qemu_user.write_vmi(f"bad-{name}", f"oci:{layout}:t")
        result = qemu_user.launcher("run", "--timeout", "60", vmi)
        assert result.code == 1
        assert expected in result.err and len(result.err.strip().splitlines()) == 1, result.err
        assert_clean(qemu_user, f"default_bad-{name}")
    missing = qemu_user.write_vmi("missing", "oci:/nonexistent/layout:v1")
    result = qemu_user.launcher("run", missing)
    assert result.code == 1 and "/nonexistent/layout" in result.err


def test_vmi_errors_name_the_field(qemu_user):
    vmi = qemu_user.root / "broken.yaml"
    vmi.write_text(json.dumps({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "broken"},
        "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}}, "devices": {"disks": [{"name": "root"}]}},
                 "volumes": [{"name": "root", "containerDisk": {}}]},
    }))
    result = qemu_user.launcher("run", vmi)
    assert result.code == 1
    assert "spec.volumes[0].containerDisk.image" in result.err, result.err


def test_dedicated_cpus_are_pinned_as_planned(qemu_user, guest_image):
    """dedicatedCpuPlacement + isolateEmulatorThread: libvirt applies the vCPU and emulator pins we render."""
    from launcher.render import cpupin
    from launcher.runtime import hostcpus

    domain = {"cpu": {"cores": 1, "dedicatedCpuPlacement": True, "isolateEmulatorThread": True},
              "resources": {"requests": {"memory": "128Mi"}, "limits": {"memory": "128Mi"}}}
    vmi = qemu_user.write_vmi("pinned", guest_image, serial="hold-60", domain=domain)
    plan = cpupin.fit(hostcpus.read_topology(), hostcpus.pod_cpuset(), 1, 1, 1, True)
    try:
        result = qemu_user.launcher("run", NOREG, "--wait-for", DONE, "--timeout", "180", vmi)
        assert result.code == 0, result.err
        vcpupin = qemu_user.virsh("vcpupin", "default_pinned")
        rows = dict(line.split()[:2] for line in vcpupin.splitlines() if line.strip()[:1].isdigit())
        assert rows == {"0": str(plan.vcpupin[0])}, vcpupin
        emulatorpin = qemu_user.virsh("emulatorpin", "default_pinned")
        assert emulatorpin.split()[-1] == str(plan.emulatorpin), emulatorpin
    finally:
        qemu_user.launcher("stop", "pinned")
    assert_clean(qemu_user, "default_pinned")

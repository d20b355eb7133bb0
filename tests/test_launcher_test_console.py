"""`launcher test --expect/--fail-on`: console lines checked as the serial console streams, besides the
ssh command, on the test guest (its console lines: images/testguest/init); and the test cleans up
after itself however it ends (SIGTERM included)."""

from __future__ import annotations

import json
import os
import pwd
import re
import signal
import time

from launcher.cli.smoketest import with_key
from launcher.runtime.consolewatch import Matcher, compile_patterns
from launcher.spec.vmi import parse_vmi
from tests.vmhost import NOREG, QEMU_UID, assert_clean

BOOT = ("--timeout", "240", "--memory", "128Mi")


def matcher(expect=(), fail_on=()):
    return Matcher(compile_patterns("--expect", expect), compile_patterns("--fail-on", fail_on))


def test_lines_are_matched_whole_across_reads():
    m = matcher(expect=[r"^login:", "DONE$"], fail_on=["Kernel panic"])
    m.feed(b"boot\r\nlog")
    assert m.missing == ["^login:", "DONE$"]
    m.feed(b"in: \nTESTGUEST DONE\r\n")
    assert m.seen == {"^login:": "login: ", "DONE$": "TESTGUEST DONE"} and m.failed is None


def test_the_first_fail_on_line_ends_matching():
    m = matcher(expect=["after"], fail_on=["Kernel panic", "Call Trace"])
    m.feed(b"[ 1.0] Kernel panic - not syncing: VFS\nafter\n")
    assert m.failed == ("Kernel panic", "[ 1.0] Kernel panic - not syncing: VFS") and m.missing == ["after"]


def test_the_last_line_counts_without_a_newline_once_the_console_ends():
    m = matcher(fail_on=["Call Trace"])
    m.feed(b" Call Trace")
    assert m.failed is None
    m.end()
    assert m.failed == ("Call Trace", " Call Trace")


def test_a_vmi_file_without_cloud_init_gets_a_disk_for_the_key():
    # without the disk the key's NoCloud volume never reached the guest: no ssh on any VMI file without cloud-init
    doc = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "v"},
           "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}}, "devices": {"disks": [{"name": "root"}]}}, "volumes": [{"name": "root", "containerDisk": {"image": "r/i:1"}}]}}
    spec = with_key(doc)["spec"]
    assert [d["name"] for d in spec["domain"]["devices"]["disks"]] == ["root", "launcher-test-cloudinit"]
    assert parse_vmi(with_key(doc)).volume("launcher-test-cloudinit") is not None
    assert doc["spec"]["domain"]["devices"]["disks"] == [{"name": "root"}]


def test_a_bad_pattern_is_refused_before_anything_runs(qemu_user):
    result = qemu_user.launcher("test", NOREG, "--fail-on", "(unclosed", "registry.invalid/x:1")
    assert result.code != 0
    assert result.err.strip().splitlines()[-1].startswith("launcher: --fail-on (unclosed: is not a regular expression (")


def test_expect_lines_seen_and_the_command_passes(qemu_user, guest_image):
    result = qemu_user.launcher("test", NOREG, "--json", *BOOT, "--expect", r"^SSH keys=\d+ started", "--expect", "DISKKIT-TESTGUEST DONE",
                                "--fail-on", "Kernel panic", "--fail-on", "Call Trace", guest_image)
    assert result.code == 0, result.err
    out = json.loads(result.out)
    assert out["result"] == "pass" and out["stdout"] == "hello\n", out
    assert re.fullmatch(r"SSH keys=1 started", out["expect"][r"^SSH keys=\d+ started"]), out
    assert out["expect"]["DISKKIT-TESTGUEST DONE"] == "DISKKIT-TESTGUEST DONE"
    assert out["failOn"] == {"Kernel panic": None, "Call Trace": None}
    assert_clean(qemu_user, out["vmi"].replace("/", "_"))


def test_a_fail_on_line_stops_the_test_at_once(qemu_user, guest_image):
    # The test guest's DISK lines come before its ssh starts (and it would stay up an hour with ssh).
    result = qemu_user.launcher("test", NOREG, "--json", *BOOT, "--fail-on", r"^DISK name=vda ", guest_image)
    assert result.code == 3, result.err
    out = json.loads(result.out)
    assert out["result"] == "fail" and out["exitStatus"] is None, out
    line = out["failOn"][r"^DISK name=vda "]
    assert line.startswith("DISK name=vda "), out
    assert out["reason"] == f"a console line matched --fail-on '^DISK name=vda ': {line}"
    assert_clean(qemu_user, out["vmi"].replace("/", "_"))


def test_an_expect_line_never_seen_times_out(qemu_user, guest_image):
    # A timeout meant to expire: long enough for the boot and the ssh command (15-17 s in the suite's full
    # runs, test_expect_lines_seen_and_the_command_passes), no longer.
    result = qemu_user.launcher("test", NOREG, "--json", "--timeout", "30", "--memory", "128Mi", "--expect", "NEVER-PRINTED", guest_image)
    assert result.code == 4, result.err
    out = json.loads(result.out)
    assert out["result"] == "fail" and out["expect"] == {"NEVER-PRINTED": None}, out
    # the command ran and passed; only the console line was missing
    assert out["exitStatus"] == 0, out
    assert out["reason"] == "--expect 'NEVER-PRINTED' did not appear on the console within --timeout", out
    assert_clean(qemu_user, out["vmi"].replace("/", "_"))


def test_sigterm_cleans_up_domain_overlays_and_key(qemu_user, guest_image):
    tmp = qemu_user.root / "tmp"
    tmp.mkdir(exist_ok=True)
    os.chown(tmp, QEMU_UID, pwd.getpwuid(QEMU_UID).pw_gid)
    qemu_user.env["TMPDIR"] = str(tmp)
    try:
        proc = qemu_user.popen("test", NOREG, "--json", *BOOT, "--expect", "NEVER-PRINTED", guest_image)
        domain, deadline = None, time.monotonic() + 240
        while domain is None and time.monotonic() < deadline and proc.poll() is None:
            names = [n for n in qemu_user.virsh("list", "--name").split() if n.startswith("default_launcher-test-")]
            domain = names[0] if names else None
            time.sleep(0.5)
        assert domain is not None, proc.communicate()
        assert [p.name for p in tmp.iterdir()], "the key's directory is there while the test runs"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 130, err
        assert json.loads(out)["error"]["kind"] == "interrupted", out  # one JSON object: the interruption
        assert_clean(qemu_user, domain)
        assert list(tmp.iterdir()) == [], "the key's directory is removed"
    finally:
        del qemu_user.env["TMPDIR"]


def test_a_vmi_file_with_claims_and_manifests_as_launcher_run_takes_them(qemu_user, guest_image):
    # --pvc and --manifests reach the VMI's volumes; the guest's DISK lines (--expect) prove both disks arrived.
    claim = qemu_user.root / "claim-ci"
    claim.mkdir()
    os.chown(claim, QEMU_UID, QEMU_UID)
    manifests = qemu_user.root / "manifests-ci"
    manifests.mkdir()
    (manifests / "cm.json").write_text(json.dumps({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "app", "namespace": "default"},
                                                   "data": {"greeting": "hello\n"}}))
    extra = [({"name": "data", "serial": "pvc-data", "disk": {"bus": "virtio"}}, {"name": "data", "persistentVolumeClaim": {"claimName": "data"}}),
             ({"name": "cm", "serial": "cm-app", "disk": {"bus": "virtio"}}, {"name": "cm", "configMap": {"name": "app"}})]
    vmi = qemu_user.write_vmi("withclaims", guest_image, extra=extra)
    result = qemu_user.launcher("test", NOREG, "--json", *BOOT, "--pvc", f"data={claim}:16Mi", "--manifests", manifests,
                                "--expect", r"^DISK .* serial=pvc-data ", "--expect", r"^DISK .* serial=cm-app ", vmi)
    assert result.code == 0, result.out
    out = json.loads(result.out)
    assert out["result"] == "pass" and out["vmi"] == "default/withclaims", out
    assert f"size={16 * 1024 * 1024} " in out["expect"][r"^DISK .* serial=pvc-data "], out
    assert all(out["expect"].values()), out
    assert_clean(qemu_user, "default_withclaims")

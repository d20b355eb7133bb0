"""KVM-or-TCG choice: the probe guest itself, the unprivileged shortcut, this machine's truth, the cache, the override."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from launcher.runtime import accel
from tests.conftest import run_launcher

ROOT = Path(__file__).resolve().parent.parent


def test_boot_sector_shape():
    sector = accel.BOOT_SECTOR
    assert len(sector) == 512 and sector[510:] == b"\x55\xaa"
    assert sector.startswith(b"\xfa\xba\xf8\x03")  # cli; mov dx,0x3f8


def test_probe_program_runs_under_tcg():
    # Same sector, same code path as the KVM probe: only the accelerator differs.
    probe = accel.run_probe("tcg", timeout=30)
    assert probe.works, probe.reason
    # START, the spin, then MARKER, each contiguous (no BIOS text in between).
    assert accel.START + accel.MARKER in probe.output


def test_tcg_probe_fails_when_the_marker_is_missing(monkeypatch):
    # The check can fail: a marker the program never prints is not "seen".
    monkeypatch.setattr(accel, "MARKER", b"NEVER-PRINTED\n")
    probe = accel.run_probe("tcg", timeout=3)
    assert not probe.works and "too slow" in probe.reason and accel.START in probe.output


def test_unprivileged_user_gets_qemu_without_probing(tmp_path):
    # As KubeVirt's qemu user (no access to /dev/kvm): "qemu" at once, and never a qemu process.
    script = (
        "import os, subprocess\n"
        "def boom(*a, **k): raise AssertionError('probe spawned')\n"
        "subprocess.Popen = boom\n"
        "from launcher.runtime.accel import choose, KVM_DEVICE\n"
        "chosen = choose(cache_dir=%r)\n"
        "print(os.access(KVM_DEVICE, os.R_OK | os.W_OK), chosen.domain_type)\n"
        "print(chosen.line())\n" % str(tmp_path / "cache")
    )
    env = {k: v for k, v in os.environ.items() if k != "DISKKIT_ACCEL"}
    proc = subprocess.run(["setpriv", "--reuid=107", "--regid=107", "--clear-groups", sys.executable, "-c", script],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    decided, line = proc.stdout.splitlines()
    assert decided.split() == ["False", "qemu"]
    # Said, with the reason, whether the device is missing or closed to this user.
    assert line.startswith("accelerator: TCG (software emulation): ")
    assert ("no /dev/kvm" in line) if not os.path.exists(accel.KVM_DEVICE) else ("/dev/kvm exists but uid 107 cannot open it" in line), line
    assert not (tmp_path / "cache").exists()


def test_probe_kvm_tells_the_truth_of_this_machine():
    # Expected here: /dev/kvm opens but guests crawl, so False. Not hard-coded: whatever the
    # answer, it must match what the guest actually printed, and come within the timeout.
    timeout = 8.0
    probe = accel.run_probe("kvm", timeout=timeout)
    assert probe.seconds < timeout + 5
    assert probe.works == (accel.MARKER in probe.output), probe.reason
    assert accel.probe_kvm(timeout=timeout)[0] == probe.works
    if not probe.works:
        assert any(word in probe.reason for word in ("too slow", "no progress", "failed")), probe.reason


def test_result_is_cached_per_boot(tmp_path, monkeypatch):
    monkeypatch.delenv("DISKKIT_ACCEL", raising=False)
    spawned = []
    real_popen = subprocess.Popen

    def counting_popen(cmd, *args, **kwargs):
        spawned.append(cmd)
        return real_popen(cmd, *args, **kwargs)

    monkeypatch.setattr(accel.subprocess, "Popen", counting_popen)
    first = accel.choose(tmp_path, timeout=4).domain_type
    assert len(spawned) == 1 and "kvm" in spawned[0]
    files = list((tmp_path / "accel").iterdir())
    assert len(files) == 1
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert files[0].name.startswith(boot_id + "_")
    record = json.loads(files[0].read_text())
    assert ("kvm" if record["works"] else "qemu") == first
    mtime = files[0].stat().st_mtime_ns

    assert accel.choose(tmp_path, timeout=4).domain_type == first
    assert len(spawned) == 1  # no second qemu
    assert files[0].stat().st_mtime_ns == mtime

    # The cache decides: flip the record and the answer flips, still without a probe.
    files[0].write_text(json.dumps({**record, "works": not record["works"]}))
    assert accel.choose(tmp_path).domain_type == ("qemu" if first == "kvm" else "kvm")
    assert len(spawned) == 1

    # A record from an earlier boot is not read, and is removed when the new one is written.
    monkeypatch.setattr(accel, "probe_kvm", lambda qemu, timeout: (False, "stub"))
    stale = tmp_path / "accel" / "00000000-0000-0000-0000-000000000000_0.json"
    stale.write_text(json.dumps({"works": True}))
    files[0].unlink()
    assert accel.choose(tmp_path).domain_type == "qemu"
    assert not stale.exists() and files[0].exists()


@pytest.mark.parametrize(("value", "expected"), [("kvm", "kvm"), ("tcg", "qemu"), ("qemu", "qemu"), ("KVM", "kvm")])
def test_env_override(monkeypatch, tmp_path, value, expected):
    monkeypatch.setenv("DISKKIT_ACCEL", value)
    monkeypatch.setattr(accel, "probe_kvm", lambda *a, **k: pytest.fail("probed despite DISKKIT_ACCEL"))
    started = time.monotonic()
    assert accel.choose(tmp_path).domain_type == expected
    assert time.monotonic() - started < 1
    assert not (tmp_path / "accel").exists()


def test_env_override_rejects_nonsense(monkeypatch, tmp_path):
    monkeypatch.setenv("DISKKIT_ACCEL", "hvf")
    with pytest.raises(accel.DiskkitError, match="DISKKIT_ACCEL"):
        accel.choose(tmp_path).domain_type


# ---------------------------------------------------------------- said at every run

BARE_VMI = """apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: bare}
spec:
  domain:
    resources: {requests: {memory: 64Mi}}
    devices: {disks: [{name: scratch, disk: {bus: virtio}}]}
  volumes: [{name: scratch, emptyDisk: {capacity: 16Mi}}]
"""


def _domain(tmp_path, *args, env=None):
    vmi = tmp_path / "bare.yaml"
    vmi.write_text(BARE_VMI)
    return run_launcher("domain", "--cache-dir", tmp_path / "cache", *args, vmi, env=env)


def test_a_kvm_left_unused_is_said_with_the_probes_reason(tmp_path):
    # The reason used to live only in the cache file: a run under TCG said nothing.
    if not os.access(accel.KVM_DEVICE, os.R_OK | os.W_OK):
        pytest.skip("needs a /dev/kvm this user opens: the probe's path")
    cached = accel._cache_file(tmp_path / "cache", "qemu-system-x86_64")[0]
    cached.parent.mkdir(parents=True)
    cached.write_text(json.dumps({"works": False, "reason": "kvm guest made no progress: probe not reached in 8s", "qemu": "qemu-system-x86_64"}))
    env = {k: v for k, v in os.environ.items() if k != "DISKKIT_ACCEL"}
    done = _domain(tmp_path, "--json", env=env)
    assert done.code == 0, done.err
    line = f"launcher: accelerator: TCG (software emulation): /dev/kvm exists but KVM is not used: kvm guest made no progress: probe not reached in 8s (this boot's probe, kept in {cached}); --accel kvm or DISKKIT_ACCEL=kvm forces KVM"
    assert line in done.err.splitlines(), done.err
    out = json.loads(done.out)
    assert out["accel"] == {"accelerator": "tcg", "domainType": "qemu", "reason": line.split(": ", 3)[3]}
    assert ET.fromstring(out["xml"]).get("type") == "qemu"


@pytest.mark.parametrize(("flag", "env_value", "expected", "said"), [
    ("tcg", None, "qemu", "TCG (software emulation): --accel tcg asks for it"),
    ("kvm", None, "kvm", "KVM: --accel kvm asks for it"),
    (None, "tcg", "qemu", "TCG (software emulation): DISKKIT_ACCEL=tcg asks for it"),
    ("qemu", "kvm", "qemu", "TCG (software emulation): --accel qemu asks for it"),  # the flag wins
])
def test_accel_flag_and_environment_are_said(tmp_path, flag, env_value, expected, said):
    env = {k: v for k, v in os.environ.items() if k != "DISKKIT_ACCEL"}
    if env_value:
        env["DISKKIT_ACCEL"] = env_value
    done = _domain(tmp_path, *(["--accel", flag] if flag else []), env=env)
    assert done.code == 0, done.err
    assert f"launcher: accelerator: {said}" in done.err.splitlines(), done.err
    assert ET.fromstring(done.out).get("type") == expected
    assert not (tmp_path / "cache" / "accel").exists()  # nothing probed


def test_run_and_test_take_accel():
    # The same choice on every command that boots: refused values are click's, before anything runs.
    for command in ("run", "test", "domain"):
        bad = run_launcher(command, "--accel", "hvf", "x.yaml")
        assert bad.code == 2 and "'hvf' is not one of 'auto', 'kvm', 'qemu', 'tcg'" in bad.err, (command, bad.err)

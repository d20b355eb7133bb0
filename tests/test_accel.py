"""KVM-or-TCG choice: the probe guest itself, the unprivileged shortcut, this machine's truth, the cache, the override."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.runtime import accel

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
        "from launcher.runtime.accel import domain_type, KVM_DEVICE\n"
        "print(os.access(KVM_DEVICE, os.R_OK | os.W_OK), domain_type(cache_dir=%r))\n" % str(tmp_path / "cache")
    )
    env = {k: v for k, v in os.environ.items() if k != "DISKKIT_ACCEL"}
    proc = subprocess.run(["setpriv", "--reuid=107", "--regid=107", "--clear-groups", sys.executable, "-c", script],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "qemu"]
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
    first = accel.domain_type(tmp_path, timeout=4)
    assert len(spawned) == 1 and "kvm" in spawned[0]
    files = list((tmp_path / "accel").iterdir())
    assert len(files) == 1
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert files[0].name.startswith(boot_id + "_")
    record = json.loads(files[0].read_text())
    assert ("kvm" if record["works"] else "qemu") == first
    mtime = files[0].stat().st_mtime_ns

    assert accel.domain_type(tmp_path, timeout=4) == first
    assert len(spawned) == 1  # no second qemu
    assert files[0].stat().st_mtime_ns == mtime

    # The cache decides: flip the record and the answer flips, still without a probe.
    files[0].write_text(json.dumps({**record, "works": not record["works"]}))
    assert accel.domain_type(tmp_path) == ("qemu" if first == "kvm" else "kvm")
    assert len(spawned) == 1

    # A record from an earlier boot is not read, and is removed when the new one is written.
    monkeypatch.setattr(accel, "probe_kvm", lambda qemu, timeout: (False, "stub"))
    stale = tmp_path / "accel" / "00000000-0000-0000-0000-000000000000_0.json"
    stale.write_text(json.dumps({"works": True}))
    files[0].unlink()
    assert accel.domain_type(tmp_path) == "qemu"
    assert not stale.exists() and files[0].exists()


@pytest.mark.parametrize(("value", "expected"), [("kvm", "kvm"), ("tcg", "qemu"), ("qemu", "qemu"), ("KVM", "kvm")])
def test_env_override(monkeypatch, tmp_path, value, expected):
    monkeypatch.setenv("DISKKIT_ACCEL", value)
    monkeypatch.setattr(accel, "probe_kvm", lambda *a, **k: pytest.fail("probed despite DISKKIT_ACCEL"))
    started = time.monotonic()
    assert accel.domain_type(tmp_path) == expected
    assert time.monotonic() - started < 1
    assert not (tmp_path / "accel").exists()


def test_env_override_rejects_nonsense(monkeypatch, tmp_path):
    monkeypatch.setenv("DISKKIT_ACCEL", "hvf")
    with pytest.raises(accel.DiskkitError, match="DISKKIT_ACCEL"):
        accel.domain_type(tmp_path)

"""hostDisk volumes need KubeVirt's HostDisk feature gate, and here also a directory the node's admin
allowed: without them a VMI could name any file on the node (/etc/shadow rendered and would have
been attached, chowned to qemu by libvirt and written by the guest).

KubeVirt's rule and words: pkg/virt-api/webhooks/validating-webhook/admitters/vmi-create-admitter.go
(validateVolumes: "HostDisk feature gate is not enabled", on the volume's index)."""

from __future__ import annotations

import os
import stat
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from launcher.spec.fields import SpecError
from launcher.spec.gates import FeatureGates, admit_host_disks, parse_gates
from launcher.spec.vmi import parse_vmi
from tests.conftest import run_launcher


def vmi_doc(path: str, kind: str = "Disk", capacity: str | None = None) -> dict:
    host = {"path": path, "type": kind, **({"capacity": capacity} if capacity else {})}
    return {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "hd"},
        "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}},
                            "devices": {"disks": [{"name": "scratch", "disk": {"bus": "virtio"}},
                                                  {"name": "host", "disk": {"bus": "virtio"}}]}},
                 "volumes": [{"name": "scratch", "emptyDisk": {"capacity": "16Mi"}}, {"name": "host", "hostDisk": host}]},
    }


def refusal(path: str, gates: FeatureGates) -> str:
    with pytest.raises(SpecError) as err:
        admit_host_disks(parse_vmi(vmi_doc(path)).volumes, gates)
    return err.value.line()


# ---------------------------------------------------------------- admission (pure)

def test_the_gate_is_off_by_default_with_kubevirts_words():
    assert refusal("/srv/disks/a.img", FeatureGates()) == "spec.volumes[1]: HostDisk feature gate is not enabled"


def test_with_the_gate_a_host_disk_must_lie_under_an_allowed_directory():
    gates = parse_gates(["HostDisk"], ["/srv/disks"])
    admit_host_disks(parse_vmi(vmi_doc("/srv/disks/a.img")).volumes, gates)  # allowed
    admit_host_disks(parse_vmi(vmi_doc("/srv/disks/vm1/a.img")).volumes, gates)  # below it, too
    assert refusal("/etc/shadow", gates) == (
        "spec.volumes[1].hostDisk.path: /etc/shadow is not under a directory allowed for hostDisks (--host-disk-dir: /srv/disks)")
    assert "is not under a directory" in refusal("/srv/disks-other/a.img", gates)  # a prefix is not a parent
    assert "is not under a directory" in refusal("/srv/disks", gates)  # the directory itself is no disk
    assert "(--host-disk-dir: none given)" in refusal("/srv/disks/a.img", parse_gates(["HostDisk"]))


@pytest.mark.parametrize("path", ["/srv/disks/../../etc/shadow", "/srv/disks/./a.img", "/srv//disks/a.img", "srv/disks/a.img"])
def test_relative_components_are_refused_before_the_directory_check(path):
    assert refusal(path, parse_gates(["HostDisk"], ["/srv/disks"])) == (
        "spec.volumes[1].hostDisk.path: must be an absolute path without relative components (., .., //)")


def test_gate_flags_are_checked():
    assert parse_gates(["HostDisk,", " HostDisk"]).on("HostDisk")
    with pytest.raises(SpecError, match=r"--feature-gates HostDsk: unknown feature gate \(this launcher knows HostDisk, Sidecar, DownwardMetrics, PersistentReservation\)"):
        parse_gates(["HostDsk"])
    with pytest.raises(SpecError, match="--host-disk-dir: allows hostDisk paths, which need --feature-gates HostDisk"):
        parse_gates([], ["/srv/disks"])
    for bad in ("/", "relative", "/srv/../etc"):
        with pytest.raises(SpecError, match="must be an absolute, clean path"):
            parse_gates(["HostDisk"], [bad])


# ---------------------------------------------------------------- the launcher, as root

@pytest.fixture
def secret_file(tmp_path) -> Path:
    """A root-only file outside every allowed directory: what an attacker's hostDisk points at."""
    target = tmp_path / "outside" / "secret.img"
    target.parent.mkdir()
    target.write_bytes(b"root's secret\n" + b"\0" * 4096)
    target.chmod(0o600)
    return target


def domain(tmp_path: Path, path: str, *flags: str, kind: str = "Disk", capacity: str | None = None):
    import json

    vmi = tmp_path / f"vmi-{abs(hash((path, flags)))}.json"
    vmi.write_text(json.dumps(vmi_doc(path, kind, capacity)))
    return run_launcher("domain", "--accel", "qemu", "--cache-dir", tmp_path / "cache", *flags, vmi)


def untouched(path: Path, before: os.stat_result, content: bytes) -> bool:
    after = os.lstat(path)
    return (after.st_uid, after.st_gid, stat.S_IMODE(after.st_mode)) == (before.st_uid, before.st_gid, stat.S_IMODE(before.st_mode)) \
        and path.read_bytes() == content


def test_a_host_file_is_refused_without_the_gate(tmp_path, secret_file):
    """The attack: a VMI naming any node file as a hostDisk (here a root-only 0600 one)."""
    before, content = os.lstat(secret_file), secret_file.read_bytes()
    result = domain(tmp_path, str(secret_file))
    assert result.code == 1
    assert result.err.strip() == "launcher: spec.volumes[1]: HostDisk feature gate is not enabled", result.err
    result = domain(tmp_path, str(secret_file), "--feature-gates", "HostDisk", "--host-disk-dir", str(tmp_path / "allowed"))
    assert result.code == 1 and "is not under a directory allowed for hostDisks" in result.err, result.err
    assert untouched(secret_file, before, content)


def test_symbolic_links_below_the_allowed_directory_are_never_followed(tmp_path, secret_file):
    """The attack: whoever can write in the allowed directory plants a link to a file outside it,
    as the disk itself or as a directory on the way."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "disk.img").symlink_to(secret_file)
    (allowed / "sub").symlink_to(secret_file.parent, target_is_directory=True)
    before, content = os.lstat(secret_file), secret_file.read_bytes()
    flags = ("--feature-gates", "HostDisk", "--host-disk-dir", str(allowed))
    for path in (allowed / "disk.img", allowed / "sub" / secret_file.name, allowed / "sub" / "new.img"):
        result = domain(tmp_path, str(path), *flags, kind="DiskOrCreate", capacity="1Mi")
        assert result.code == 1, result.out
        link = allowed / path.relative_to(allowed).parts[0]
        assert f"{link} is a symbolic link; a hostDisk path is never followed through links" in result.err, result.err
    assert untouched(secret_file, before, content)
    assert not (secret_file.parent / "new.img").exists()


def test_a_disk_under_the_allowed_directory_is_used(tmp_path):
    allowed = tmp_path / "allowed"
    (allowed / "vm1").mkdir(parents=True)
    disk = allowed / "vm1" / "data.img"
    disk.write_bytes(b"\0" * (1 << 20))
    result = domain(tmp_path, str(disk), "--feature-gates", "HostDisk", "--host-disk-dir", str(allowed))
    assert result.code == 0, result.err
    sources = [d.find("source").get("file") for d in ET.fromstring(result.out).iter("disk")]
    assert str(disk) in sources


def test_disk_or_create_without_capacity_uses_a_disk_that_exists_and_makes_none(tmp_path):
    # vmi-create-admitter.go admits a DiskOrCreate hostDisk without capacity (vmi-create-admitter_test.go:2284);
    # pkg/host-disk/host-disk.go creates a missing one of its capacity, a write at capacity - 1, which
    # fails at -1: the launcher says so before anything is made, and uses the disk when it is there.
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    flags = ("--feature-gates", "HostDisk", "--host-disk-dir", str(allowed))
    missing = allowed / "new.img"
    result = domain(tmp_path, str(missing), *flags, kind="DiskOrCreate")
    assert result.code == 1
    assert result.err.strip() == (f"launcher: spec.volumes[1].hostDisk.capacity: {missing} does not exist and a DiskOrCreate disk is"
                                  " made of its capacity, which is missing: KubeVirt fails the start (writeat: negative offset)"), result.err
    assert not missing.exists()
    present = allowed / "old.img"
    present.write_bytes(b"\0" * (1 << 20))
    result = domain(tmp_path, str(present), *flags, kind="DiskOrCreate")
    assert result.code == 0, result.err
    assert str(present) in [d.find("source").get("file") for d in ET.fromstring(result.out).iter("disk")]
    assert present.stat().st_size == 1 << 20

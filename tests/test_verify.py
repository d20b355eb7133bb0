"""diskkit verify and inspect on images made by others, and on hostile ones."""

from __future__ import annotations

import json
import tarfile

import pytest

from tests.conftest import make_qcow2, run
from tests.imagecraft import Member, dir_, layer_blob_paths, write_layout


@pytest.fixture
def disk_bytes(tmp_path) -> bytes:
    return make_qcow2(tmp_path / "src.qcow2", size="16M").read_bytes()


def verify(diskkit, layout, *extra):
    return diskkit("verify", *extra, f"oci:{layout}:t")


def test_umoci_built_image_with_root_owned_0600_disk_is_flagged(diskkit, tmp_path, disk_bytes):
    layout, staging = tmp_path / "layout", tmp_path / "staging" / "disk"
    staging.mkdir(parents=True)
    (staging / "vm.qcow2").write_bytes(disk_bytes)
    (staging / "vm.qcow2").chmod(0o600)
    run("umoci", "init", "--layout", layout)
    run("umoci", "new", "--image", f"{layout}:t")
    run("umoci", "insert", "--image", f"{layout}:t", staging, "/disk")
    result = verify(diskkit, layout)
    assert result.code == 8  # Exit.VERIFY_FAILED
    assert "/disk/vm.qcow2 is not readable by UID 107 (owner 0:0, mode 0600)" in result.err


def test_good_image_from_another_builder(diskkit, tmp_path, disk_bytes):
    layout = write_layout(tmp_path / "l", [[dir_("disk"), Member("disk/disk.img", disk_bytes, mode=0o444, uid=0, gid=0)]], docker_types=True)
    result = verify(diskkit, layout)
    assert result.code == 0, result.err
    assert "OK" in result.out and "qcow2" in result.out


def test_two_files_and_empty_folder(diskkit, tmp_path, disk_bytes):
    two = write_layout(tmp_path / "two", [[dir_("disk"), Member("disk/a.qcow2", disk_bytes), Member("disk/b.qcow2", disk_bytes)]])
    assert "more than one file found in folder /disk, only one disk is allowed" in verify(diskkit, two).err
    # Directories count as entries too, as in KubeVirt.
    with_dir = write_layout(tmp_path / "withdir", [[dir_("disk"), dir_("disk/sub"), Member("disk/a.qcow2", disk_bytes)]])
    assert "more than one file found in folder /disk" in verify(diskkit, with_dir).err
    empty = write_layout(tmp_path / "empty", [[dir_("disk")]])
    assert "no file found in folder /disk, no disk present" in verify(diskkit, empty).err


def test_whiteouts_across_layers(diskkit, tmp_path, disk_bytes):
    base = [dir_("disk"), Member("disk/old.qcow2", disk_bytes), Member("etc/os-release", b"ID=base\n", mode=0o644)]
    # The upper layer deletes the old disk and adds a new one: exactly one disk remains.
    upper = [Member("disk/.wh.old.qcow2"), Member("disk/new.qcow2", disk_bytes)]
    layout = write_layout(tmp_path / "wh", [base, upper])
    result = diskkit("verify", "--json", f"oci:{layout}:t")
    assert result.code == 0, result.out
    assert json.loads(result.out)["disk"]["path"] == "/disk/new.qcow2"
    # An opaque whiteout hides everything the lower layers had in /disk.
    opaque = write_layout(tmp_path / "opq", [base + [Member("disk/other.qcow2", disk_bytes)], [dir_("disk"), Member("disk/.wh..wh..opq"), Member("disk/only.qcow2", disk_bytes)]])
    out = json.loads(diskkit("verify", "--json", f"oci:{opaque}:t").out)
    assert out["ok"] and out["disk"]["path"] == "/disk/only.qcow2"


def test_hostile_members_are_reported_and_never_followed(diskkit, tmp_path, disk_bytes):
    layers = [[
        Member("../escape.txt", b"x"),
        Member("/abs/evil.txt", b"x"),
        dir_("disk"),
        Member("disk/link.qcow2", kind=tarfile.SYMTYPE, link="../../../../etc/passwd"),
    ]]
    layout = write_layout(tmp_path / "hostile", layers)
    result = verify(diskkit, layout)
    assert result.code == 8
    assert "'../escape.txt' in layer 0 escapes the image root" in result.err
    assert "'/abs/evil.txt' in layer 0 escapes the image root" in result.err
    assert "a symlink points outside the image root" in result.err
    assert "no image on path /disk/link.qcow2" in result.err
    hard = write_layout(tmp_path / "hard", [[dir_("disk"), Member("disk/h.qcow2", kind=tarfile.LNKTYPE, link="/etc/shadow")]])
    assert "hardlink 'disk/h.qcow2' in layer 0 points outside the image" in verify(diskkit, hard).err
    device = write_layout(tmp_path / "dev", [[dir_("disk"), Member("disk/sda", kind=tarfile.BLKTYPE)]])
    assert "/disk/sda is a device, not a regular file" in verify(diskkit, device).err


def test_symlink_and_hardlink_resolve_inside_the_image(diskkit, tmp_path, disk_bytes):
    layers = [[
        dir_("images"), Member("images/real.qcow2", disk_bytes),
        dir_("disk"), Member("disk/root.qcow2", kind=tarfile.SYMTYPE, link="/images/real.qcow2"),
    ]]
    layout = write_layout(tmp_path / "sym", layers)
    result = verify(diskkit, layout)
    assert result.code == 0, result.err
    hard = write_layout(tmp_path / "hard", [[dir_("images"), Member("images/real.qcow2", disk_bytes), dir_("vm"), Member("vm/disk.qcow2", kind=tarfile.LNKTYPE, link="images/real.qcow2")]])
    assert diskkit("verify", "--path", "/vm/disk.qcow2", f"oci:{hard}:t").code == 0


def test_unsafe_disks_inside_images(diskkit, tmp_path):
    backed = tmp_path / "backed.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", "-b", "/etc/passwd", "-F", "raw", backed)
    layout = write_layout(tmp_path / "b", [[dir_("disk"), Member("disk/d.qcow2", backed.read_bytes())]])
    assert "/disk/d.qcow2: expected no backing file, but found /etc/passwd" in verify(diskkit, layout).err
    vmdk = tmp_path / "d.vmdk"
    run("qemu-img", "create", "-q", "-f", "vmdk", vmdk, "8M")
    layout = write_layout(tmp_path / "v", [[dir_("disk"), Member("disk/d.vmdk", vmdk.read_bytes())]])
    assert "/disk/d.vmdk: unsupported image format: vmdk" in verify(diskkit, layout).err


def test_corrupted_layer_byte_fails_digest_check(diskkit, tmp_path, disk_bytes):
    layout = write_layout(tmp_path / "c", [[dir_("disk"), Member("disk/d.qcow2", disk_bytes)]])
    blob = layer_blob_paths(layout)[0]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    result = verify(diskkit, layout)
    assert result.code == 8
    assert "does not match its digest" in result.err


def test_inspect_reports_disk_facts_for_foreign_images(diskkit, tmp_path, disk_bytes):
    layout = write_layout(tmp_path / "i", [[dir_("disk"), Member("disk/disk.img", disk_bytes, mode=0o444, uid=107, gid=107)]], docker_types=True)
    result = diskkit("inspect", "--json", f"oci:{layout}:t")
    assert result.code == 0, result.err
    out = json.loads(result.out)
    assert out["mediaType"] == "application/vnd.docker.distribution.manifest.v2+json"
    assert out["disk"] == {"path": "/disk/disk.img", "format": "qcow2", "virtualSize": 16 << 20, "size": len(disk_bytes), "uid": 107, "gid": 107, "mode": "0444"}
    text = diskkit("inspect", f"oci:{layout}:t").out
    assert "owner:      107:107, mode 0444" in text

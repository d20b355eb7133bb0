"""Storage volumes beside the containerDisk, end to end with the real guest as the qemu user:
a filesystem PVC keeps what the guest wrote across VM re-creation, emptyDisk and containerDisk
start clean, hostDisk is created with its capacity."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from launcher.volumes import sizing
from tests.conftest import run
from tests.testguest import parse_console
from tests.vmhost import NOREG, QEMU_UID, assert_clean

MIB = 1 << 20


def _virtio(name: str, serial: str) -> dict:
    return {"name": name, "serial": serial, "disk": {"bus": "virtio"}}


def test_pvc_emptydisk_and_hostdisk_beside_the_containerdisk(qemu_user, guest_image):
    claim_dir = qemu_user.root / "claim-data"
    claim_dir.mkdir()
    os.chown(claim_dir, QEMU_UID, QEMU_UID)
    host_disk = qemu_user.root / "hostdisks" / "extra.img"
    host_disk.parent.mkdir()
    os.chown(host_disk.parent, QEMU_UID, QEMU_UID)
    extra = [
        (_virtio("data", "pvc-data"), {"name": "data", "persistentVolumeClaim": {"claimName": "data-claim"}}),
        (_virtio("scratch", "empty"), {"name": "scratch", "emptyDisk": {"capacity": "32Mi"}}),
        (_virtio("host", "host"), {"name": "host", "hostDisk": {"path": str(host_disk), "type": "DiskOrCreate", "capacity": "48Mi"}}),
    ]
    vmi = qemu_user.write_vmi("storage", guest_image, extra=extra)
    args = ["run", NOREG, "--console", "--timeout", "180", "--pvc", f"data-claim={claim_dir}:40Mi",
            "--feature-gates", "HostDisk", "--host-disk-dir", host_disk.parent, vmi]

    first = qemu_user.launcher(*args)
    assert first.code == 0, first.err
    console = parse_console(first.out)
    by_serial = {disk["serial"]: (name, disk) for name, disk in console["disks"].items()}
    assert by_serial["pvc-data"][1]["size"] == 40 * MIB
    assert by_serial["empty"][1]["size"] == 32 * MIB
    assert by_serial["host"][1]["size"] == 48 * MIB
    assert console["disks"]["vda"]["size"] == 64 * MIB  # the containerDisk, first in the spec
    assert all(stamp == (0, 1) for stamp in console["stamps"].values()), console["stamps"]
    image = claim_dir / "disk.img"
    assert image.stat().st_size == 40 * MIB and image.stat().st_blocks * 512 < 4 * MIB  # created sparse
    assert host_disk.stat().st_size == 48 * MIB
    assert_clean(qemu_user, "default_storage")

    second = qemu_user.launcher(*args)
    assert second.code == 0, second.err
    stamps = parse_console(second.out)["stamps"]
    names = {serial: name for serial, (name, _) in by_serial.items()}
    assert stamps[names["pvc-data"]] == (1, 2)  # the claim kept what the guest wrote
    assert stamps[names["host"]] == (1, 2)  # so does the host disk
    assert stamps[names["empty"]] == (0, 1)  # emptyDisk: new for every VM
    assert stamps["vda"] == (0, 1)  # containerDisk: the overlay went with the VM


def test_missing_claim_and_disk_fail_before_any_domain(qemu_user, guest_image):
    extra = [(_virtio("data", "d"), {"name": "data", "persistentVolumeClaim": {"claimName": "nowhere"}})]
    vmi = qemu_user.write_vmi("noclaim", guest_image, extra=extra)
    result = qemu_user.launcher("run", NOREG, vmi)
    assert result.code == 1
    assert "spec.volumes[1].persistentVolumeClaim: claim nowhere: give --pvc nowhere=DIR|DEVICE" in result.err, result.err
    assert_clean(qemu_user, "default_noclaim")
    extra = [(_virtio("host", "h"), {"name": "host", "hostDisk": {"path": str(qemu_user.root / "absent.img"), "type": "Disk"}})]
    vmi = qemu_user.write_vmi("nohost", guest_image, extra=extra)
    result = qemu_user.launcher("run", NOREG, "--feature-gates", "HostDisk", "--host-disk-dir", qemu_user.root, vmi)
    assert result.code == 1 and "does not exist (type Disk)" in result.err, result.err
    assert_clean(qemu_user, "default_nohost")


@pytest.fixture
def loop_device(qemu_user):
    """A 24 MiB block device the qemu user owns, as a block-mode PVC is handed to virt-launcher."""
    backing = qemu_user.root / "block-claim.img"
    with open(backing, "wb") as f:
        f.truncate(24 * MIB)
    device = run("losetup", "--find", "--show", backing).stdout.strip()
    try:
        os.chown(device, QEMU_UID, QEMU_UID)
        yield Path(device)
    finally:
        run("losetup", "--detach", device)


def test_block_mode_claim_keeps_what_the_guest_wrote(qemu_user, guest_image, loop_device):
    extra = [(_virtio("data", "block-data"), {"name": "data", "persistentVolumeClaim": {"claimName": "raw-claim"}})]
    vmi = qemu_user.write_vmi("blockpvc", guest_image, extra=extra)
    args = ["run", NOREG, "--console", "--timeout", "180", "--pvc", f"raw-claim={loop_device}", vmi]
    first = qemu_user.launcher(*args)
    assert first.code == 0, first.err
    console = parse_console(first.out)
    (name, disk), = [(n, d) for n, d in console["disks"].items() if d["serial"] == "block-data"]
    assert disk["size"] == 24 * MIB
    assert console["stamps"][name] == (0, 1)
    second = qemu_user.launcher(*args)
    assert second.code == 0, second.err
    assert parse_console(second.out)["stamps"][name] == (1, 2)  # written to the device itself
    assert_clean(qemu_user, "default_blockpvc")


def test_a_block_claim_as_ephemeral_base_and_with_matched_block_sizes(qemu_user, guest_image, loop_device):
    # converter.go SetDriverCacheMode: the overlay over a block device is writethrough (the backing store's
    # file probe finds no file); storage/disk.go getOptimalBlockIOForDevice: the device's own sizes.
    import xml.etree.ElementTree as ET

    extra = [({"name": "scratch", "disk": {"bus": "virtio"}}, {"name": "scratch", "ephemeral": {"persistentVolumeClaim": {"claimName": "raw-claim"}}}),
             ({"name": "direct", "disk": {"bus": "virtio"}, "blockSize": {"matchVolume": {}}},
              {"name": "direct", "persistentVolumeClaim": {"claimName": "raw-claim"}})]
    vmi = qemu_user.write_vmi("blockeph", guest_image, extra=extra)
    result = qemu_user.launcher("domain", NOREG, "--pvc", f"raw-claim={loop_device}", vmi)
    assert result.code == 0, result.err
    disks = {d.find("alias").get("name"): d for d in ET.fromstring(result.out).iter("disk")}
    assert disks["ua-scratch"].find("driver").get("cache") == "writethrough"
    assert disks["ua-scratch"].find("backingStore/source").get("dev") == str(loop_device)
    blockio = disks["ua-direct"].find("blockio")
    sysfs = Path("/sys/class/block") / loop_device.name / "queue"
    assert (blockio.get("logical_block_size"), blockio.get("physical_block_size")) == (
        (sysfs / "logical_block_size").read_text().strip(), (sysfs / "physical_block_size").read_text().strip())


def test_claim_on_a_small_filesystem_is_tolerated_or_refused(qemu_user, guest_image):
    mount = qemu_user.root / "small-claim"
    mount.mkdir()
    run("mount", "-t", "tmpfs", "-o", "size=16m,mode=0755,uid=107,gid=107", "tmpfs", mount)
    try:
        extra = [(_virtio("data", "small"), {"name": "data", "persistentVolumeClaim": {"claimName": "small"}})]
        vmi = qemu_user.write_vmi("smallpvc", guest_image, extra=extra)
        refused = qemu_user.launcher("run", NOREG, "--pvc", f"small={mount}:64Mi", vmi)
        assert refused.code == 1
        # pkg/host-disk/host-disk.go shrinkRequestedSize, naming the image it would have made
        assert f"unable to create {mount / 'disk.img'}, not enough space, demanded size 67108864 B" in refused.err, refused.err
        assert list(mount.iterdir()) == []  # no image, not even a temporary one
        assert_clean(qemu_user, "default_smallpvc")
        # 17 MiB asked of 16 MiB: within the 10 % KubeVirt tolerates, so the disk is what fits.
        tolerated = qemu_user.launcher("run", NOREG, "--console", "--timeout", "180", "--pvc", f"small={mount}:17Mi", vmi)
        assert tolerated.code == 0, tolerated.err
        assert f"PV size too small: expected {17 * MIB} B, found {16 * MIB - sizing.RESERVE} B" in tolerated.err, tolerated.err
        size = (mount / "disk.img").stat().st_size
        assert size == 16 * MIB - sizing.RESERVE  # all the free space but KubeVirt's reserve
        (name, disk), = [(n, d) for n, d in parse_console(tolerated.out)["disks"].items() if d["serial"] == "small"]
        assert disk["size"] == size
    finally:
        run("umount", mount)
    assert_clean(qemu_user, "default_smallpvc")

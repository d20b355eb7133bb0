"""`launcher run --container-disk-dir DIR`: the containerDisks a pod mounts as Kubernetes image volumes,
in KubeVirt 1.9's layout (DIR/disk_<index in spec.volumes>, addContainerDiskVolumeMount in
pkg/virt-controller/services/rendervolumes.go), found by virt-launcher's rules (findDiskFileInImageVolume
in pkg/virt-launcher/virtwrap/manager.go: containerDisk.path, else a lone file at the root, else the lone
entry of /disk) and used as the overlay's read-only backing file, with nothing pulled.

The directories stand in for what the kubelet mounts: images unpacked by umoci, as a runtime unpacks
them, and files laid out by hand for the refusals."""

from __future__ import annotations

import json
import os
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.conftest import make_qcow2, run, run_diskkit, run_launcher
from tests.testguest import KERNEL_CMDLINE, ensure_testguest, parse_console

NOWHERE = "127.0.0.1:9/nowhere/guest:v1"  # no registry answers there: a pull would fail


def _unpacked(at: Path, layout: Path) -> Path:
    """The image's root filesystem as a runtime unpacks it (owners and modes kept)."""
    bundle = at.parent / f"{at.name}-bundle"
    run("umoci", "unpack", "--image", f"{layout}:v1", bundle)
    (bundle / "rootfs").rename(at)
    shutil.rmtree(bundle)
    return at


@pytest.fixture(scope="module")
def guest_layout(qemu_user) -> Path:
    layout = qemu_user.root / "iv-layout"
    result = run_diskkit("build", "--no-lazy", ensure_testguest() / "testguest-poweroff.qcow2", "-t", f"oci:{layout}:v1")
    assert result.code == 0, result.err
    return layout


def _mounts(qemu_user, name: str) -> Path:
    mounts = qemu_user.root / name
    mounts.mkdir()
    return mounts


def _domain(qemu_user, vmi: Path, mounts: Path):
    return qemu_user.launcher("domain", "--container-disk-dir", mounts, vmi)


def _backing_files(xml: str) -> list[str]:
    return [source.get("file") for source in ET.fromstring(xml).findall("./devices/disk/backingStore/source")]


def test_boot_from_the_pods_image_volumes_without_a_pull(qemu_user, guest_layout):
    mounts = _mounts(qemu_user, "iv-boot")
    _unpacked(mounts / "disk_0", guest_layout)  # a classic containerDisk: its disk in /disk
    # An ORAS-style artifact: one file at the image's root (CRI-O mounts one file per layer).
    artifact = mounts / "disk_1"
    artifact.mkdir()
    data = artifact / "data.raw"
    data.write_bytes(b"IMAGEVOLUME-DATA" + bytes((8 << 20) - 16))
    # The kernelBoot container's image, mounted where KubeVirt mounts it (VirtKernelBootVolumeDir).
    kernel_dir = qemu_user.root / "iv-kernel"
    (kernel_dir / "boot").mkdir(parents=True)
    for name in ("vmlinuz", "initrd.img"):
        shutil.copy(ensure_testguest() / name, kernel_dir / "boot" / name)
    run("chmod", "-R", "a+rX", mounts, kernel_dir)
    firmware = {"kernelBoot": {"kernelArgs": KERNEL_CMDLINE, "container": {
        "image": "127.0.0.1:9/nowhere/kernel:v1", "kernelPath": "/boot/vmlinuz", "initrdPath": "/boot/initrd.img"}}}
    vmi = qemu_user.write_vmi("imagevol", NOWHERE, domain={"firmware": firmware},
                              extra=[({"name": "data", "disk": {"bus": "virtio"}}, {"name": "data", "containerDisk": {"image": "127.0.0.1:9/nowhere/data:v1"}})])
    # As a VirtualMachine with a pin from an earlier run: the kubelet resolved what the pod mounts, and
    # the pin stays as it was for a run that pulls again.
    doc = json.loads(vmi.read_text())
    vmi.write_text(json.dumps({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "imagevol"},
                               "spec": {"runStrategy": "Always", "template": {"spec": doc["spec"]}}}))
    assert qemu_user.launcher("ls").code == 0  # the cache and its pins/ directory, the qemu user's
    pin_file = qemu_user.cache / "pins" / "default_imagevol.json"
    pin_file.write_text(json.dumps({"domain": "default_imagevol", "volumes": {"root": {
        "image": NOWHERE, "pinned": NOWHERE.replace(":v1", "@sha256:" + "cd" * 32), "digest": "sha256:" + "cd" * 32,
        "platform": "linux/amd64", "since": 0}}}))
    pinned = json.loads(pin_file.read_text())["volumes"]
    planned = qemu_user.launcher("domain", "--container-disk-dir", mounts, "--kernel-boot-dir", kernel_dir, vmi)
    assert planned.code == 0, planned.err
    assert ET.fromstring(planned.out).find("./os/kernel").text == str(kernel_dir / "boot" / "vmlinuz")
    assert ET.fromstring(planned.out).find("./os/initrd").text == str(kernel_dir / "boot" / "initrd.img")
    result = qemu_user.launcher("run", "--container-disk-dir", mounts, "--kernel-boot-dir", kernel_dir, "--console", "--timeout", "180", vmi)
    assert result.code == 0, result.err
    console = parse_console(result.out)
    assert console["disks"]["vda"]["size"] == 64 << 20
    assert console["disks"]["vda"]["head"].startswith("33c0")  # the guest's own MBR
    assert console["disks"]["vdb"]["size"] == 8 << 20
    assert bytes.fromhex(console["disks"]["vdb"]["head"]).startswith(b"IMAGEVOLUME-DATA")
    assert console["stamps"]["vda"] == (0, 1)  # the guest wrote: into its overlay...
    assert data.read_bytes()[-512:] == bytes(512)  # ...never into the mounted image
    listing = json.loads(qemu_user.launcher("ls", "--json").out)
    assert listing["disks"] == []  # nothing was pulled into the cache
    assert json.loads(pin_file.read_text())["volumes"] == pinned


def test_the_disk_is_found_by_kubevirts_rules_and_links_stay_inside_the_image(qemu_user):
    mounts = _mounts(qemu_user, "iv-rules")
    disk_dir = mounts / "disk_0" / "disk"
    disk_dir.mkdir(parents=True)
    (mounts / "disk_0" / "images").mkdir()
    real = make_qcow2(mounts / "disk_0" / "images" / "real.qcow2", "16M")
    # An absolute link means the image's root, as inside the container.
    (disk_dir / "disk.qcow2").symlink_to("/images/real.qcow2")
    vmi = qemu_user.write_vmi("rules", NOWHERE)
    result = _domain(qemu_user, vmi, mounts)
    assert result.code == 0, result.err
    assert _backing_files(result.out) == [str(real)]  # the link-free path, walked by name
    # containerDisk.path picks the file itself.
    (mounts / "disk_0" / "images" / "other.qcow2").write_bytes(real.read_bytes())
    with_path = qemu_user.write_vmi("rules-path", NOWHERE, path="/images/other.qcow2")
    result = _domain(qemu_user, with_path, mounts)
    assert result.code == 0, result.err
    assert _backing_files(result.out) == [str(mounts / "disk_0" / "images" / "other.qcow2")]


def _refused(qemu_user, mounts: Path, vmi: Path, *expected: str) -> None:
    result = _domain(qemu_user, vmi, mounts)
    assert result.code != 0, result.out
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert lines[0].startswith("launcher: spec.volumes[0].containerDisk"), lines[0]
    for text in expected:
        assert text in lines[0], lines[0]


def test_refusals_name_the_volume_and_kubevirts_rule(qemu_user, tmp_path):
    vmi = qemu_user.write_vmi("refused", NOWHERE)
    mounts = _mounts(qemu_user, "iv-refused")
    _refused(qemu_user, mounts, vmi, "failed to find disk file from ImageVolume: failed to read image volume directory",
             str(mounts / "disk_0"))

    root = mounts / "disk_0"
    (root / "disk").mkdir(parents=True)
    (root / "etc").mkdir()
    _refused(qemu_user, mounts, vmi, f"could not determine disk file in {root / 'disk'} (expected exactly one non-directory entry, found 0)")
    make_qcow2(root / "disk" / "a.qcow2", "16M")
    make_qcow2(root / "disk" / "b.qcow2", "16M")
    _refused(qemu_user, mounts, vmi, "(expected exactly one non-directory entry, found 2)")
    (root / "disk" / "b.qcow2").unlink()
    shutil.rmtree(root / "disk")
    _refused(qemu_user, mounts, vmi, f"could not determine disk file in image volume root {root} (found 1 entries, no disk directory)")

    # A link leading out of the image: refused, whatever is there.
    outside = make_qcow2(qemu_user.root / "outside.qcow2", "16M")
    (root / "disk").mkdir()
    (root / "disk" / "disk.qcow2").symlink_to("../../../outside.qcow2")
    _refused(qemu_user, mounts, vmi, "leads out of the image volume")
    # Root (the launcher of a pod without runAsUser, or of a node) follows it no further.
    as_root = run_launcher("domain", "--container-disk-dir", mounts, vmi, env={"DISKKIT_CACHE": str(tmp_path / "root-cache")})
    assert as_root.code != 0 and "leads out of the image volume" in as_root.err, as_root.err
    assert outside.exists()
    (root / "disk" / "disk.qcow2").unlink()
    (root / "disk" / "disk.qcow2").symlink_to("loop")
    (root / "disk" / "loop").symlink_to("disk.qcow2")
    # Two entries in /disk already; the loop is what a path to it meets.
    loop_vmi = qemu_user.write_vmi("refused-loop", NOWHERE, path="/disk/loop")
    _refused(qemu_user, mounts, loop_vmi, "too many levels of symbolic links")
    for name in ("disk.qcow2", "loop"):
        (root / "disk" / name).unlink()

    # Not a disk KubeVirt boots: a qcow2 naming a backing file of the host, a FIFO.
    base = make_qcow2(tmp_path / "host-base.qcow2", "16M")
    run("qemu-img", "create", "-q", "-f", "qcow2", "-b", base, "-F", "qcow2", root / "disk" / "disk.qcow2")
    _refused(qemu_user, mounts, vmi, "backing")
    (root / "disk" / "disk.qcow2").unlink()
    os.mkfifo(root / "disk" / "disk.qcow2")
    _refused(qemu_user, mounts, vmi, "is not a regular file")
    # A kernelBoot artifact behind a link out of its image: refused too.
    kernel_dir = qemu_user.root / "iv-kernel-out"
    kernel_dir.mkdir()
    (kernel_dir / "vmlinuz").symlink_to("../outside.qcow2")
    firmware = {"kernelBoot": {"container": {"image": NOWHERE, "kernelPath": "/vmlinuz"}}}
    boot_vmi = qemu_user.write_vmi("refused-kernel", NOWHERE, domain={"firmware": firmware})
    good = _mounts(qemu_user, "iv-kernel-disk")
    (good / "disk_0" / "disk").mkdir(parents=True)
    make_qcow2(good / "disk_0" / "disk" / "disk.qcow2", "16M")
    refused = qemu_user.launcher("domain", "--kernel-boot-dir", kernel_dir, "--container-disk-dir", good, boot_vmi)
    assert refused.code != 0
    assert refused.err.startswith("launcher: spec.domain.firmware.kernelBoot.container.kernelPath: ") and "leads out" in refused.err, refused.err
    assert "error getting kernel boot artifact path from ImageVolume" in refused.err
    # A bad containerDisk.path is refused as KubeVirt's admission does.
    _refused(qemu_user, mounts, qemu_user.write_vmi("refused-path", NOWHERE, path="/disk/../etc"), "relative components")

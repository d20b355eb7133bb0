"""A VirtualMachine keeps booting the digest its containerDisk tag named on its first run (KubeVirt
issue #15967: the tag moved between a shutdown and the next boot), until `launcher run --update`.

KubeVirt itself resolves tags to digests only for a migration's target pod (ExtractImageIDsFromSourcePod
in pkg/container-disk/container-disk.go); the pinned form is its toImageWithDigest's."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import pytest

from launcher.node.pins import pinnable, with_digest
from tests.conftest import run, run_diskkit
from tests.testguest import ensure_testguest, parse_console
from tests.vmhost import NOREG

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize("image, pinned", [
    ("quay.io/containerdisks/fedora:40", f"quay.io/containerdisks/fedora@{DIGEST}"),
    ("localhost:5000/disks/guest:v1", f"localhost:5000/disks/guest@{DIGEST}"),  # the port's colon is no tag
    ("localhost:5000/disks/guest", f"localhost:5000/disks/guest@{DIGEST}"),
    ("docker://registry.example/a/b:t", f"docker://registry.example/a/b@{DIGEST}"),
    ("fedora:40", f"fedora@{DIGEST}"),  # a short name stays one: registries.conf resolves it as before
])
def test_the_pinned_reference_is_the_repository_at_the_digest(image, pinned):
    assert pinnable(image)
    assert with_digest(image, DIGEST) == pinned


@pytest.mark.parametrize("image", [f"quay.io/a/b@{DIGEST}", f"quay.io/a/b:t@{DIGEST}", "oci:/srv/layout:v1", "oci-archive:/x.tar"])
def test_digests_and_local_images_are_not_pinned(image):
    assert not pinnable(image)


def _build(source, ref: str) -> str:
    result = run_diskkit("build", NOREG, "--no-lazy", source, "-t", ref)
    assert result.code == 0, result.err
    return re.findall(r"sha256:[0-9a-f]{64}", result.out)[-1]


def _vm(qemu_user, name: str, image: str, policy: str | None = None):
    """A VirtualMachine (runStrategy Always) whose template is the test VMI booting `image`."""
    vmi = qemu_user.write_vmi(name, image)
    doc = json.loads(vmi.read_text())
    if policy:
        doc["spec"]["volumes"][0]["containerDisk"]["imagePullPolicy"] = policy
    vm = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": name},
          "spec": {"runStrategy": "Always", "template": {"metadata": {}, "spec": doc["spec"]}}}
    vmi.write_text(json.dumps(vm, indent=2))
    return vmi


def _backing(qemu_user, vm, *flags) -> str:
    """The base disk `launcher run` would put under the VM's overlay (the dry run's domain XML)."""
    result = qemu_user.launcher("domain", NOREG, *flags, vm)
    assert result.code == 0, result.err
    source = ET.fromstring(result.out).find("./devices/disk/backingStore/source")
    return source.get("file")


def _pins(qemu_user) -> dict:
    listing = qemu_user.launcher("ls", "--json")
    assert listing.code == 0, listing.err
    return {(pin["vm"], pin["volume"]): pin for pin in json.loads(listing.out)["pins"]}


def test_a_moved_tag_boots_the_pinned_digest_until_update(qemu_user, registry, tmp_path):
    bigger = tmp_path / "bigger.qcow2"
    run("qemu-img", "convert", "-O", "qcow2", ensure_testguest() / "testguest-poweroff.qcow2", bigger)
    run("qemu-img", "resize", bigger, "96M")
    tag = f"{registry.host}/pins/guest:t"
    first = _build(ensure_testguest() / "testguest-poweroff.qcow2", tag)
    # Always: without the pin each boot would ask the registry where the tag is (IfNotPresent would
    # keep the node's first answer, pinned or not).
    vm = _vm(qemu_user, "pinned", tag, policy="Always")

    booted = qemu_user.launcher("run", NOREG, "--console", "--timeout", "180", vm)
    assert booted.code == 0, booted.err
    assert parse_console(booted.out)["disks"]["vda"]["size"] == 64 << 20
    pin = _pins(qemu_user)[("default_pinned", "root")]
    assert (pin["image"], pin["digest"]) == (tag, first)
    assert pin["pinned"] == f"{registry.host}/pins/guest@{first}"
    listing = qemu_user.launcher("ls").out
    assert "default_pinned root" in listing and first in listing
    base_first = _backing(qemu_user, vm)

    moved = _build(bigger, tag)  # the tag moves while the VM is down
    assert moved != first
    # The next run boots the first image still, and says why.
    again = qemu_user.launcher("run", NOREG, "--console", "--timeout", "180", vm)
    assert again.code == 0, again.err
    assert parse_console(again.out)["disks"]["vda"]["size"] == 64 << 20
    assert f"note: {tag} boots {first}, the digest it named at this VirtualMachine's first run" in again.err, again.err
    assert _backing(qemu_user, vm) == base_first  # the dry run resolves as the run does
    # ...where a VirtualMachineInstance of the same tag, which KubeVirt makes afresh, asks the registry.
    vmi = qemu_user.write_vmi("unpinned", tag)
    doc = json.loads(vmi.read_text())
    doc["spec"]["volumes"][0]["containerDisk"]["imagePullPolicy"] = "Always"
    vmi.write_text(json.dumps(doc))
    assert _backing(qemu_user, vmi) != base_first
    # --update boots where the tag is now and pins that.
    assert _backing(qemu_user, vm, "--update") != base_first
    assert _pins(qemu_user)[("default_pinned", "root")]["digest"] == first  # a dry run pins nothing
    updated = qemu_user.launcher("run", NOREG, "--update", "--console", "--timeout", "180", vm)
    assert updated.code == 0, updated.err
    assert parse_console(updated.out)["disks"]["vda"]["size"] == 96 << 20
    assert _pins(qemu_user)[("default_pinned", "root")]["digest"] == moved
    assert _backing(qemu_user, vm) != base_first


def test_a_changed_image_in_the_spec_is_resolved_afresh(qemu_user, registry):
    tag = f"{registry.host}/pins/other:a"
    _build(ensure_testguest() / "testguest-poweroff.qcow2", tag)
    vm = _vm(qemu_user, "respec", f"{registry.host}/pins/guest-gone:a")
    # A pin left by an earlier spec naming another image: it is not this image's, so it is not used.
    assert qemu_user.launcher("ls").code == 0  # the cache and its pins/ directory, the qemu user's
    (qemu_user.cache / "pins" / "default_respec.json").write_text(json.dumps({"domain": "default_respec", "volumes": {"root": {
        "image": f"{registry.host}/pins/guest-gone:a", "pinned": f"{registry.host}/pins/guest-gone@{DIGEST}", "digest": DIGEST,
        "platform": "linux/amd64", "since": 0}}}))
    missing = qemu_user.launcher("domain", NOREG, vm)
    assert missing.code != 0
    # The pinned digest is gone from the registry: the refusal says how to move on.
    assert "launcher run --update resolves the tag again" in missing.err, missing.err
    assert len(missing.err.strip().splitlines()) == 1, missing.err
    doc = json.loads(vm.read_text())
    doc["spec"]["template"]["spec"]["volumes"][0]["containerDisk"]["image"] = tag
    vm.write_text(json.dumps(doc))
    assert qemu_user.launcher("domain", NOREG, vm).code == 0
    with_update = qemu_user.launcher("domain", NOREG, "--update", vm)
    assert with_update.code == 0, with_update.err
    # The pin file names another image: it stays as it was, a dry run writes none.
    assert json.loads((qemu_user.cache / "pins" / "default_respec.json").read_text())["volumes"]["root"]["digest"] == DIGEST


def test_the_kernel_boot_image_is_pinned_too(qemu_user, registry, tmp_path):
    # KubeVirt keys the kernelBoot container's image beside the containerDisks' (KernelBootVolumeName,
    # pkg/container-disk/container-disk.go); the launcher pins it under that name.
    other = tmp_path / "testguest-poweroff.qcow2"  # the same name in /disk, other bytes
    run("qemu-img", "convert", "-O", "qcow2", ensure_testguest() / "testguest-poweroff.qcow2", other)
    run("qemu-img", "resize", other, "80M")
    tag = f"{registry.host}/pins/kernel:k"
    first = _build(ensure_testguest() / "testguest-poweroff.qcow2", tag)
    _build(other, tag)
    vm = _vm(qemu_user, "kernelpin", tag)
    doc = json.loads(vm.read_text())
    # Any file serves a dry run as the kernel: the domain shows which image's file it would boot.
    doc["spec"]["template"]["spec"]["domain"]["firmware"] = {"kernelBoot": {"container": {"image": tag, "kernelPath": "/disk/testguest-poweroff.qcow2"}}}
    vm.write_text(json.dumps(doc))
    assert qemu_user.launcher("ls").code == 0  # the cache and its pins/ directory, the qemu user's
    (qemu_user.cache / "pins" / "default_kernelpin.json").write_text(json.dumps({"domain": "default_kernelpin", "volumes": {
        "kernel-boot-volume": {"image": tag, "pinned": f"{registry.host}/pins/kernel@{first}", "digest": first,
                               "platform": "linux/amd64", "since": 0}}}))

    def kernel_and_root(*flags):
        result = qemu_user.launcher("domain", NOREG, *flags, vm)
        assert result.code == 0, result.err
        xml = ET.fromstring(result.out)
        return xml.find("./os/kernel").text, xml.find("./devices/disk/backingStore/source").get("file")

    kernel, root = kernel_and_root()
    assert kernel != root  # the root disk's tag (not pinned yet) is the second image; the kernel's pin the first
    kernel, root = kernel_and_root("--update")
    assert kernel == root  # one layer's file, whether pulled as the disk or as the kernel

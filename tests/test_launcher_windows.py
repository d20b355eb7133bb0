"""What moves Windows guests onto KubeVirt, with the real guest as the qemu user: a persistent TPM and
persistent EFI variables kept from one run of a VirtualMachine to the next, a sysprep answer file on a
CD-ROM, and Hyper-V enlightenments and paravirtual timers, which emulation (TCG) runs without and says so.

One VirtualMachine boots twice through EFI (OVMF, a kernelBoot container: the test guest's disk boots
by BIOS only), each run a full boot and power-off; a bare VMI with KubeVirt's default TPM boots once by
BIOS. Every check reads those three consoles. The TPM's state is swtpm's, kept by libvirt per domain
UUID under the qemu user's session daemon (its HOME here); the EFI variables are the VM's own store in
the cache's state/ (launcher.volumes.vmstate).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from launcher.spec.meta import domain_name
from launcher.spec.vmi import parse_vmi
from launcher.volumes import vmstate
from tests.conftest import run
from tests.testguest import KERNEL_CMDLINE, ensure_testguest, parse_console
from tests.vmhost import assert_clean

UNATTEND = "<?xml version=\"1.0\"?>\n<unattend xmlns=\"urn:schemas-microsoft-com:unattend\"/>\n"
NOWHERE = "127.0.0.1:9/nowhere/guest:v1"  # never pulled: the pod's image volumes are used
VM_UUID = "5d307ca9-b3ef-428c-8861-06e72d69f223"


def _vm(name: str, kernel: bool, domain: dict, volumes: list, disks: list) -> dict:
    devices = {**domain.pop("devices", {}), "disks": [{"name": "root", "disk": {"bus": "virtio"}}, *disks]}
    spec = {"domain": {"resources": {"requests": {"memory": "256Mi"}}, "devices": devices, **domain},
            "volumes": [{"name": "root", "containerDisk": {"image": NOWHERE}}, *volumes]}
    if kernel:
        spec["domain"].setdefault("firmware", {})["kernelBoot"] = {"kernelArgs": KERNEL_CMDLINE, "container": {
            "image": "127.0.0.1:9/nowhere/kernel:v1", "kernelPath": "/boot/vmlinuz", "initrdPath": "/boot/initrd.img"}}
    return spec


WINDOWS_VM = {
    "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "win"},
    "spec": {"runStrategy": "Always", "template": {"spec": _vm(
        "win", True,
        {"firmware": {"uuid": VM_UUID, "bootloader": {"efi": {"secureBoot": False, "persistent": True}}},
         "features": {"acpi": {}, "apic": {}, "hyperv": {"relaxed": {}, "vapic": {}, "spinlocks": {"spinlocks": 8191}, "synic": {}}},
         "clock": {"utc": {}, "timer": {"hpet": {"present": False}, "hyperv": {}, "kvm": {}, "pit": {"tickPolicy": "delay"},
                                        "rtc": {"tickPolicy": "catchup"}}},
         "devices": {"tpm": {"persistent": True}}},
        [{"name": "answers", "sysprep": {"secret": {"name": "unattend"}}}],
        # the cloud kernel has no AHCI: the answer file's CD-ROM on virtio-scsi
        [{"name": "answers", "cdrom": {"bus": "scsi"}}])}},
}
# The bare VMI also carries a hook sidecar (launcher.runtime.hooks): the user guide's Python onDefineDomain
# script (docs/user_workloads/hook-sidecar.md, its /tmp files included), giving the root disk a serial
# the guest reports.
HOOK_SERIAL = "hooked-by-sidecar"
HOOK_SCRIPT = f"""#!/usr/bin/env python3
import xml.etree.ElementTree as ET
import sys

def main(s):
    f = open("/tmp/orig.xml", "w")
    f.write(s)
    f.close()
    xml = ET.parse("/tmp/orig.xml")
    disk = xml.getroot().find("devices").find("disk")
    element = ET.Element("serial")
    element.text = "{HOOK_SERIAL}"
    disk.insert(0, element)
    xml.write("/tmp/new.xml")
    f = open("/tmp/new.xml")
    print(f.read())
    f.close()

if __name__ == "__main__":
    main(sys.argv[4])
"""
PLAIN_TPM_VMI = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                 "metadata": {"name": "tis", "annotations": {"hooks.kubevirt.io/hookSidecars": json.dumps([{
                     "args": ["--version", "v1alpha2"],
                     "configMap": {"name": "my-config-map", "key": "my_script.sh", "hookPath": "/usr/bin/onDefineDomain"}}])}},
                 "spec": _vm("tis", False, {"devices": {"tpm": {}}}, [], [])}


@pytest.fixture(scope="module")
def booted(qemu_user):
    """Two runs of the Windows-shaped VirtualMachine, one of the bare VMI: (stdout, stderr) of each, and
    what the VM's state held after its first run."""
    guest = ensure_testguest()
    mounts = qemu_user.root / "win-mounts"
    (mounts / "disk_0" / "disk").mkdir(parents=True)
    shutil.copy(guest / "testguest-poweroff.qcow2", mounts / "disk_0" / "disk" / "testguest.qcow2")  # each run ends by itself
    kernel_dir = qemu_user.root / "win-kernel"
    (kernel_dir / "boot").mkdir(parents=True)
    for name in ("vmlinuz", "initrd.img"):
        shutil.copy(guest / name, kernel_dir / "boot" / name)
    manifests = qemu_user.root / "win-manifests"
    manifests.mkdir()
    (manifests / "unattend.json").write_text(json.dumps({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "unattend"},
        "stringData": {"autounattend.xml": UNATTEND, "setup.cmd": "echo setup\n"}}))
    (manifests / "hook.json").write_text(json.dumps({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "my-config-map"}, "data": {"my_script.sh": HOOK_SCRIPT}}))
    run("chmod", "-R", "a+rX", mounts, kernel_dir, manifests)
    vm = qemu_user.root / "win.json"
    vm.write_text(json.dumps(WINDOWS_VM))
    vmi = qemu_user.root / "tis.json"
    vmi.write_text(json.dumps(PLAIN_TPM_VMI))
    flags = ("--container-disk-dir", mounts, "--kernel-boot-dir", kernel_dir, "--manifests", manifests, "--feature-gates", "Sidecar",
             "--console", "--timeout", "400")
    runs = {}
    runs["first"] = qemu_user.launcher("run", *flags, vm, timeout=450)
    store = vmstate.state_dir(qemu_user.cache, parse_vmi(WINDOWS_VM)) / "win_VARS.fd"
    kept = {"store": store.exists(), "tpm": sorted(p.name for p in _tpm_state(qemu_user).glob("*"))}
    runs["second"] = qemu_user.launcher("run", *flags, vm, timeout=450)
    runs["bare"] = qemu_user.launcher("run", *flags, vmi, timeout=300)
    return runs, kept


def _tpm_state(qemu_user, uuid: str = VM_UUID) -> Path:
    # libvirt's session daemon: $XDG_CONFIG_HOME/libvirt/qemu/swtpm/<domain uuid>/tpm2
    return qemu_user.home / ".config" / "libvirt" / "qemu" / "swtpm" / uuid / "tpm2"


def _console(result) -> dict:
    assert result.code == 0, result.err
    return parse_console(result.out)


def test_a_linux_guest_sees_the_tpm(booted):
    # compute/tpm.go: a persistent TPM is tpm-crb, KubeVirt's default one tpm-tis; both TPM 2.0 through swtpm
    runs, _ = booted
    assert _console(runs["first"])["tpm"]["version"] == "2"
    assert _console(runs["first"])["tpm"]["driver"] == "tpm_crb"
    assert _console(runs["bare"])["tpm"]["driver"] == "tpm_tis"
    assert _console(runs["bare"])["tpm"]["version"] == "2"


def test_a_persistent_tpm_keeps_its_state_from_one_run_to_the_next(booted, qemu_user):
    # pkg/storage/backend-storage: a VirtualMachine's persistent TPM outlives its runs. TPM2_ReadClock's
    # resetCount lives in the TPM's NV state: a TPM made afresh would count the same again.
    runs, kept = booted
    first, second = _console(runs["first"])["tpm"]["resets"], _console(runs["second"])["tpm"]["resets"]
    assert first is not None and second == first + 1
    assert "tpm2-00.permall" in kept["tpm"]  # swtpm's state, by the VM's UUID, after the first run ended
    assert (_tpm_state(qemu_user) / "tpm2-00.permall").is_file()


def test_a_bare_vmis_tpm_state_goes_with_its_run(booted, qemu_user):
    # a VMI's backend-storage claim is owned by the VMI (backend-storage.go createPVC): nothing is kept
    runs, _ = booted
    _console(runs["bare"])
    uuid = parse_vmi(PLAIN_TPM_VMI).uuid
    assert not _tpm_state(qemu_user, uuid).parent.exists()
    assert_clean(qemu_user, domain_name("default", "tis"))


def test_persistent_efi_variables_survive_the_vms_next_run(booted, qemu_user):
    # firmware.bootloader.efi.persistent: the guest's own EFI variable counts its boots across runs
    runs, kept = booted
    assert _console(runs["first"])["efi"] == {"before": 0, "after": 1}
    assert _console(runs["second"])["efi"] == {"before": 1, "after": 2}
    assert kept["store"]
    assert_clean(qemu_user, domain_name("default", "win"))  # the run directory went; the state did not
    assert (vmstate.state_dir(qemu_user.cache, parse_vmi(WINDOWS_VM)) / "win_VARS.fd").is_file()


def test_the_sysprep_answer_file_reaches_the_guest(booted):
    # pkg/config/sysprep.go: every key of the Secret on a CD-ROM labelled unattendCD
    runs, _ = booted
    isos = _console(runs["first"])["isos"]
    (answers,) = [iso for iso in isos.values() if iso["label"] == "unattendCD"]
    assert answers["files"] == {"/autounattend.xml": UNATTEND, "/setup.cmd": "echo setup\n"}


def test_emulation_says_what_the_guest_runs_without(booted):
    # Under TCG, QEMU gives the guest no Hyper-V enlightenment and no paravirtual clock: one line per field
    runs, _ = booted
    notes = [line for line in runs["first"].err.splitlines() if "under emulation (TCG)" in line]
    assert notes == [
        "launcher: note: spec.domain.features.hyperv: Hyper-V enlightenments need KVM; under emulation (TCG) the guest runs"
        " without them (relaxed, vapic, spinlocks, vpindex, synic)",
        "launcher: note: spec.domain.clock.timer.kvm: the KVM clock needs KVM; under emulation (TCG) the guest runs without it",
        "launcher: note: spec.domain.clock.timer.hyperv: the Hyper-V clock needs KVM; under emulation (TCG) the guest runs without it",
    ]
    assert _console(runs["first"])["hypervisor"] != "Microsoft Hyper-V"


def test_an_on_define_domain_hooks_change_is_seen_by_the_guest(booted):
    # cmd/sidecars/sidecar_shim.go runs the ConfigMap's script with --vmi and --domain; virt-launcher defines
    # what it prints (pkg/virt-launcher/virtwrap/util/libvirt_helper.go ApplySidecarHooks)
    runs, _ = booted
    assert [disk["serial"] for disk in _console(runs["bare"])["disks"].values()].count(HOOK_SERIAL) == 1
    assert "launcher: the onDefineDomain hook of ConfigMap my-config-map (my_script.sh) changed the domain" in runs["bare"].err

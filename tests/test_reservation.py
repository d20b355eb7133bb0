"""lun.reservation: SCSI persistent reservations, admitted behind KubeVirt's gate, rendered for an iSCSI lun on
bus scsi without KubeVirt's `<reservations>` (qemu's own initiator carries the guest's PERSISTENT RESERVE to
the target), refused on any other lun.

KubeVirt's sources: pkg/virt-api/webhooks/validating-webhook/admitters/vmi-create-admitter.go
validatePersistentReservation (its words and field path), pkg/virt-config/virt-config.go
PersistentReservationEnabled (the legacy PersistentReservation feature gate still turns it on),
pkg/storage/reservation/pr.go HasVMISpecPersistentReservation (any lun with reservation: true), and
pkg/virt-launcher/virtwrap/converter/storage/disk.go setReservation (the `<reservations>` it adds, which
the launcher leaves out). The guest's reservation reaching a real target: tests/test_launcher_iscsi.py.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import pytest

from launcher.render.domain import Host, ResolvedDisk, render
from launcher.spec.fields import SpecError
from launcher.spec.gates import admit_persistent_reservation, parse_gates
from launcher.spec.k8s import NetworkSource
from launcher.spec.vmi import parse_vmi

ISCSI = ResolvedDisk(path="iscsi://192.0.2.10:3260/iqn.2013-07.com.example:db/1", format="raw", type="network",
                     network=NetworkSource("iscsi", "iqn.2013-07.com.example:db/1", (("192.0.2.10", 3260),)))
BLOCK = ResolvedDisk(path="/dev/sdr", format="raw", type="block")
OFF = "persistent reservation is not enabled in kubevirt config"


def vmi_doc(lun: dict, vm: bool = False) -> dict:
    spec = {"domain": {"resources": {"requests": {"memory": "64Mi"}}, "devices": {"disks": [
                {"name": "root", "disk": {"bus": "virtio"}}, {"name": "san", "lun": lun}]}},
            "volumes": [{"name": "root", "emptyDisk": {"capacity": "16Mi"}}, {"name": "san", "persistentVolumeClaim": {"claimName": "san"}}]}
    if vm:
        return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "db"},
                "spec": {"runStrategy": "Always", "template": {"spec": spec}}}
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "db"}, "spec": spec}


def admission(lun: dict, gates: list[str], vm: bool = False) -> str | None:
    try:
        admit_persistent_reservation(parse_vmi(vmi_doc(lun, vm)), parse_gates(gates))
    except SpecError as err:
        return err.line()
    return None


def rendered(lun: dict, san: ResolvedDisk) -> ET.Element:
    vmi = parse_vmi(vmi_doc(lun))
    root = ResolvedDisk(path="/var/lib/x/root.img", format="raw", type="file")
    return ET.fromstring(render(vmi, {"root": root, "san": san}, Host()))


def test_refused_in_kubevirts_words_without_the_gate():
    assert admission({"bus": "scsi", "reservation": True}, []) == f"spec.domain.devices.disks.luns.reservation: {OFF}"
    assert admission({"bus": "scsi", "reservation": True}, [], vm=True) == f"spec.template.spec.domain.devices.disks.luns.reservation: {OFF}"
    assert admission({"bus": "scsi", "reservation": False}, []) is None  # asks for nothing
    assert admission({"bus": "scsi"}, ["HostDisk"]) is None


def test_admitted_with_the_gate():
    assert admission({"bus": "scsi", "reservation": True}, ["PersistentReservation"]) is None
    assert admission({"bus": "scsi", "reservation": True}, ["HostDisk,PersistentReservation"], vm=True) is None


def test_an_iscsi_lun_on_bus_scsi_renders_as_without_reservation():
    """What KubeVirt renders but its <reservations> (setReservation): qemu's iSCSI session is the passthrough."""
    with_it = rendered({"bus": "scsi", "reservation": True}, ISCSI)
    without = rendered({"bus": "scsi"}, ISCSI)
    assert ET.tostring(with_it) == ET.tostring(without)
    disk = with_it.find("devices/disk[@device='lun']")
    assert disk.get("type") == "network" and disk.find("target").get("bus") == "scsi"
    assert disk.find("source").get("protocol") == "iscsi" and disk.find("source/reservations") is None


@pytest.mark.parametrize("lun, san, what", [
    ({"bus": "scsi", "reservation": True}, BLOCK, "a block disk"),
    ({"bus": "virtio", "reservation": True}, ISCSI, "on bus virtio"),
    ({"bus": "virtio", "reservation": True}, BLOCK, "on bus virtio"),
])
def test_any_other_lun_is_refused_in_one_line(lun, san, what):
    with pytest.raises(SpecError) as err:
        rendered(lun, san)
    line = err.value.line()
    assert line.startswith("spec.domain.devices.disks[1].lun.reservation: works only on a lun on bus scsi backed by an iSCSI PersistentVolume")
    assert f"this lun is {what}, which would need KubeVirt's pr-helper" in line and "\n" not in line
    rendered({**lun, "reservation": False}, san)  # the lun itself is fine


def test_the_gate_is_known():
    assert parse_gates(["PersistentReservation"]).on("PersistentReservation")

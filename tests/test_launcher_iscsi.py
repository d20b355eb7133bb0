"""PV network disks for real: a tgt target on loopback exports a LUN holding the test guest, a
PV/PVC pair points at it, and the launcher boots the VM from it through qemu's iSCSI driver.

The second boot of the CHAP guest also has two more iSCSI PVs: one as a lun on bus scsi asking for
SCSI persistent reservations (`reservation: true`, with --feature-gates PersistentReservation), whose
target's unit serial is pr-abc, and one as a plain disk on bus scsi with serial pr-def: the test guest
registers and reserves both (images/testguest/init, scsi-pr mode), and another initiator on the host
(tests.iscsi_initiator) reads what the target holds. KubeVirt's own check of the same
(tests/storage/reservation.go: sg_persist in the guest registers a key and reads it back) runs on a
LIO target behind its pr-helper."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import run
from tests.iscsi_initiator import RESERVATION_CONFLICT, session
from tests.testguest import ensure_testguest, parse_console
from tests.tgt import IscsiTarget
from tests.vmhost import assert_clean

HOST_INITIATOR = "iqn.2026-11.io.diskkit:another-node"


def _pv(name: str, claim: str, target) -> list[dict]:
    iscsi = {"targetPortal": f"{target.host}:{target.port}", "iqn": target.iqn, "lun": target.lun}
    return [{"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
             "spec": {"capacity": {"storage": "4Mi"}, "accessModes": ["ReadWriteOnce"], "volumeMode": "Block", "iscsi": iscsi,
                      "claimRef": {"namespace": "default", "name": claim}}},
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim, "namespace": "default"},
             "spec": {"accessModes": ["ReadWriteOnce"], "volumeMode": "Block", "resources": {"requests": {"storage": "4Mi"}}, "volumeName": name},
             "status": {"phase": "Bound", "capacity": {"storage": "4Mi"}}}]


def _manifests(directory: Path, target, bound: bool = True, secret: tuple[str, str] | None = None, extra: list[dict] = ()) -> Path:
    directory.mkdir()
    iscsi = {"targetPortal": f"{target.host}:{target.port}", "iqn": target.iqn, "lun": target.lun, "fsType": "ext4"}
    docs = []
    if secret:
        iscsi.update({"chapAuthSession": True, "secretRef": {"name": "chap", "namespace": "default"}})
        docs.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "chap", "namespace": "default"}, "type": "kubernetes.io/iscsi-chap",
                     "data": {"node.session.auth.username": base64.b64encode(secret[0].encode()).decode(),
                              "node.session.auth.password": base64.b64encode(secret[1].encode()).decode()}})
    docs.append({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "pv-guest"},
                 "spec": {"capacity": {"storage": "64Mi"}, "accessModes": ["ReadWriteOnce"], "volumeMode": "Block", "iscsi": iscsi,
                          "claimRef": {"namespace": "default", "name": "guest-root"}}})
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "guest-root", "namespace": "default"},
             "spec": {"accessModes": ["ReadWriteOnce"], "volumeMode": "Block", "resources": {"requests": {"storage": "64Mi"}}},
             "status": {"phase": "Pending"}}
    if bound:
        claim["spec"]["volumeName"] = "pv-guest"
        claim["status"] = {"phase": "Bound", "capacity": {"storage": "64Mi"}}
    docs.append(claim)
    docs.extend(extra)
    (directory / "objects.yaml").write_text("\n---\n".join(json.dumps(d) for d in docs))
    return directory


def _vmi(user, name: str, disks: list[dict] = (), volumes: list[dict] = ()) -> Path:
    vmi = {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": name},
        "spec": {"domain": {"resources": {"requests": {"memory": "128Mi"}}, "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}, *disks]}},
                 "volumes": [{"name": "root", "persistentVolumeClaim": {"claimName": "guest-root"}}, *volumes]},
    }
    path = user.root / f"{name}.yaml"
    path.write_text(json.dumps(vmi))
    return path


def _lun(user, name: str = "lun") -> Path:
    lun = user.root / f"{name}.img"
    run("qemu-img", "convert", "-O", "raw", ensure_testguest() / "testguest-poweroff.qcow2", lun)
    return lun


@dataclass
class Reservations:
    """What another initiator read from a target: its reservation (key, type) or None, its registered
    keys, and the SCSI status of its WRITE(10)."""
    held: tuple[int, int] | None
    keys: list[int]
    write: int


def _seen_from_another_node(target) -> Reservations:
    with session(target, HOST_INITIATOR) as other:
        return Reservations(other.read_reservation(), other.read_keys(), other.write_status())


@dataclass
class ChapBoots:
    first: object  # the launcher's result of each boot
    again: object
    secrets_after: str  # `virsh secret-list` once the VMs are gone
    before: dict  # target name -> Reservations, before the second boot
    after: dict


@pytest.fixture(scope="module")
def chap_boots(qemu_user, tmp_path_factory):
    """Boot the guest from a CHAP-protected iSCSI PV twice, the second time with a lun (reservation:
    true, target serial pr-abc) and a plain scsi disk (serial pr-def) on two more iSCSI PVs."""
    targets = IscsiTarget(tmp_path_factory.mktemp("iscsi-chap"))
    try:
        root = targets(_lun(qemu_user, "chap-root"), chap=("diskkit", "s3cret-chap"))
        shared = {}
        for name, serial in (("san", "pr-abc"), ("plain", None)):
            backing = qemu_user.root / f"{name}.img"
            backing.write_bytes(bytes(4 << 20))
            shared[name] = targets(backing, serial=serial)
        manifests = _manifests(qemu_user.root / "k8s-chap", root, secret=("diskkit", "s3cret-chap"))
        first = qemu_user.launcher("run", "--manifests", manifests, "--console", "--timeout", "180", _vmi(qemu_user, "iscsi"))
        assert first.code == 0, first.err
        before = {name: _seen_from_another_node(t) for name, t in shared.items()}
        with_luns = _manifests(qemu_user.root / "k8s-chap-luns", root, secret=("diskkit", "s3cret-chap"),
                               extra=_pv("pv-san", "san", shared["san"]) + _pv("pv-plain", "plain", shared["plain"]))
        vmi = _vmi(qemu_user, "iscsi",
                   disks=[{"name": "san", "lun": {"bus": "scsi", "reservation": True}},
                          {"name": "plain", "disk": {"bus": "scsi"}, "serial": "pr-def"}],
                   volumes=[{"name": "san", "persistentVolumeClaim": {"claimName": "san"}},
                            {"name": "plain", "persistentVolumeClaim": {"claimName": "plain"}}])
        again = qemu_user.launcher("run", "--manifests", with_luns, "--feature-gates", "PersistentReservation", "--console", "--timeout", "180", vmi)
        assert again.code == 0, again.err
        assert_clean(qemu_user, "default_iscsi")
        after = {name: _seen_from_another_node(t) for name, t in shared.items()}
        yield ChapBoots(first, again, qemu_user.virsh("secret-list"), before, after)
    finally:
        targets.close()


def test_boot_from_an_iscsi_pv_with_chap(chap_boots):
    console = parse_console(chap_boots.first.out)
    assert console["ready"] and console["disks"]["vda"]["size"] == 64 << 20
    assert console["stamps"]["vda"] == (0, 1)  # written through iSCSI to the LUN
    assert "iscsi" not in chap_boots.secrets_after  # the CHAP secret went with the VM
    # The LUN is the PV's storage: the stamp is there for the next VM.
    assert parse_console(chap_boots.again.out)["stamps"]["vda"] == (1, 2)


def _by_serial(console: dict, serial: str) -> dict:
    name = next(n for n, d in console["disks"].items() if d["serial"] == serial)
    return console["reservations"][name]


def test_a_guests_persistent_reservation_reaches_the_iscsi_target(chap_boots):
    """A lun with reservation: true on an iSCSI PV: the guest's REGISTER and RESERVE (SG_IO) go through
    qemu's own iSCSI session to the target, which then holds the guest's key for every other node:
    another initiator reads the reservation, and its write gets RESERVATION CONFLICT."""
    assert chap_boots.before["san"] == Reservations(None, [], 0)
    guest = _by_serial(parse_console(chap_boots.again.out), "pr-abc")
    assert guest == {"key": "abc", "register": "ok", "reserve": "ok", "keys": 1, "first": "abc", "holder": "abc", "type": 1}
    assert chap_boots.after["san"] == Reservations((0xABC, 1), [0xABC], RESERVATION_CONFLICT)  # type 1: Write Exclusive


def test_a_guest_cannot_reserve_an_iscsi_pv_it_has_as_a_disk(chap_boots):
    """A `disk` (not a lun) on the same kind of PV is qemu's emulated SCSI disk: the guest's PERSISTENT
    RESERVE stops at qemu, and the target holds nothing."""
    guest = _by_serial(parse_console(chap_boots.again.out), "pr-def")
    assert guest["register"] != "ok" and guest["reserve"] != "ok" and guest["holder"] == "-"
    assert chap_boots.after["plain"] == chap_boots.before["plain"] == Reservations(None, [], 0)


def test_wrong_chap_password_and_unbound_claim_fail_cleanly(qemu_user, iscsi_target):
    target = iscsi_target(_lun(qemu_user), chap=("diskkit", "right"))
    wrong = _manifests(qemu_user.root / "k8s-wrong", target, secret=("diskkit", "wrong"))
    result = qemu_user.launcher("run", "--manifests", wrong, "--timeout", "120", _vmi(qemu_user, "badchap"))
    assert result.code == 1
    assert "did not start" in result.err and "uthentication" in result.err, result.err
    assert_clean(qemu_user, "default_badchap")
    unbound = _manifests(qemu_user.root / "k8s-unbound", target, bound=False)
    result = qemu_user.launcher("run", "--manifests", unbound, _vmi(qemu_user, "unbound"))
    assert result.code == 1
    assert "spec.volumes[0].persistentVolumeClaim: claim guest-root is not bound to a PersistentVolume (phase Pending)" in result.err, result.err
    assert not (qemu_user.cache / "run" / "default_unbound").exists()
    assert "default_unbound" not in qemu_user.virsh("list", "--all", "--name")

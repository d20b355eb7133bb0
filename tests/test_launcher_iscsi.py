"""PV network disks for real: a tgt target on loopback exports a LUN holding the test guest, a
PV/PVC pair points at it, and the launcher boots the VM from it through qemu's iSCSI driver."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from tests.conftest import run
from tests.testguest import ensure_testguest, parse_console
from tests.vmhost import assert_clean


def _manifests(directory: Path, target, bound: bool = True, secret: tuple[str, str] | None = None) -> Path:
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
    (directory / "objects.yaml").write_text("\n---\n".join(json.dumps(d) for d in docs))
    return directory


def _vmi(user, name: str) -> Path:
    vmi = {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": name},
        "spec": {"domain": {"resources": {"requests": {"memory": "128Mi"}}, "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]}},
                 "volumes": [{"name": "root", "persistentVolumeClaim": {"claimName": "guest-root"}}]},
    }
    path = user.root / f"{name}.yaml"
    path.write_text(json.dumps(vmi))
    return path


def _lun(user) -> Path:
    lun = user.root / "lun.img"
    run("qemu-img", "convert", "-O", "raw", ensure_testguest() / "testguest-poweroff.qcow2", lun)
    return lun


def test_boot_from_an_iscsi_pv_with_chap(qemu_user, iscsi_target):
    target = iscsi_target(_lun(qemu_user), chap=("diskkit", "s3cret-chap"))
    manifests = _manifests(qemu_user.root / "k8s-chap", target, secret=("diskkit", "s3cret-chap"))
    result = qemu_user.launcher("run", "--manifests", manifests, "--console", "--timeout", "180", _vmi(qemu_user, "iscsi"))
    assert result.code == 0, result.err
    console = parse_console(result.out)
    assert console["ready"] and console["disks"]["vda"]["size"] == 64 << 20
    assert console["stamps"]["vda"] == (0, 1)  # written through iSCSI to the LUN
    assert_clean(qemu_user, "default_iscsi")
    assert "iscsi" not in qemu_user.virsh("secret-list")  # the CHAP secret went with the VM
    # The LUN is the PV's storage: the stamp is there for the next VM.
    again = qemu_user.launcher("run", "--manifests", manifests, "--console", "--timeout", "180", _vmi(qemu_user, "iscsi"))
    assert again.code == 0, again.err
    assert parse_console(again.out)["stamps"]["vda"] == (1, 2)


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

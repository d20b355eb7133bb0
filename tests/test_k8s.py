"""Kubernetes manifests: loading, claims resolved to bound PVs, iSCSI and RBD PVs as libvirt network disks."""

from __future__ import annotations

import base64
import json
import socket
from pathlib import Path

import pytest
import yaml

from diskkit.errors import DiskkitError
from launcher.spec.k8s import (
    Claim,
    NetworkDisk,
    NetworkSource,
    Objects,
    network_disk,
    pv_type,
    resolve_claim,
)
from tests.conftest import run_launcher
from tests.test_domain import GOLDEN, network_source

WHERE = "spec.volumes[1].persistentVolumeClaim"
CEPH_KEY = "AQBsL/ZlAAAAABAAiK1Yc0aZpMbbT3pBwcT0Ww=="


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def pvc(name="data", namespace="apps", volume="pv-data", phase="Bound", modes=("ReadWriteOnce",), **spec):
    doc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name, "namespace": namespace},
           "spec": {"accessModes": list(modes), "resources": {"requests": {"storage": "4Gi"}}, **spec},
           "status": {"phase": phase}}
    if volume:
        doc["spec"]["volumeName"] = volume
    return doc


def pv(name="pv-data", claim=("apps", "data"), source=None, capacity="5Gi"):
    spec = {"capacity": {"storage": capacity}, "accessModes": ["ReadWriteOnce"], **(source or {"hostPath": {"path": "/x"}})}
    if claim:
        spec["claimRef"] = {"kind": "PersistentVolumeClaim", "namespace": claim[0], "name": claim[1]}
    return {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name}, "spec": spec}


def secret(name, namespace="apps", data=None, string_data=None):
    doc = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": namespace}}
    if data is not None:
        doc["data"] = {k: b64(v) for k, v in data.items()}
    if string_data is not None:
        doc["stringData"] = string_data
    return doc


def write(tmp_path, *docs, name="objects.yaml"):
    (tmp_path / name).write_text(yaml.safe_dump_all(docs))
    return Objects.load(tmp_path)


def fails(call, *args, **kwargs) -> str:
    with pytest.raises(DiskkitError) as err:
        call(*args, **kwargs)
    return str(err.value)


def disk_of(objects, claim="data", namespace="apps", **kwargs):
    return network_disk(objects, resolve_claim(objects, namespace, claim, WHERE), WHERE, **kwargs)


# ---------------------------------------------------------------- loading

def test_load_reads_multi_document_yaml_lists_and_json(tmp_path):
    (tmp_path / "claims.yml").write_text(yaml.safe_dump_all([pvc(), None, pvc("other", volume=None, phase="Pending")]))
    (tmp_path / "volumes.json").write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": [pv()]}))
    (tmp_path / "README.md").write_text("not a manifest")
    (tmp_path / ".hidden.yaml").write_text("{{{")  # a mounted ConfigMap's ..data entries and the like
    objects = Objects.load(tmp_path)
    assert len(objects) == 3
    assert objects.get("PersistentVolumeClaim", "apps", "other")["status"]["phase"] == "Pending"
    # PVs are cluster-scoped: any namespace asked for is beside the point
    assert objects.get("PersistentVolume", None, "pv-data") is objects.get("PersistentVolume", "apps", "pv-data")
    assert objects.get("PersistentVolumeClaim", None, "data") is None


def test_namespaced_objects_without_namespace_are_in_default(tmp_path):
    claim = pvc()
    del claim["metadata"]["namespace"]
    objects = write(tmp_path, claim)
    assert objects.get("PersistentVolumeClaim", "default", "data")["metadata"]["name"] == "data"
    assert objects.get("PersistentVolumeClaim", None, "data") is not None  # None means the default namespace
    assert objects.get("PersistentVolumeClaim", "apps", "data") is None


def test_load_errors_name_the_file(tmp_path):
    (tmp_path / "broken.yaml").write_text("kind: [unclosed")
    assert fails(Objects.load, tmp_path).startswith(f"{tmp_path / 'broken.yaml'}: not valid YAML")
    (tmp_path / "broken.yaml").write_text("- just\n- a list\n")
    assert fails(Objects.load, tmp_path) == f"{tmp_path / 'broken.yaml'} document 1: a Kubernetes object must be a mapping"
    (tmp_path / "broken.yaml").write_text("kind: Secret\nmetadata: {}\n")
    assert fails(Objects.load, tmp_path) == f"{tmp_path / 'broken.yaml'} document 1: Secret: metadata.name is required"
    (tmp_path / "broken.yaml").unlink()
    (tmp_path / "bad.json").write_text("{")
    assert fails(Objects.load, tmp_path).startswith(f"{tmp_path / 'bad.json'}: not valid JSON")
    assert fails(Objects.load, tmp_path / "missing") == f"{tmp_path / 'missing'}: not a directory of Kubernetes manifests"


def test_an_object_defined_twice_is_refused(tmp_path):
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(pv()))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump_all([pvc(), pv()]))
    assert fails(Objects.load, tmp_path) == (
        f"{tmp_path / 'b.yaml'} document 2: PersistentVolume pv-data is already defined in {tmp_path / 'a.yaml'} document 1")


# ---------------------------------------------------------------- claims

def test_bound_claim_resolves_with_sizes_and_modes(tmp_path):
    objects = write(tmp_path, pvc(volumeMode="Block"), pv())
    claim = resolve_claim(objects, "apps", "data", WHERE)
    assert claim == Claim("data", "apps", "Block", 4 << 30, 5 << 30, ("ReadWriteOnce",), False,
                          objects.get("PersistentVolume", None, "pv-data"), False)


def test_claim_defaults_and_capacity_from_status(tmp_path):
    claim_doc = pvc(modes=("ReadOnlyMany",))
    claim_doc["status"]["capacity"] = {"storage": "1500M"}
    volume = pv(capacity=None)
    del volume["spec"]["capacity"]
    claim = resolve_claim(write(tmp_path, claim_doc, volume), "apps", "data", WHERE)
    assert (claim.volume_mode, claim.capacity, claim.read_only, claim.shareable) == ("Filesystem", 1_500_000_000, True, False)


def test_read_write_many_is_shareable_and_not_read_only(tmp_path):
    claim = resolve_claim(write(tmp_path, pvc(modes=("ReadWriteMany", "ReadOnlyMany")), pv()), "apps", "data", WHERE)
    assert (claim.read_only, claim.shareable) == (False, True)


def test_missing_claim(tmp_path):
    objects = write(tmp_path, pv())
    assert fails(resolve_claim, objects, "apps", "data", WHERE) == f'{WHERE}: persistentvolumeclaims "data" not found in namespace apps'
    # the claim lives in another namespace than the VMI
    assert "not found in namespace other" in fails(resolve_claim, write(tmp_path, pvc(), pv()), "other", "data", WHERE)


@pytest.mark.parametrize("claim, volume, reason", [
    (pvc(phase="Pending", volume=None), pv(), "phase Pending"),
    ({**pvc(volume=None), "status": {}}, pv(), "phase Pending"),  # a claim the API server has not touched yet
    (pvc(volume=None), pv(), "phase Bound, no spec.volumeName"),
    (pvc(phase="Lost"), pv(), "phase Lost"),
    (pvc(volume="pv-gone"), pv(), 'persistentvolumes "pv-gone" not found'),
    (pvc(), pv(claim=("apps", "someone-else")), 'persistentvolumes "pv-data" is bound to apps/someone-else'),
    (pvc(), pv(claim=None), 'persistentvolumes "pv-data" is bound to no claim'),
])
def test_unbound_claims_fail_the_launch(tmp_path, claim, volume, reason):
    objects = write(tmp_path, claim, volume)
    assert fails(resolve_claim, objects, "apps", "data", WHERE) == f"{WHERE}: claim data is not bound to a PersistentVolume ({reason})"


def test_released_pv_still_naming_a_deleted_claim_of_the_same_name(tmp_path):
    claim = pvc()
    claim["metadata"]["uid"] = "new-uid"
    volume = pv()
    volume["spec"]["claimRef"]["uid"] = "old-uid"
    assert "is bound to apps/data" in fails(resolve_claim, write(tmp_path, claim, volume), "apps", "data", WHERE)


def test_claim_field_errors(tmp_path):
    bad_size = pvc()
    bad_size["spec"]["resources"]["requests"]["storage"] = "lots"
    assert fails(resolve_claim, write(tmp_path, bad_size, pv()), "apps", "data", WHERE).startswith(
        f"{WHERE}: claim data spec.resources.requests.storage: quantities must match the regular expression")
    assert fails(resolve_claim, write(tmp_path, pvc(volumeMode="Raw"), pv()), "apps", "data", WHERE) == (
        f"{WHERE}: claim data: spec.volumeMode 'Raw' is neither Filesystem nor Block")


# ---------------------------------------------------------------- iSCSI

ISCSI = {"targetPortal": "192.0.2.10", "iqn": "iqn.2013-07.com.example:iscsi-nopool", "lun": 2, "fsType": "ext4"}


def iscsi_pv(**fields):
    return pv(source={"iscsi": {**ISCSI, **fields}})


def test_iscsi_pv_becomes_a_network_disk_with_default_port_and_every_portal(tmp_path):
    objects = write(tmp_path, pvc(), iscsi_pv(portals=["192.0.2.11:3261", "[2001:db8::1]:3260", "[2001:db8::2]", "192.0.2.10"]))
    assert disk_of(objects) == NetworkDisk(NetworkSource(
        "iscsi", "iqn.2013-07.com.example:iscsi-nopool/2",
        (("192.0.2.10", 3260), ("192.0.2.11", 3261), ("2001:db8::1", 3260), ("2001:db8::2", 3260))), None, False)


def test_iscsi_session_chap_from_data_or_string_data(tmp_path):
    chap = {"node.session.auth.username": "vmuser", "node.session.auth.password": "s3cret"}
    volume = iscsi_pv(chapAuthSession=True, chapAuthDiscovery=True, secretRef={"name": "chap"}, initiatorName="iqn.2024-01.io.diskkit:n1")
    expected = NetworkDisk(NetworkSource("iscsi", "iqn.2013-07.com.example:iscsi-nopool/2", (("192.0.2.10", 3260),),
                                         "vmuser", "iscsi", "diskkit-apps-pv-data", "iqn.2024-01.io.diskkit:n1"), b"s3cret", False)
    assert disk_of(write(tmp_path, pvc(), volume, secret("chap", data=chap))) == expected
    assert disk_of(write(tmp_path, pvc(), volume, secret("chap", string_data=chap))) == expected
    # stringData wins over data, as the API server merges them
    mixed = secret("chap", data={**chap, "node.session.auth.password": "old"}, string_data={"node.session.auth.password": "s3cret"})
    assert disk_of(write(tmp_path, pvc(), volume, mixed)) == expected


def test_iscsi_secret_namespace_comes_from_the_ref_else_the_claim(tmp_path):
    chap = {"node.session.auth.username": "u", "node.session.auth.password": "p"}
    volume = iscsi_pv(chapAuthSession=True, secretRef={"name": "chap", "namespace": "storage"})
    assert disk_of(write(tmp_path, pvc(), volume, secret("chap", "storage", chap))).secret_value == b"p"
    assert fails(disk_of, write(tmp_path, pvc(), volume, secret("chap", "apps", chap))) == (
        f'{WHERE}: secrets "chap" not found in namespace storage (the persistentvolumes pv-data spec.iscsi.secretRef)')


def test_iscsi_chap_errors_name_the_objects(tmp_path):
    volume = iscsi_pv(chapAuthSession=True, secretRef={"name": "chap"})
    assert fails(disk_of, write(tmp_path, pvc(), volume)) == (
        f'{WHERE}: secrets "chap" not found in namespace apps (the persistentvolumes pv-data spec.iscsi.secretRef)')
    no_password = secret("chap", data={"node.session.auth.username": "u"})
    assert fails(disk_of, write(tmp_path, pvc(), volume, no_password)) == (
        f"{WHERE}: secret apps/chap has no node.session.auth.password (session CHAP of persistentvolumes pv-data)")
    mutual = secret("chap", data={"node.session.auth.username": "u", "node.session.auth.password": "p",
                                  "node.session.auth.username_in": "t", "node.session.auth.password_in": "q"})
    assert "mutual CHAP (node.session.auth.username_in) is not supported" in fails(disk_of, write(tmp_path, pvc(), volume, mutual))
    bad = secret("chap")
    bad["data"] = {"node.session.auth.password": "%%%"}
    assert fails(disk_of, write(tmp_path, pvc(), volume, bad)) == (
        f"{WHERE}: secret apps/chap: data.node.session.auth.password is not valid base64")
    assert fails(disk_of, write(tmp_path, pvc(), iscsi_pv(chapAuthSession=True))) == (
        f"{WHERE}: persistentvolumes pv-data spec.iscsi.chapAuthSession needs persistentvolumes pv-data spec.iscsi.secretRef")


def test_discovery_chap_alone_needs_no_secret(tmp_path):
    # qemu logs in to the target directly: there is no SendTargets discovery to authenticate
    assert disk_of(write(tmp_path, pvc(), iscsi_pv(chapAuthDiscovery=True, secretRef={"name": "gone"}))).source.auth_username is None


@pytest.mark.parametrize("fields, rule", [
    ({"iqn": None}, "spec.iscsi.iqn is required"),
    ({"iqn": "target1"}, "spec.iscsi.iqn 'target1': must be valid format starting with iqn, eui, or naa"),
    ({"lun": 256}, "spec.iscsi.lun: must be between 0 and 255"),
    ({"targetPortal": None}, "spec.iscsi.targetPortal must be a host or host:port"),
    ({"targetPortal": "san:99999"}, "spec.iscsi.targetPortal 'san:99999' has an invalid port"),
    ({"portals": "san"}, "spec.iscsi.portals must be a list"),
])
def test_iscsi_field_errors(tmp_path, fields, rule):
    assert fails(disk_of, write(tmp_path, pvc(), iscsi_pv(**fields))) == f"{WHERE}: persistentvolumes pv-data {rule}"


def test_read_only_from_the_pv_or_a_read_only_many_claim(tmp_path):
    assert disk_of(write(tmp_path, pvc(), iscsi_pv(readOnly=True))).read_only
    assert disk_of(write(tmp_path, pvc(modes=("ReadOnlyMany",)), iscsi_pv())).read_only
    assert not disk_of(write(tmp_path, pvc(), iscsi_pv())).read_only


# ---------------------------------------------------------------- RBD

RBD = {"monitors": ["10.16.154.78:6789", "10.16.154.82", "mon3.ceph.example.com:3300"], "image": "vm-data"}


def rbd_pv(**fields):
    return pv(source={"rbd": {**RBD, **fields}})


def test_rbd_with_cephx_secret(tmp_path):
    objects = write(tmp_path, pvc(), rbd_pv(pool="kube", user="kube", secretRef={"name": "ceph"}), secret("ceph", data={"key": CEPH_KEY}))
    assert disk_of(objects) == NetworkDisk(NetworkSource(
        "rbd", "kube/vm-data", (("10.16.154.78", 6789), ("10.16.154.82", 6789), ("mon3.ceph.example.com", 3300)),
        "kube", "ceph", "diskkit-apps-pv-data"), base64.b64decode(CEPH_KEY), False)


def test_rbd_defaults_pool_rbd_and_user_admin(tmp_path):
    # a secret with one entry under another name works too: Kubernetes' rbd plugin takes any value
    objects = write(tmp_path, pvc(), rbd_pv(secretRef={"name": "ceph"}), secret("ceph", data={"userKey": CEPH_KEY}))
    source = disk_of(objects).source
    assert (source.name, source.auth_username) == ("rbd/vm-data", "admin")


def test_rbd_without_secret_relies_on_the_nodes_admin_keyring(tmp_path):
    assert disk_of(write(tmp_path, pvc(), rbd_pv(keyring="/etc/ceph/keyring"))) == NetworkDisk(
        NetworkSource("rbd", "rbd/vm-data", (("10.16.154.78", 6789), ("10.16.154.82", 6789), ("mon3.ceph.example.com", 3300))),
        None, False)
    assert fails(disk_of, write(tmp_path, pvc(), rbd_pv(user="kube"))) == (
        f"{WHERE}: persistentvolumes pv-data spec.rbd: user kube with keyring /etc/ceph/keyring needs a secretRef holding"
        " the cephx key (without one only user admin with /etc/ceph/keyring works)")


def test_rbd_secret_errors_name_the_objects(tmp_path):
    volume = rbd_pv(secretRef={"name": "ceph"})
    assert fails(disk_of, write(tmp_path, pvc(), volume)) == (
        f'{WHERE}: secrets "ceph" not found in namespace apps (the persistentvolumes pv-data spec.rbd.secretRef)')
    two = secret("ceph", data={"a": CEPH_KEY, "b": CEPH_KEY})
    assert fails(disk_of, write(tmp_path, pvc(), volume, two)) == (
        f"{WHERE}: secret apps/ceph has no key (the cephx key of client.admin for persistentvolumes pv-data)")
    assert "key is not a cephx key" in fails(disk_of, write(tmp_path, pvc(), volume, secret("ceph", data={"key": "not base64!"})))
    assert fails(disk_of, write(tmp_path, pvc(), rbd_pv(monitors=[]))) == f"{WHERE}: persistentvolumes pv-data spec.rbd.monitors is required"
    assert fails(disk_of, write(tmp_path, pvc(), rbd_pv(image=None))) == f"{WHERE}: persistentvolumes pv-data spec.rbd.image is required"


# ---------------------------------------------------------------- other volume types

def test_other_pv_types_are_no_network_disk_unless_one_is_required(tmp_path):
    objects = write(tmp_path, pvc(), pv(source={"nfs": {"server": "nfs.example.com", "path": "/vms"}}))
    assert disk_of(objects) is None
    assert fails(disk_of, objects, required=True) == (
        f"{WHERE}: persistentvolumes pv-data (of claim data) has volume type nfs; only iscsi and rbd volumes can be attached as network disks")
    assert pv_type(pv(source={"csi": {"driver": "x"}})) == "csi"


# ---------------------------------------------------------------- what the goldens render

def golden_network(case: str, volume: str) -> NetworkSource:
    return network_source(yaml.safe_load((GOLDEN / f"{case}.yaml").read_text())["x-resolved"][volume]["network"])


def test_the_iscsi_and_rbd_goldens_are_what_their_manifests_resolve_to(tmp_path):
    chap = pv("pv-chap", ("storage", "chap-lun"), {"iscsi": {
        "targetPortal": "san.example.com:3261", "iqn": "iqn.2013-07.com.example:secure", "lun": 2, "chapAuthSession": True,
        "secretRef": {"name": "chap"}, "initiatorName": "iqn.2024-01.io.diskkit:node-1"}})
    rbd = pv("pv-rbd", ("storage", "ceph-data"), {"rbd": {**RBD, "pool": "kube", "user": "kube", "secretRef": {"name": "ceph"}}})
    objects = write(tmp_path, chap, rbd, pvc("chap-lun", "storage", "pv-chap"), pvc("ceph-data", "storage", "pv-rbd"),
                    secret("chap", "storage", {"node.session.auth.username": "vmuser", "node.session.auth.password": "p"}),
                    secret("ceph", "storage", {"key": CEPH_KEY}))
    assert disk_of(objects, "chap-lun", "storage").source == golden_network("iscsi", "chap")
    assert disk_of(objects, "ceph-data", "storage").source == golden_network("rbd", "data")


# ---------------------------------------------------------------- --kube-api (no API server can run here)

def _claim_vmi(tmp_path: Path) -> Path:
    vmi = tmp_path / "vmi.yaml"
    vmi.write_text(yaml.safe_dump({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "api"},
        "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}}},
                 "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "c"}}]},
    }))
    return vmi


def test_kube_api_unreachable_names_the_server_and_the_object(tmp_path):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "here",
        "clusters": [{"name": "here", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "contexts": [{"name": "here", "context": {"cluster": "here", "user": "me"}}],
        "users": [{"name": "me", "user": {"token": "s3cret-token"}}],
    }))
    result = run_launcher("domain", "--kube-api", _claim_vmi(tmp_path), env={"KUBECONFIG": str(kubeconfig), "KUBERNETES_SERVICE_HOST": ""})
    assert result.code == 1
    assert f"PersistentVolumeClaim default/c: cannot reach the Kubernetes API at http://127.0.0.1:{port}" in result.err, result.err
    assert "s3cret-token" not in result.err + result.out


def test_kube_api_without_any_config_and_with_manifests(tmp_path):
    env = {"KUBECONFIG": str(tmp_path / "absent"), "HOME": str(tmp_path), "KUBERNETES_SERVICE_HOST": ""}
    result = run_launcher("domain", "--kube-api", _claim_vmi(tmp_path), env=env)
    assert result.code == 1 and "--kube-api: no Kubernetes API to talk to" in result.err, result.err
    both = run_launcher("domain", "--kube-api", "--manifests", tmp_path, _claim_vmi(tmp_path), env=env)
    assert both.code == 1 and "give either --manifests or --kube-api, not both" in both.err, both.err

"""spec.accessCredentials: parsing and refusals as KubeVirt's admitter
(pkg/virt-api/webhooks/validating-webhook/admitters/vmi-create-admitter.go validateAccessCredentials), and
the keys on the cloud-init disk where virt-launcher puts them (pkg/cloud-init/cloud-init.go:
resolveSSHPublicKeys numbers every key of every Secret from "0"; NoCloudMetadata `public-keys`,
ConfigDriveMetadata `public_keys`)."""

from __future__ import annotations

import base64
import json

import pytest

from diskkit.errors import DiskkitError
from launcher.spec import credentials
from launcher.spec.fields import SpecError
from launcher.spec.k8s import Objects
from launcher.spec.vmi import parse_vmi
from launcher.volumes import gendisks

UUID = "5d307ca9-b3ef-428c-8861-06e72d69f223"
NOCLOUD = {"name": "ci", "cloudInitNoCloud": {"userData": "#cloud-config\n"}}
CONFIGDRIVE = {"name": "cd", "cloudInitConfigDrive": {"userData": "#cloud-config\n"}}


def vmi_doc(volumes, creds):
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "vm", "namespace": "ns"},
            "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}}, "firmware": {"uuid": UUID}},
                     "volumes": volumes, "accessCredentials": creds}}


def ssh_cred(secret="keys", **method):
    return {"sshPublicKey": {"source": {"secret": {"secretName": secret}}, "propagationMethod": method or {"noCloud": {}}}}


def secret(name, **data):
    return {"kind": "Secret", "metadata": {"name": name, "namespace": "ns"},
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


def refusal(doc) -> str:
    with pytest.raises(SpecError) as err:
        parse_vmi(doc)
    return str(err.value)


@pytest.mark.parametrize("volumes, cred, message", [
    ([CONFIGDRIVE], ssh_cred(noCloud={}), "spec.accessCredentials[0].sshPublicKey.propagationMethod: spec.accessCredentials[0]"
                                          " requires a noCloud volume to exist when the noCloud propagationMethod is in use."),
    ([NOCLOUD], ssh_cred(configDrive={}), "spec.accessCredentials[0].sshPublicKey.propagationMethod: spec.accessCredentials[0]"
                                          " requires a configDrive volume to exist when the configDrive propagationMethod is in use."),
    ([NOCLOUD, CONFIGDRIVE], ssh_cred(noCloud={}, configDrive={}),
     "spec.accessCredentials[0].sshPublicKey.propagationMethod: spec.accessCredentials[0] must have exactly one propagationMethod set"),
    ([NOCLOUD], {"sshPublicKey": {"source": {}, "propagationMethod": {"noCloud": {}}}},
     "spec.accessCredentials[0].sshPublicKey.source: spec.accessCredentials[0] must have exactly one source set"),
    ([NOCLOUD], {}, "spec.accessCredentials[0]: spec.accessCredentials[0] must have exactly one access credential type set"),
    ([NOCLOUD], ssh_cred(qemuGuestAgent={"users": []}),
     "spec.accessCredentials[0].sshPublicKey.propagationMethod.qemuGuestAgent.users: spec.accessCredentials[0]"
     " requires at least one user to be present in the users list"),
    ([NOCLOUD], ssh_cred(qemuGuestAgent={}),
     "spec.accessCredentials[0].sshPublicKey.propagationMethod.qemuGuestAgent.users: spec.accessCredentials[0]"
     " requires at least one user to be present in the users list"),
    ([], ssh_cred(qemuGuestAgent={"users": ["root"]}, noCloud={}),
     "spec.accessCredentials[0].sshPublicKey.propagationMethod: spec.accessCredentials[0]"
     " requires a noCloud volume to exist when the noCloud propagationMethod is in use."),
    ([NOCLOUD], {"userPassword": {"source": {"secret": {"secretName": "p"}}, "propagationMethod": {"qemuGuestAgent": {}}}},
     "spec.accessCredentials[0].userPassword: not supported by the launcher"),
])
def test_refusals_in_kubevirts_words(volumes, cred, message):
    assert refusal(vmi_doc(volumes, [cred])).startswith(message)


def test_nocloud_keys_go_into_meta_data_numbered_across_secrets(tmp_path):
    doc = vmi_doc([NOCLOUD, CONFIGDRIVE], [ssh_cred("a"), ssh_cred("b", configDrive={}), ssh_cred("c")])
    vmi = parse_vmi(doc)
    # keys in the order the mount lists them (by name), empty ones skipped, the count running on
    objects = Objects([secret("a", z="ssh-ed25519 AAAz z\n", y="ssh-ed25519 AAAy y", empty=""),
                       secret("b", k="ssh-ed25519 AAAb b"), secret("c", **{f"k{i}": f"ssh-ed25519 AAA{i}" for i in range(9)})])
    gen = gendisks.Generator(vmi, tmp_path, gendisks.Sources(objects, tmp_path / "nopod"))
    meta = gen.cloud_init(vmi.volume("ci"), "spec.volumes[0].cloudInitNoCloud").files["meta-data"]
    keys = {"0": "ssh-ed25519 AAAy y", "1": "ssh-ed25519 AAAz z\n", **{str(i + 2): f"ssh-ed25519 AAA{i}" for i in range(9)}}
    assert json.loads(meta) == {"instance-id": UUID, "local-hostname": "vm", "public-keys": keys}
    # Go's json.Marshal: struct fields in order, then the map sorted by key ("10" before "2")
    assert meta.startswith(f'{{"instance-id":"{UUID}","local-hostname":"vm","public-keys":{{"0":"ssh-ed25519 AAAy y",'
                           f'"1":"ssh-ed25519 AAAz z\\n","10":"ssh-ed25519 AAA8","2":'.encode())
    drive = gen.cloud_init(vmi.volume("cd"), "spec.volumes[1].cloudInitConfigDrive").files["openstack/latest/meta_data.json"]
    assert drive.endswith(b',"uuid":"' + UUID.encode() + b'","public_keys":{"0":"ssh-ed25519 AAAb b"}}')


def test_without_credentials_the_meta_data_is_unchanged(tmp_path):
    vmi = parse_vmi(vmi_doc([NOCLOUD], []))
    gen = gendisks.Generator(vmi, tmp_path, gendisks.Sources(Objects([]), tmp_path / "nopod"))
    assert b"public" not in gen.cloud_init(vmi.volume("ci"), "at").files["meta-data"]


def test_keys_from_the_pod_mount_and_a_missing_secret(tmp_path):
    vmi = parse_vmi(vmi_doc([NOCLOUD], [ssh_cred("mine")]))
    mount = tmp_path / "pod" / "secret" / "mine-access-cred"  # where virt-launcher's pod has it
    mount.mkdir(parents=True)
    (mount / "key").write_text("ssh-ed25519 AAAm m\n")
    gen = gendisks.Generator(vmi, tmp_path, gendisks.Sources(None, tmp_path / "pod"))
    assert json.loads(gen.cloud_init(vmi.volume("ci"), "at").files["meta-data"])["public-keys"] == {"0": "ssh-ed25519 AAAm m\n"}
    gen = gendisks.Generator(vmi, tmp_path, gendisks.Sources(Objects([]), tmp_path / "nopod"))
    with pytest.raises(DiskkitError) as err:
        gen.cloud_init(vmi.volume("ci"), "at")
    assert str(err.value) == 'spec.accessCredentials[0].sshPublicKey.source.secret: secrets "mine" not found in namespace ns'


def test_ignore_unsupported_drops_the_whole_credential():
    password = {"userPassword": {"source": {"secret": {"secretName": "p"}}, "propagationMethod": {"qemuGuestAgent": {}}}}
    doc = vmi_doc([NOCLOUD], [ssh_cred("a"), password])
    vmi = parse_vmi(doc, ignore_unsupported=True)
    assert [(c.secret_name, c.method) for c in vmi.access_credentials] == [("a", "noCloud")]


def test_guest_agent_keys_are_each_users_keys_from_every_secret_naming_them(tmp_path):
    # access-credentials/access_credentials.go: readKeysFromDirectory takes every file of the Secret's
    # mount but the kubelet's ..data entries, by name, one key per non-empty trimmed line; reloadCredentialFiles
    # gives each user the keys of every credential naming them, in the credentials' order.
    doc = vmi_doc([], [ssh_cred("a", qemuGuestAgent={"users": ["root", "fedora"]}), ssh_cred("b", qemuGuestAgent={"users": ["fedora"]})])
    vmi = parse_vmi(doc)
    assert [(c.secret_name, c.method, c.users) for c in vmi.access_credentials] == [
        ("a", "qemuGuestAgent", ("root", "fedora")), ("b", "qemuGuestAgent", ("fedora",))]
    secrets = {"a": {"z": b"ssh-ed25519 AAAz z\n\n  ssh-rsa AAAr r  \n", "..data": b"ssh-ed25519 AAAd d", "y": b""},
               "b": {"k": b"ssh-ed25519 AAAb b"}}
    assert credentials.agent_keys(vmi.access_credentials, secrets) == {
        "root": ["ssh-ed25519 AAAz z", "ssh-rsa AAAr r"],
        "fedora": ["ssh-ed25519 AAAz z", "ssh-rsa AAAr r", "ssh-ed25519 AAAb b"]}
    # nothing of theirs goes on a cloud-init disk
    assert credentials.public_keys(vmi.access_credentials, credentials.NOCLOUD, secrets) == {}

"""Bad input and secrets: names that would leave their directory, names too long for a file, strings
XML cannot carry, files that are not UTF-8 or too large, YAML alias bombs, labels and annotations
Kubernetes refuses (k8s.io/apimachinery pkg/api/validation/objectmeta.go, pkg/util/validation), and
the modes of what carries secrets. Each refusal is one line, exit 1, nothing written anywhere."""

from __future__ import annotations

import base64
import json
import os
import resource
import stat
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from diskkit.errors import DiskkitError
from launcher.node.cache import Cache, entry_name, private_dirs, within
from launcher.render.domain import Host, ResolvedDisk, render
from launcher.spec.datavolume import parse_data_volume
from launcher.spec.fields import SpecError
from launcher.spec.k8s import Objects
from launcher.spec.meta import MAX_MANIFEST_BYTES, SUBDOMAIN_MESSAGE, load_documents
from launcher.spec.vmi import load_vmi, parse_vmi
from launcher.volumes import gendisks
from launcher.volumes.files import give_to_qemu
from tests.conftest import launcher_command
from tests.vmhost import QEMU_UID, qemu_scratch

LABEL_MESSAGE = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-'"
LONG_NAME = ".".join(["a" * 63] * 4)[:252] + "z"  # 253 characters, the most a DNS subdomain has
LONG_NAMESPACE = "n" * 63


def vmi_doc(name="vm", namespace=None, **meta) -> dict:
    metadata = {"name": name, **({"namespace": namespace} if namespace is not None else {}), **meta}
    return {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": metadata,
        "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}}, "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]}},
                 "volumes": [{"name": "root", "containerDisk": {"image": "registry.example/guest:v1"}}]},
    }


def refused(doc, *needles: str) -> str:
    with pytest.raises(SpecError) as err:
        parse_vmi(doc)
    message = str(err.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


# ---------------------------------------------------------------- names

@pytest.mark.parametrize("name", ["../../etc", "..", ".", "a/b", "Web", "web_1", "a\0b", "-a", "a.", LONG_NAME + "x", ""])
def test_bad_vmi_names_are_refused_with_apimachinerys_message(name):
    if name == "":
        refused(vmi_doc(name), "metadata.name", "required")
    elif len(name) > 253:
        refused(vmi_doc(name), "metadata.name", "must be no more than 253 characters")
    else:
        refused(vmi_doc(name), "metadata.name: Invalid value: ", SUBDOMAIN_MESSAGE)


@pytest.mark.parametrize("namespace", ["../..", "a.b", "NS", "n_s", "n" * 64, "a/b"])
def test_bad_namespaces_are_refused_as_dns_labels(namespace):
    message = refused(vmi_doc("vm", namespace), "metadata.namespace")
    assert LABEL_MESSAGE in message or "must be no more than 63 characters" in message


def test_a_virtual_machine_name_is_checked_too():
    doc = vmi_doc("../x")
    vm = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": doc["metadata"],
          "spec": {"template": {"metadata": {}, "spec": doc["spec"]}}}
    with pytest.raises(SpecError, match="metadata.name: Invalid value"):
        parse_vmi(vm)


def test_domain_names_are_kubevirts_while_libvirt_can_hold_them():
    # libvirt writes <name>.xml.new, <name>.pid, <name>.log: 247 bytes is the longest name it can start
    fits = parse_vmi(vmi_doc(LONG_NAME[:183], LONG_NAMESPACE))
    assert fits.domain_name == f"{LONG_NAMESPACE}_{LONG_NAME[:183]}" and len(fits.domain_name) == 247
    longest = parse_vmi(vmi_doc(LONG_NAME, LONG_NAMESPACE))
    assert len(longest.domain_name) == 247 and longest.domain_name.startswith(f"{LONG_NAMESPACE}_aaaa")
    assert longest.domain_name != parse_vmi(vmi_doc(LONG_NAME[:-1] + "y", LONG_NAMESPACE)).domain_name
    xml = render(longest, {"root": ResolvedDisk("/x/disk.qcow2", "qcow2")}, Host(domain_type="qemu", serial_log="/x/console.log"))
    assert ET.fromstring(xml).findtext("name") == longest.domain_name


def test_data_volume_names_are_subdomains_and_namespaces_labels():
    doc = {"apiVersion": "cdi.kubevirt.io/v1beta1", "kind": "DataVolume", "metadata": {"name": "../claims"},
           "spec": {"source": {"blank": {}}, "storage": {"resources": {"requests": {"storage": "1Mi"}}}}}
    with pytest.raises(SpecError, match="DataVolume.metadata.name: Invalid value"):
        parse_data_volume(doc, "DataVolume")
    doc["metadata"] = {"name": "ok", "namespace": "../.."}
    with pytest.raises(SpecError, match="DataVolume.metadata.namespace"):
        parse_data_volume(doc, "DataVolume")
    vmi = vmi_doc()
    vmi["spec"]["dataVolumeTemplates"] = [{"metadata": {"name": "x/../y"}, "spec": doc["spec"]}]
    refused(vmi, "spec.dataVolumeTemplates[0].metadata.name: Invalid value")


# ---------------------------------------------------------------- labels and annotations

@pytest.mark.parametrize("labels, needles", [
    ({"app": 123}, ("metadata.labels.app", "must be a string")),
    ({"app": ["a"]}, ("metadata.labels.app", "must be a string")),
    ({"app": "front end"}, ("metadata.labels", "a valid label must be an empty string")),
    ({"app": "v" * 64}, ("metadata.labels", "must be no more than 63 characters")),
    ({"bad key": "x"}, ("metadata.labels", "name part must consist of alphanumeric characters")),
    ({"a/b/c": "x"}, ("metadata.labels", "a qualified name must consist")),
    ({"Example.com/x": "x"}, ("metadata.labels", "prefix part a lowercase RFC 1123 subdomain")),
])
def test_labels_are_checked_as_kubernetes_does(labels, needles):
    refused(vmi_doc(labels=labels), *needles)


def test_annotations_are_strings_and_at_most_256_KiB():
    assert parse_vmi(vmi_doc(annotations={"Example/Key": "anything\ngoes", "empty": ""})).annotations["empty"] == ""
    refused(vmi_doc(annotations={"note": {"nested": "map"}}), "metadata.annotations.note", "must be a string")
    refused(vmi_doc(annotations={"note": 5}), "metadata.annotations.note", "must be a string")
    refused(vmi_doc(annotations={"bad key!": "x"}), "metadata.annotations", "name part must consist")
    at_limit = {"a": "x" * (262144 - 1)}
    assert parse_vmi(vmi_doc(annotations=at_limit)).annotations == at_limit
    message = refused(vmi_doc(annotations={"a": "x" * 262144}))
    assert message == "metadata.annotations: Too long: must have at most 262144 bytes"
    # counted in bytes, keys included
    refused(vmi_doc(annotations={"a": "é" * 131072}), "Too long: must have at most 262144 bytes")


# ---------------------------------------------------------------- characters XML cannot carry

def _with(path: str, value):
    doc = vmi_doc()
    spec = doc["spec"]
    if path == "firmware.serial":
        spec["domain"]["firmware"] = {"serial": value}
    elif path == "kernelArgs":
        spec["domain"]["firmware"] = {"kernelBoot": {"kernelArgs": value, "container": {"image": "k:v1", "kernelPath": "/k"}}}
    elif path == "disk serial":
        spec["domain"]["devices"]["disks"][0]["serial"] = value
    elif path == "annotation":
        doc["metadata"]["annotations"] = {"note": value}
    elif path == "cpu model":
        spec["domain"]["cpu"] = {"model": value}
    elif path == "image":
        spec["volumes"][0]["containerDisk"]["image"] = value
    return doc


@pytest.mark.parametrize("where, field", [
    ("firmware.serial", "spec.domain.firmware.serial"),
    ("kernelArgs", "spec.domain.firmware.kernelBoot.kernelArgs"),
    ("disk serial", "spec.domain.devices.disks[0].serial"),
    ("annotation", "metadata.annotations.note"),
    ("cpu model", "spec.domain.cpu.model"),
    ("image", "spec.volumes[0].containerDisk.image"),
])
@pytest.mark.parametrize("char", ["\0", "\x01", "\x1b", "\ufffe", "\ud800"])
def test_characters_xml_cannot_carry_are_refused_naming_the_field(where, field, char):
    refused(_with(where, f"a{char}b"), f"{field}: must not contain the character U+{ord(char):04X}")


def test_tabs_newlines_and_any_unicode_pass():
    vmi = parse_vmi(_with("annotation", "tab\tnew\nline\r é 😀"))
    assert vmi.annotations["note"] == "tab\tnew\nline\r é 😀"
    cloud = vmi_doc()
    cloud["spec"]["volumes"].append({"name": "ci", "cloudInitNoCloud": {"userData": "#cloud-config\n# \x1b[1m bold\n"}})
    assert parse_vmi(cloud).volume("ci").source.user_data.startswith(b"#cloud-config")  # file content, never XML


# ---------------------------------------------------------------- files

BILLION_LAUGHS = "\n".join([
    "apiVersion: kubevirt.io/v1", "kind: VirtualMachineInstance", "metadata:", "  name: lol", "  annotations:",
    '    a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]',
    *(f"    a{i}: &a{i} [*a{i - 1},*a{i - 1},*a{i - 1},*a{i - 1},*a{i - 1},*a{i - 1},*a{i - 1},*a{i - 1},*a{i - 1}]" for i in range(1, 10)),
    # a downwardAPI volume writes the annotations out: expanded, a billion strings
    "spec:", "  domain: {resources: {requests: {memory: 64Mi}}}",
    "  volumes: [{name: dapi, downwardAPI: {fields: [{path: a, fieldRef: {fieldPath: metadata.annotations}}]}}]", ""])


def test_vmi_file_not_utf8_is_refused(tmp_path):
    path = tmp_path / "vmi.yaml"
    path.write_bytes(json.dumps(vmi_doc()).encode().replace(b'"vm"', b'"v\xffm"'))
    with pytest.raises(SpecError, match=r"vmi.yaml: is not UTF-8 text \(byte \d+: invalid start byte\)"):
        load_vmi(path)


def test_files_over_3_MiB_are_refused_without_reading_them_whole(tmp_path):
    path = tmp_path / "big.yaml"
    doc = vmi_doc()
    doc["metadata"]["annotations"] = {"pad": "x" * MAX_MANIFEST_BYTES}
    path.write_text(json.dumps(doc))
    with pytest.raises(SpecError, match="is larger than 3145728 bytes"):
        load_vmi(path)
    with pytest.raises(SpecError, match="is larger than 3145728 bytes"):
        load_vmi("/dev/zero")  # no end at all: the read stops at the bound


def test_billion_laughs_is_refused_as_excessive_aliasing(tmp_path):
    path = tmp_path / "lol.yaml"
    path.write_text(BILLION_LAUGHS)
    with pytest.raises(SpecError, match="not valid YAML: document contains excessive aliasing"):
        load_vmi(path)


def test_recursive_anchor_is_refused_and_modest_aliases_are_fine(tmp_path):
    path = tmp_path / "loop.yaml"
    path.write_text("a: &x [1, *x]\n")
    with pytest.raises(SpecError, match="value contains itself"):
        load_documents(path)
    path.write_text("base: &b {app: web}\nother: *b\nthird: {<<: *b, tier: db}\n")
    assert load_documents(path) == [{"base": {"app": "web"}, "other": {"app": "web"}, "third": {"app": "web", "tier": "db"}}]


def test_manifests_directory_gets_the_same_limits(tmp_path):
    def loading(name: str, content: str | bytes) -> str:
        d = tmp_path / name
        d.mkdir()
        (d / "objects.yaml").write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(SpecError if name != "meta" else Exception) as err:
            Objects.load(d)
        return str(err.value)

    assert "excessive aliasing" in loading("lol", BILLION_LAUGHS.replace("VirtualMachineInstance", "ConfigMap").replace("kubevirt.io/v1", "v1"))
    assert "is not UTF-8 text" in loading("latin1", b"apiVersion: v1\nkind: ConfigMap\nmetadata: {name: caf\xe9}\n")
    assert "larger than 3145728 bytes" in loading("big", "# " + "x" * MAX_MANIFEST_BYTES)
    for doc, needle in [
        ({"kind": "PersistentVolumeClaim", "metadata": {"name": "../../etc"}}, "metadata.name: Invalid value"),
        ({"kind": "Secret", "metadata": {"name": "s", "namespace": "../.."}}, "metadata.namespace"),
        ({"kind": "Namespace", "metadata": {"name": "a.b"}}, LABEL_MESSAGE),
        ({"kind": "ConfigMap", "metadata": {"name": "c", "labels": {"x": 1}}}, "metadata.labels.x: must be a string"),
        ({"kind": "ConfigMap", "metadata": {"name": "c", "annotations": {"x": "y" * 262144}}}, "Too long: must have at most 262144 bytes"),
        ({"kind": "PersistentVolume", "metadata": {"name": "pv"}, "spec": {"iscsi": {"iqn": "iqn.x\0"}}}, "spec.iscsi.iqn: must not contain"),
    ]:
        with pytest.raises(Exception) as err:
            Objects([{"apiVersion": "v1", **doc}])
        assert needle in str(err.value) and "\n" not in str(err.value), err.value
    # payloads become files in generated disks, not XML: any character goes
    Objects([{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"script": "\x1b[1m"}}])


# ---------------------------------------------------------------- the cache

def test_vm_entries_stay_inside_the_cache_and_fit_a_file_name(tmp_path):
    cache = Cache(tmp_path / "cache")
    long_domain = f"{LONG_NAMESPACE}_{LONG_NAME}"
    assert len(long_domain.encode()) == 317
    name = entry_name(long_domain)
    assert len(name) <= 100 and name.startswith("n" * 20) and name != entry_name(long_domain[:-1] + "y")
    assert cache.run_dir(long_domain).parent == cache.root / "run"
    assert len(cache.vm_record_path(long_domain).name) <= 255
    assert entry_name("default_vm") == "default_vm"
    for hostile in ("../../etc", "..", "a/../../b", "x\0y", "/etc/passwd"):
        for path in (cache.run_dir(hostile), cache.vm_record_path(hostile)):
            assert path.parent in (cache.root / "run", cache.root / "vms"), path
    with cache.lock(long_domain):  # the lock file is named the same way
        pass
    (cache.root / "run" / "link").symlink_to(tmp_path)
    with pytest.raises(Exception, match="leads out of"):
        within(cache.root / "run", "link", "x")


def test_generated_disks_and_their_directories_are_private(tmp_path):
    run_dir = tmp_path / "run" / "ns_vm"
    (tmp_path / "run").mkdir()
    private_dirs(tmp_path / "run", run_dir)
    planned = gendisks.Planned(run_dir / "cloud-init-data" / "ns" / "vm" / "noCloud.iso", "cidata", {"user-data": b"password: x"})
    gendisks.make(planned, run_dir)
    for directory in (run_dir, run_dir / "cloud-init-data", run_dir / "cloud-init-data" / "ns", planned.path.parent):
        st = directory.stat()
        assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o700, os.geteuid()), directory  # root's while prepared (rundir)
    assert stat.S_IMODE(planned.path.stat().st_mode) == 0o600
    # as the launcher runs it: the image is given to qemu (107:107 as root), still 0600
    gendisks.make(planned, run_dir, give_to_qemu)
    st = planned.path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and (os.geteuid() != 0 or (st.st_uid, st.st_gid) == (QEMU_UID, QEMU_UID))



def test_private_dirs_unprivileged_are_0700():
    # the launcher as the qemu user (qemu:///session runs qemu as that same user)
    with qemu_scratch("private-") as root:
        top = root / "top"
        top.mkdir()
        os.chown(top, QEMU_UID, QEMU_UID)
        code = ("import sys; from pathlib import Path; from launcher.node.cache import private_dirs;"
                "private_dirs(Path(sys.argv[1]), Path(sys.argv[1]) / 'a' / 'b')")
        subprocess.run(["setpriv", f"--reuid={QEMU_UID}", f"--regid={QEMU_UID}", "--clear-groups", sys.executable, "-c", code, str(top)],
                       check=True, cwd=Path(__file__).parent.parent)
        for d in (top / "a", top / "a" / "b"):
            assert stat.S_IMODE(d.stat().st_mode) == 0o700 and d.stat().st_uid == QEMU_UID


# ---------------------------------------------------------------- the CLI: one line, nothing written

def _launch(args, cwd: Path, memory_limit: int | None = None) -> subprocess.CompletedProcess:
    def limit():
        if memory_limit:
            resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    env = {**os.environ, "CI": "true", "DISKKIT_CACHE": str(cwd / "cache"), "PYTHONPATH": str(Path(__file__).parent.parent)}
    return subprocess.run(launcher_command(*args), check=False, capture_output=True, text=True, cwd=cwd, env=env,
                          preexec_fn=limit, timeout=120)


BAD_INPUTS = {
    "dotdot-name": json.dumps(vmi_doc("../../etc")),
    "dotdot-namespace": json.dumps(vmi_doc("vm", "../..")),
    "slash-name": json.dumps(vmi_doc("x/../../../../escaped")),
    "upper-name": json.dumps(vmi_doc("Web")),
    "underscore-name": json.dumps(vmi_doc("web_1")),
    "nul-serial": json.dumps(_with("firmware.serial", "a\0b")),
    "nul-kernel-args": json.dumps(_with("kernelArgs", "console=ttyS0\0")),
    "nul-label": json.dumps(vmi_doc(labels={"a": "b\0"})),
    "long-name": json.dumps(vmi_doc(LONG_NAME + "x")),
    "not-utf8": b"apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {name: caf\xe9}\n",
    "billion-laughs": BILLION_LAUGHS,
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
@pytest.mark.parametrize("command", ["run", "domain"])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, case, command):
    work = tmp_path / "work"
    work.mkdir()
    content = BAD_INPUTS[case]
    vmi = work / "vmi.yaml"
    vmi.write_bytes(content if isinstance(content, bytes) else content.encode())
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    # A billion-laughs expansion would need gigabytes; the limit turns any such growth into a failure.
    result = _launch([command, vmi], work, memory_limit=1 << 30)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("launcher: ") and "Traceback" not in result.stderr, result.stderr
    assert str(vmi) in lines[0] or "metadata" in lines[0] or "spec." in lines[0], lines[0]
    assert result.stdout == ""
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert not (Path("/etc") / "escaped").exists()


def test_manifests_bomb_is_refused_under_a_memory_limit(tmp_path):
    work = tmp_path / "work"
    manifests = work / "k8s"
    manifests.mkdir(parents=True)
    (manifests / "bomb.yaml").write_text(BILLION_LAUGHS.replace("VirtualMachineInstance", "ConfigMap").replace("kubevirt.io/v1", "v1"))
    vmi = work / "vmi.yaml"
    vmi.write_text(json.dumps(vmi_doc()))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    result = _launch(["domain", "--manifests", manifests, vmi], work, memory_limit=1 << 30)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"launcher: {manifests / 'bomb.yaml'}: not valid YAML: document contains excessive aliasing"], result.stderr
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_a_chap_user_name_from_a_secret_must_be_xml_text():
    # the user name lands in the domain's <auth username=...>; the password goes to a libvirt secret
    from launcher.spec.k8s import network_disk, resolve_claim

    def objects(username: bytes):
        return Objects([
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "data", "namespace": "apps"},
             "spec": {"volumeName": "pv"}, "status": {"phase": "Bound"}},
            {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "pv"},
             "spec": {"claimRef": {"namespace": "apps", "name": "data"}, "iscsi": {
                 "targetPortal": "192.0.2.10", "iqn": "iqn.2013-07.com.example:t", "chapAuthSession": True, "secretRef": {"name": "chap"}}}},
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "chap", "namespace": "apps"},
             "data": {"node.session.auth.username": base64.b64encode(username).decode(),
                      "node.session.auth.password": base64.b64encode(b"\0any\xffbytes").decode()}},
        ])

    def disk(username: bytes):
        found = objects(username)
        return network_disk(found, resolve_claim(found, "apps", "data", "vmi.yaml"), "vmi.yaml")

    assert disk(b"vmuser").source.auth_username == "vmuser"
    for bad, needle in [(b"vm\0user", "data.node.session.auth.username: must not contain the character U+0000"),
                        (b"vm\xffuser", "data.node.session.auth.username is not UTF-8 text")]:
        with pytest.raises(DiskkitError) as err:
            disk(bad)
        assert str(err.value).startswith("vmi.yaml: secret apps/chap") and needle in str(err.value), err.value


def test_a_vmi_on_stdin_is_read_as_a_file_is_within_the_same_bounds(tmp_path):
    # `launcher domain -` and `launcher run -` read the spec from stdin, as `kubectl apply -f -`.
    bare = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "piped"},
            "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}}, "devices": {"disks": [{"name": "s", "disk": {"bus": "virtio"}}]}},
                     "volumes": [{"name": "s", "emptyDisk": {"capacity": "16Mi"}}]}}

    def domain(text: bytes) -> subprocess.CompletedProcess:
        return subprocess.run(launcher_command("domain", "--accel", "qemu", "--cache-dir", tmp_path / "cache", "-"), input=text,
                              capture_output=True, env={**os.environ, "CI": "true"}, timeout=120)

    done = domain(("# YAML, or JSON\n" + json.dumps(bare)).encode())
    assert done.returncode == 0, done.stderr
    assert b"<name>default_piped</name>" in done.stdout
    two = domain((json.dumps(bare) + "\n---\n" + json.dumps(bare)).encode())
    assert two.returncode != 0 and b"stdin: must hold one VirtualMachineInstance or VirtualMachine document, not 2" in two.stderr, two.stderr
    big = domain(b"# " + b"x" * MAX_MANIFEST_BYTES)
    assert big.returncode != 0 and b"stdin: is larger than 3145728 bytes" in big.stderr, big.stderr

"""Generated disks without a VM: what goes on the cloud-init and config ISOs, the ISOs themselves read
back by real tools (isoinfo, xorriso), their reproducibility, and the vhostmd metrics disk format."""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import time

import pytest

from diskkit.errors import DiskkitError
from launcher.spec.fields import SpecError
from launcher.spec.k8s import Objects
from launcher.spec.vmi import parse_vmi
from launcher.volumes import cloudinit, configdisks, gendisks, iso, vhostmd

UUID = "5d307ca9-b3ef-428c-8861-06e72d69f223"


def vmi_doc(volumes, name="web.example", namespace="ns", **spec):
    disks = [{"name": v["name"], "disk": {"bus": "virtio"}} for v in volumes]
    return {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "namespace": namespace, "uid": "1234-abcd",
                     "labels": {"app": "web", "tier": "front-end"},  # label values cannot hold a quote; annotations can
                     "annotations": {"kubevirt.io/instancetype-name": "u1.small", "note": 'line1\n"line2"'}},
        "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}}, "devices": {"disks": disks},
                            "firmware": {"uuid": UUID}},
                 "volumes": volumes, **spec},
    }


def parse_error(volume) -> str:
    with pytest.raises(SpecError) as err:
        parse_vmi(vmi_doc([volume]))
    return str(err.value)


# ---------------------------------------------------------------- cloud-init content

def test_nocloud_files_hold_kubevirts_meta_data():
    doc = vmi_doc([{"name": "ci", "cloudInitNoCloud": {"userData": "#cloud-config\npassword: x\n", "networkData": "version: 2\n"}}])
    vmi = parse_vmi(doc)
    data = cloudinit.resolve("ci", vmi.volume("ci").source)
    files = cloudinit.nocloud_files(vmi, data)
    # JSON as Go's json.Marshal writes NoCloudMetadata: field order, compact, hostname cut at the first dot
    assert files["meta-data"] == b'{"instance-type":"u1.small","instance-id":"' + UUID.encode() + b'","local-hostname":"web"}'
    assert files["user-data"] == b"#cloud-config\npassword: x\n"
    assert files["network-config"] == b"version: 2\n"


def test_configdrive_files_hold_kubevirts_meta_data_json():
    doc = vmi_doc([{"name": "cd", "cloudInitConfigDrive": {"userDataBase64": base64.b64encode(b"#!/bin/sh\necho hi\n").decode()}}],
                  hostname="custom-host")
    vmi = parse_vmi(doc)
    files = cloudinit.configdrive_files(vmi, cloudinit.resolve("cd", vmi.volume("cd").source))
    assert set(files) == {"openstack/latest/meta_data.json", "openstack/latest/user_data"}  # no network data, no file
    assert json.loads(files["openstack/latest/meta_data.json"]) == {
        "instance_type": "u1.small", "instance_id": "web.example.ns", "hostname": "custom-host", "uuid": UUID}
    assert files["openstack/latest/meta_data.json"].startswith(b'{"instance_type":"u1.small","instance_id":"web.example.ns",')
    assert files["openstack/latest/user_data"] == b"#!/bin/sh\necho hi\n"


def test_go_json_escapes_like_go():
    assert cloudinit.go_json({"a": "<b>&\u2028é"}) == '{"a":"\\u003cb\\u003e\\u0026\\u2028é"}'.encode()


def test_hostname_is_cut_to_a_dns_label():
    vmi = parse_vmi(vmi_doc([{"name": "ci", "cloudInitNoCloud": {"userData": "x"}}], name="a" * 70))
    assert cloudinit.hostname(vmi) == "a" * 63


def test_user_data_from_secrets_takes_the_first_key_found():
    source = parse_vmi(vmi_doc([{"name": "ci", "cloudInitNoCloud": {
        "secretRef": {"name": "u"}, "networkDataSecretRef": {"name": "n"}}}])).volume("ci").source
    data = cloudinit.resolve("ci", source, {"userData": b"late", "userdata": b"first"}, {"networkData": b"net"})
    assert data == cloudinit.CloudInitData(b"first", b"net")
    with pytest.raises(DiskkitError, match="no cloud-init data-source found at volume: ci"):
        cloudinit.resolve("ci", source, {"other": b"x"}, {"other": b"y"})


@pytest.mark.parametrize("source, message", [
    ({"userData": "a", "userDataBase64": "YQ=="}, "spec.volumes[0].cloudInitNoCloud: must have only one userdatasource set."),
    ({"userDataBase64": "not base64!"}, "spec.volumes[0].cloudInitNoCloud.userDataBase64: is not a valid base64 value."),
    ({"userDataBase64": "YQ"}, "spec.volumes[0].cloudInitNoCloud.userDataBase64: is not a valid base64 value."),
    ({"networkDataBase64": "%%%"}, "spec.volumes[0].cloudInitNoCloud.networkDataBase64: is not a valid base64 value."),
    ({"networkData": "a", "networkDataSecretRef": {"name": "s"}},
     "spec.volumes[0].cloudInitNoCloud: must have only one networkdata source set."),
    ({"userData": "x" * 2049},
     "spec.volumes[0].cloudInitNoCloud: userdata exceeds 2048 byte limit. Should use UserDataSecretRef for larger data."),
    ({"networkDataBase64": base64.b64encode(b"x" * 2049).decode()},
     "spec.volumes[0].cloudInitNoCloud: networkdata exceeds 2048 byte limit. Should use NetworkDataSecretRef for larger data."),
])
def test_cloud_init_validation_uses_kubevirts_messages(source, message):
    assert parse_error({"name": "ci", "cloudInitNoCloud": source}) == message


def test_user_data_at_the_limit_and_base64_with_line_breaks_are_accepted():
    encoded = base64.encodebytes(b"y" * 2048).decode()  # wrapped at 76 columns, as `base64` prints it
    vmi = parse_vmi(vmi_doc([{"name": "ci", "cloudInitConfigDrive": {"userDataBase64": encoded}}]))
    assert vmi.volume("ci").source.user_data == b"y" * 2048


def test_bad_hostname_is_refused():
    with pytest.raises(SpecError, match=r"^spec.hostname: does not conform to the kubernetes DNS_LABEL rules : a lowercase RFC 1123 label"):
        parse_vmi(vmi_doc([{"name": "ci", "cloudInitNoCloud": {"userData": "x"}}], hostname="Not_Valid"))


# ---------------------------------------------------------------- config disks content

def test_configmap_and_secret_files():
    cm = {"kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"app.conf": "k=v\n"},
          "binaryData": {"blob.bin": base64.b64encode(b"\x00\xff").decode()}}
    assert configdisks.configmap_files(cm) == {"app.conf": b"k=v\n", "blob.bin": b"\x00\xff"}
    secret = {"kind": "Secret", "metadata": {"name": "s"}, "data": {"password": base64.b64encode(b"hunter2").decode(), "user": "YQ=="},
              "stringData": {"user": "admin"}}
    assert configdisks.secret_files(secret) == {"password": b"hunter2", "user": b"admin"}  # stringData wins
    with pytest.raises(DiskkitError, match="data.password: is not valid base64"):
        configdisks.secret_files({**secret, "data": {"password": "***"}})
    with pytest.raises(DiskkitError, match="a valid config key"):
        configdisks.configmap_files({**cm, "data": {"../escape": "x"}})


def test_service_account_token_secret_is_found_by_type_and_annotation():
    token = {"kind": "Secret", "type": "kubernetes.io/service-account-token",
             "metadata": {"name": "builder-token-x", "annotations": {"kubernetes.io/service-account.name": "builder"}},
             "data": {"token": base64.b64encode(b"eyJ.tok").decode(), "ca.crt": base64.b64encode(b"PEM").decode()}}
    other = {**token, "metadata": {"name": "a-other", "annotations": {"kubernetes.io/service-account.name": "default"}}}
    opaque = {**token, "type": "Opaque", "metadata": {"name": "b", "annotations": {"kubernetes.io/service-account.name": "builder"}}}
    assert configdisks.service_account_token_secret([other, opaque, token], "builder") is token
    assert configdisks.service_account_token_secret([other, opaque], "builder") is None
    # namespace comes from the Secret's data when there, else from the VMI's namespace
    assert configdisks.service_account_files(token, "ns") == {"namespace": b"ns", "token": b"eyJ.tok", "ca.crt": b"PEM"}


def test_downward_api_renders_fields_as_the_kubelet_does():
    fields = [
        {"path": "name", "fieldRef": {"fieldPath": "metadata.name"}},
        {"path": "meta/namespace", "fieldRef": {"fieldPath": "metadata.namespace"}, "mode": 0o600},
        {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
        {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
        {"path": "app", "fieldRef": {"fieldPath": "metadata.labels['app']"}},
        {"path": "missing", "fieldRef": {"fieldPath": "metadata.labels['nope']"}},
        {"path": "uid", "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.uid"}},
    ]
    vmi = parse_vmi(vmi_doc([{"name": "dapi", "downwardAPI": {"fields": fields}}]))
    files, modes = configdisks.downward_api_files(vmi, vmi.volume("dapi").source.fields)
    assert files == {
        "name": b"web.example", "meta/namespace": b"ns",
        "labels": b'app="web"\ntier="front-end"',
        "annotations": b'kubevirt.io/instancetype-name="u1.small"\nnote="line1\\n\\"line2\\""',
        "app": b"web", "missing": b"", "uid": b"1234-abcd",
    }
    assert modes == {"meta/namespace": 0o600}


def test_go_quote_matches_strconv_quote():
    assert configdisks.go_quote('a"b\\c\n\t\x01\x7fé\u00a0😀') == '"a\\"b\\\\c\\n\\t\\x01\\x7fé\\u00a0😀"'


@pytest.mark.parametrize("item, message", [
    ({"path": "/abs", "fieldRef": {"fieldPath": "metadata.name"}}, "fields[0].path: must be a relative path"),
    ({"path": "a/../b", "fieldRef": {"fieldPath": "metadata.name"}}, "fields[0].path: must not contain '..'"),
    ({"path": "n", "fieldRef": {"fieldPath": "spec.nodeName"}}, 'fields[0].fieldRef.fieldPath: Unsupported value: "spec.nodeName"'),
    ({"path": "n"}, "fields[0]: must specify one of: `fieldRef` or `resourceFieldRef`"),
    ({"path": "n", "fieldRef": {"fieldPath": "metadata.name"}, "mode": 0o1000}, "fields[0].mode: must be a number between 0 and 0777"),
])
def test_downward_api_fields_are_validated(item, message):
    assert message in parse_error({"name": "d", "downwardAPI": {"fields": [item]}})


# ---------------------------------------------------------------- lookups (manifests and pod mounts)

def test_missing_objects_and_optional_ones(tmp_path):
    objects = Objects([{"kind": "ConfigMap", "metadata": {"name": "there", "namespace": "ns"}, "data": {"k": "v"}}])
    volumes = [{"name": "cm", "configMap": {"name": "there"}}, {"name": "gone", "configMap": {"name": "gone", "optional": True}},
               {"name": "sec", "secret": {"secretName": "absent"}}]
    vmi = parse_vmi(vmi_doc(volumes))
    gen = gendisks.Generator(vmi, tmp_path / "run", gendisks.Sources(objects, tmp_path / "nopod"))
    assert gen.config(vmi.volume("cm"), "at").files == {"k": b"v"}
    assert gen.config(vmi.volume("gone"), "at").files == {}  # optional and missing: an empty ISO, as KubeVirt does
    with pytest.raises(DiskkitError) as err:
        gen.config(vmi.volume("sec"), "spec.volumes[2].secret")
    assert str(err.value) == 'spec.volumes[2].secret: secrets "absent" not found in namespace ns'
    without = gendisks.Generator(vmi, tmp_path / "run", gendisks.Sources(None, tmp_path / "nopod"))
    with pytest.raises(DiskkitError, match="give --manifests DIR holding it"):
        without.config(vmi.volume("sec"), "at")


def test_pod_mounts_are_read_without_the_kubelets_bookkeeping(tmp_path):
    mount = tmp_path / "pod" / "config-map" / "cm"
    data = mount / "..2024_01_01_00_00_00.000"
    (data / "sub").mkdir(parents=True)
    (data / "app.conf").write_text("x=1\n")
    (data / "sub" / "deep").write_text("d")
    (mount / "..data").symlink_to(data.name)
    (mount / "app.conf").symlink_to("..data/app.conf")
    (mount / "sub").symlink_to("..data/sub")
    assert gendisks.read_mount(mount) == {"app.conf": b"x=1\n", "sub/deep": b"d"}
    vmi = parse_vmi(vmi_doc([{"name": "cm", "configMap": {"name": "whatever", "volumeLabel": "CFG"}}]))
    planned = gendisks.Generator(vmi, tmp_path / "run", gendisks.Sources(None, tmp_path / "pod")).config(vmi.volume("cm"), "at")
    assert planned.files == {"app.conf": b"x=1\n", "sub/deep": b"d"}
    assert planned.volume_id == "CFG" and planned.path == tmp_path / "run" / "config-map-disks" / "cm.iso"


def test_service_account_without_token_fails_clearly(tmp_path):
    vmi = parse_vmi(vmi_doc([{"name": "sa", "serviceAccount": {"serviceAccountName": "builder"}}]))
    gen = gendisks.Generator(vmi, tmp_path, gendisks.Sources(Objects([]), tmp_path, tmp_path / "no-sa"))
    with pytest.raises(DiskkitError) as err:
        gen.service_account(vmi.volume("sa"), "spec.volumes[0].serviceAccount")
    assert str(err.value).startswith("spec.volumes[0].serviceAccount: serviceAccount builder: no token Secret for it in namespace ns"
                                     " (type kubernetes.io/service-account-token, annotation kubernetes.io/service-account.name: builder)")


def test_a_second_cloud_init_volume_of_one_kind_shares_the_first_ones_image(tmp_path):
    # virt-launcher makes one noCloud.iso from the first cloudInitNoCloud volume and points every such
    # disk at it (converter testdata/domain_x86_64.xml renders two disks on one file).
    volumes = [{"name": "a", "cloudInitNoCloud": {"userData": "x"}}, {"name": "b", "cloudInitNoCloud": {"userData": "y"}}]
    vmi = parse_vmi(vmi_doc(volumes))
    gen = gendisks.Generator(vmi, tmp_path, gendisks.Sources())
    first = gen.cloud_init(vmi.volume("a"), "spec.volumes[0].cloudInitNoCloud")
    second = gen.cloud_init(vmi.volume("b"), "spec.volumes[1].cloudInitNoCloud")
    assert second.path == first.path and second.files == first.files
    assert first.files["user-data"] == b"x"


# ---------------------------------------------------------------- ISO images, read by real tools

FILES = {"meta-data": b"instance-id: x\n", "openstack/latest/user_data": b"#cloud-config\n",
         "a-name-much-longer-than-any-iso9660-or-joliet-name-allows-so-it-must-be-cut.json": b"{}", "UPPER.txt": b"u"}


def run(*cmd) -> str:
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True).stdout


def test_iso_is_read_by_isoinfo_and_xorriso_with_joliet_and_rock_ridge(tmp_path):
    image = iso.write_iso(tmp_path / "x.iso", "config-2", FILES, {"meta-data": 0o600})
    info = run("isoinfo", "-d", "-i", image)
    assert "Volume id: config-2" in info
    assert "Joliet with UCS level 3 found" in info
    assert "Rock Ridge signatures version 1 found" in info
    rock = run("isoinfo", "-R", "-f", "-i", image).split()
    assert sorted(rock) == sorted(["/" + p for p in FILES] + ["/openstack", "/openstack/latest"])
    joliet = run("isoinfo", "-J", "-f", "-i", image).split()
    assert "/openstack/latest/user_data" in joliet and "/meta-data" in joliet
    out = tmp_path / "extracted"
    run("xorriso", "-osirrox", "on", "-indev", image, "-extract", "/", out)
    assert {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()} == FILES
    assert subprocess.run(["isoinfo", "-R", "-i", image, "-x", "/openstack/latest/user_data"], capture_output=True).stdout == FILES[
        "openstack/latest/user_data"]
    listing = run("isoinfo", "-R", "-l", "-i", image)
    assert "-rw-------   1    0    0" in listing.split("meta-data")[0].splitlines()[-1]  # the mode given, owner root
    assert not (tmp_path / "x.iso.staging").exists()
    assert image.stat().st_size % (1 << 20) == 0  # padded for qemu's O_DIRECT alignment


def test_iso_is_reproducible_whatever_the_clock_and_time_zone(tmp_path, monkeypatch):
    first = iso.write_iso(tmp_path / "a.iso", "cidata", FILES).read_bytes()
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    time.tzset()
    second = iso.write_iso(tmp_path / "b.iso", "cidata", dict(reversed(list(FILES.items())))).read_bytes()
    assert first == second
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    third = iso.write_iso(tmp_path / "c.iso", "cidata", FILES).read_bytes()
    assert third != first
    assert "Nov 14 2023" in run("isoinfo", "-R", "-l", "-i", tmp_path / "c.iso")
    assert "Jan  1 1970" in run("isoinfo", "-R", "-l", "-i", tmp_path / "a.iso")
    assert iso.write_iso(tmp_path / "d.iso", "cidata", {**FILES, "meta-data": b"other"}).read_bytes() != third
    monkeypatch.delenv("TZ")
    time.tzset()


def test_empty_iso_has_an_empty_volume_id_like_kubevirts_unlabelled_ones(tmp_path):
    image = iso.write_iso(tmp_path / "e.iso", "", {})
    info = run("isoinfo", "-d", "-i", image)
    assert "Volume id: \n" in info
    assert run("isoinfo", "-R", "-f", "-i", image).strip() == ""


def test_iso_refuses_bad_paths_and_leaves_nothing(tmp_path):
    for files in ({"../x": b""}, {"/abs": b""}, {"a": b"", "a/b": b""}):
        with pytest.raises(ValueError):
            iso.write_iso(tmp_path / "bad.iso", "x", files)
    with pytest.raises(ValueError):
        iso.write_iso(tmp_path / "bad.iso", "x" * 33, {})
    assert list(tmp_path.iterdir()) == []


def test_generated_disks_belong_to_whoever_finishes_them(tmp_path):
    seen = []
    planned = gendisks.Planned(tmp_path / "d" / "x.iso", "L", {"f": b"1"})
    gendisks.make(planned, tmp_path, lambda staging: seen.append((staging.name, staging.exists())))
    assert seen == [("x.iso.staging", True)] and planned.path.exists()


# ---------------------------------------------------------------- vhostmd metrics disk

def test_vhostmd_disk_layout(tmp_path):
    path = vhostmd.create(tmp_path / "vhostmd0")
    raw = path.read_bytes()
    assert len(raw) == vhostmd.SIZE
    assert raw[:16] == b"mvbd" + struct.pack(">iii", 0, sum(b"<metrics></metrics>\n"), 20)
    assert raw[16:36] == b"<metrics></metrics>\n"
    stats = vhostmd.VMStats(cpu_time_ns=2_500_000_000, vcpus=2, memory_kib=131072)
    vhostmd.write(path, vhostmd.report(stats, "9.2.0", hostname="node01"))
    raw = path.read_bytes()
    signature, flag, checksum, length = struct.unpack(">4siii", raw[:16])
    body = raw[16:16 + length]
    assert (signature, flag, checksum) == (b"mvbd", 0, sum(body))
    assert len(raw) == vhostmd.SIZE
    text = body.decode()
    assert text.startswith('<metrics>\n  <metric type="string" context="host">\n    <name>HostName</name>\n'
                           "    <value><![CDATA[node01]]></value>\n  </metric>\n")
    assert '<metric type="real64" context="vm" unit="s">\n    <name>TotalCPUTime</name>\n    <value><![CDATA[2.500000]]></value>' in text
    assert '<metric type="uint64" context="vm">\n    <name>ResourceProcessorLimit</name>\n    <value><![CDATA[2]]></value>' in text
    assert '<name>ResourceMemoryLimit</name>\n    <value><![CDATA[131072]]></value>' in text
    for name in ("NumberOfPhysicalCPUs", "FreePhysicalMemory", "UsedVirtualMemory", "PagedOutMemory", "Time", "VirtProductInfo"):
        assert f"<name>{name}</name>" in text
    assert text.endswith("</metrics>\n")


def test_vhostmd_host_metrics_from_a_fixed_proc(tmp_path):
    proc, sys = tmp_path / "proc", tmp_path / "sys"
    proc.mkdir()
    (proc / "stat").write_text("cpu  100 20 30 400 0 0 0 0 0 0\ncpu0 1 2 3 4\n")
    (proc / "meminfo").write_text("MemTotal: 1000 kB\nMemFree: 100 kB\nBuffers: 50 kB\nCached: 200 kB\n"
                                  "SwapTotal: 64 kB\nSwapFree: 32 kB\nSwapCached: 8 kB\n")
    (proc / "vmstat").write_text("pswpin 3\npswpout 5\n")
    for cpu, package in ((0, 0), (1, 0), (2, 1)):
        topo = sys / f"devices/system/cpu/cpu{cpu}/topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
    metrics = {m.name: m for m in vhostmd.host_metrics(proc, sys, now=1700000000)}
    ticks = os.sysconf("SC_CLK_TCK")
    page_kib = os.sysconf("SC_PAGESIZE") // 1024
    assert metrics["NumberOfPhysicalCPUs"].value == "2"
    assert metrics["TotalCPUTime"].value == f"{150 / ticks:.6f}"
    assert metrics["FreeVirtualMemory"].value == "132"
    assert metrics["MemoryAllocatedToVirtualServers"].value == "650"
    assert metrics["UsedVirtualMemory"].value == str(1000 + 64 - 100 - 200 - 50 - 8)
    assert metrics["PagedOutMemory"].value == str(5 * page_kib)
    assert metrics["Time"] == vhostmd.Metric("Time", "int64", "host", "1700000000", "s")


def test_vhostmd_refresher_rewrites_until_the_vm_is_gone(tmp_path):
    path = vhostmd.create(tmp_path / "vhostmd0")
    answers = [vhostmd.VMStats(1, 1, 1024), vhostmd.VMStats(2, 1, 1024), None]
    refresher = vhostmd.Refresher(path, lambda: answers.pop(0), "9.2.0", every=0.01).start()
    refresher._thread.join(timeout=10)
    assert refresher.writes == 2 and refresher.error is None
    assert b"<name>TotalCPUTime</name>\n    <value><![CDATA[0.000000]]>" in path.read_bytes()
    refresher.stop()


def test_objects_of_kind_lists_one_namespace_in_name_order():
    objects = Objects([{"kind": "Secret", "metadata": {"name": n, "namespace": ns}} for n, ns in
                       (("b", "ns"), ("a", "ns"), ("c", "other"), ("d", None))])
    assert [d["metadata"]["name"] for d in objects.of_kind("Secret", "ns")] == ["a", "b"]
    assert [d["metadata"]["name"] for d in objects.of_kind("Secret", None)] == ["d"]  # no namespace: default
    assert objects.of_kind("ConfigMap", "ns") == []

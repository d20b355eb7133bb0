"""VMI -> libvirt domain XML: golden files checked byte for byte and against libvirt's schema, plus edge rules.

Each tests/golden/domain/NAME.yaml is a VMI with `x-resolved` (volume -> ResolvedDisk fields, `network`
as NetworkSource fields) and an optional `x-host` (Host fields); NAME.xml is the expected render.
UPDATE_GOLDEN=1 rewrites the .xml files.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from launcher.render.domain import Host, ResolvedDisk, io_threads, render, secret_xml
from launcher.spec.fields import SpecError
from launcher.spec.k8s import NetworkSource
from launcher.spec.vmi import parse_vmi

GOLDEN = Path(__file__).parent / "golden" / "domain"
CASES = sorted(p.stem for p in GOLDEN.glob("*.yaml"))


def network_source(fields: dict) -> NetworkSource:
    return NetworkSource(**{**fields, "hosts": tuple(tuple(h) for h in fields["hosts"])})


def resolved_disk(fields: dict) -> ResolvedDisk:
    return ResolvedDisk(**{**fields, "backing": tuple(fields["backing"]) if fields.get("backing") else None,
                           "network": network_source(fields["network"]) if fields.get("network") else None,
                           "backing_network": network_source(fields["backing_network"]) if fields.get("backing_network") else None,
                           "block_io": tuple(fields["block_io"]) if fields.get("block_io") else None})


def load_case(name: str):
    doc = yaml.safe_load((GOLDEN / f"{name}.yaml").read_text())
    resolved = {volume: resolved_disk(fields) for volume, fields in doc.pop("x-resolved").items()}
    host_fields = doc.pop("x-host", {})
    if "topology" in host_fields:
        host_fields["topology"] = tuple(tuple(tuple(core) for core in cell) for cell in host_fields["topology"])
        host_fields["cpuset"] = tuple(host_fields["cpuset"])
    if "dac_label" in host_fields:
        host_fields["dac_label"] = tuple(host_fields["dac_label"])
    if "virtiofs_sockets" in host_fields:
        host_fields["virtiofs_sockets"] = tuple(tuple(pair) for pair in host_fields["virtiofs_sockets"])
    host = Host(**host_fields)
    return parse_vmi(doc), resolved, host


def validate(path: Path, schema: str = "domain") -> None:
    tool = shutil.which("virt-xml-validate")
    if tool is None:
        pytest.fail("virt-xml-validate is missing (Debian package libvirt-clients); golden XML cannot be checked")
    proc = subprocess.run([tool, str(path), schema], capture_output=True, text=True)
    assert proc.returncode == 0, f"{path.name} is not a valid libvirt {schema}:\n{proc.stdout}{proc.stderr}"


def test_every_golden_has_both_halves():
    assert CASES, "no golden cases found"
    assert sorted(p.stem for p in GOLDEN.glob("*.xml")) == CASES


@pytest.mark.parametrize("name", CASES)
def test_golden(name):
    vmi, resolved, host = load_case(name)
    xml = render(vmi, resolved, host)
    expected = GOLDEN / f"{name}.xml"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        expected.write_text(xml)
    assert xml == expected.read_text()
    validate(expected)


# ---------------------------------------------------------------- edge rules, without goldens

def vmi_doc(disks=None, volumes=None, **domain):
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": "edge", "namespace": "ns"},
        "spec": {
            "domain": {"resources": {"requests": {"memory": "64Mi"}}, "devices": {"disks": disks or []}, **domain},
            "volumes": volumes or [{"name": "root", "containerDisk": {"image": "quay.io/x/y:1"}}],
        },
    }


ROOT = {"root": ResolvedDisk("/run/root.qcow2", "qcow2", backing=("/cache/root.img", "raw"))}


def render_error(doc, disks, host=Host()) -> str:
    with pytest.raises(SpecError) as err:
        render(parse_vmi(doc), disks, host)
    return str(err.value)


def test_explicit_cache_none_without_direct_io_is_refused():
    doc = vmi_doc([{"name": "root", "cache": "none", "disk": {"bus": "virtio"}}])
    disks = {"root": ResolvedDisk("/dev/shm/root.qcow2", "qcow2", direct_io=False)}
    assert render_error(doc, disks) == (
        "spec.domain.devices.disks[0].cache: Unable to use 'none' cache mode, file system where /dev/shm/root.qcow2"
        " is stored does not support direct I/O"
    )


def test_shareable_forces_cache_none_and_so_needs_direct_io():
    doc = vmi_doc([{"name": "root", "shareable": True, "disk": {"bus": "virtio"}}])
    assert "<shareable />" in render(parse_vmi(doc), ROOT, Host())
    disks = {"root": ResolvedDisk("/dev/shm/root.img", "raw", direct_io=False)}
    assert render_error(doc, disks).startswith("spec.domain.devices.disks[0].cache: Unable to use 'none' cache mode")


def test_lun_on_a_file_based_pvc_uses_kubevirts_message():
    doc = vmi_doc([{"name": "san", "lun": {"bus": "scsi"}}], [{"name": "san", "persistentVolumeClaim": {"claimName": "san"}}])
    disks = {"san": ResolvedDisk("/pvc/san/disk.img", "raw")}
    assert render_error(doc, disks) == "spec.domain.devices.disks[0]: device san is of type lun. Not compatible with a file based disk"


def test_native_io_needs_cache_none():
    doc = vmi_doc([{"name": "root", "io": "native", "cache": "writethrough", "disk": {"bus": "virtio"}}])
    assert render_error(doc, ROOT) == "spec.domain.devices.disks[0].io: io native needs cache none, but the cache mode is writethrough"


def test_read_only_file_cannot_be_a_sata_hard_disk():
    disks = {"root": ResolvedDisk("/run/root.img", "raw", read_only=True)}
    # the volume has no disk, so KubeVirt's defaulting gave it a sata one: blame the volume
    assert render_error(vmi_doc(), disks) == "spec.volumes[0]: sata hard-disks do not support read-only."
    doc = vmi_doc([{"name": "root", "disk": {}}])
    assert render_error(doc, disks) == "spec.domain.devices.disks[0].disk.bus: sata hard-disks do not support read-only."


def test_every_volume_needs_a_resolved_disk():
    assert render_error(vmi_doc(), {}) == "spec.volumes[0]: no resolved disk for volume root"


def test_unresolved_kernel_is_an_error():
    doc = vmi_doc(firmware={"kernelBoot": {"container": {"image": "k:1", "kernelPath": "/vmlinuz"}}})
    assert render_error(doc, ROOT) == (
        "spec.domain.firmware.kernelBoot.container.kernelPath: /vmlinuz was not resolved to a file on the host"
    )


def test_unknown_resolved_type_is_refused():
    disks = {"root": ResolvedDisk("nvme://x", "raw", type="nvme")}
    assert render_error(vmi_doc(), disks) == "spec.volumes[0]: volume root resolved to an unsupported disk type nvme"


def test_device_names_continue_past_z_like_the_kernel():
    volumes = [{"name": f"d{i}", "emptyDisk": {"capacity": "1Mi"}} for i in range(28)]
    disks = [{"name": f"d{i}", "disk": {"bus": "virtio"}} for i in range(28)]
    resolved = {f"d{i}": ResolvedDisk(f"/run/d{i}.qcow2", "qcow2") for i in range(28)}
    xml = render(parse_vmi(vmi_doc(disks, volumes)), resolved, Host())
    assert 'dev="vdz"' in xml and 'dev="vdaa"' in xml and 'dev="vdab"' in xml


def test_auto_pool_keeps_one_shared_thread_when_dedicated_disks_fill_it():
    volumes = [{"name": n, "emptyDisk": {"capacity": "1Mi"}} for n in "abcd"]
    disks = [{"name": n, "dedicatedIOThread": n != "d", "disk": {"bus": "virtio"}} for n in "abcd"]
    vmi = parse_vmi(vmi_doc(disks, volumes, ioThreadsPolicy="auto"))  # no CPU request: limit 2
    assert io_threads(vmi) == (4, 1)
    xml = render(vmi, {n: ResolvedDisk(f"/run/{n}.qcow2", "qcow2") for n in "abcd"}, Host())
    assert [line.split('iothread="')[1][0] for line in xml.splitlines() if "iothread=" in line] == ["2", "3", "4", "1"]


def test_no_iothreads_without_policy_or_dedicated_disk():
    vmi = parse_vmi(vmi_doc([{"name": "root", "disk": {"bus": "virtio"}}]))
    assert io_threads(vmi) == (0, 0)
    assert "iothread" not in render(vmi, ROOT, Host())


def test_render_is_deterministic_and_uuid_stable_per_namespace_and_name():
    doc = vmi_doc()
    first = render(parse_vmi(doc), ROOT, Host())
    assert render(parse_vmi(copy.deepcopy(doc)), ROOT, Host()) == first
    other = copy.deepcopy(doc)
    other["metadata"]["namespace"] = "elsewhere"
    assert parse_vmi(other).uuid != parse_vmi(doc).uuid
    assert "<name>ns_edge</name>" in first


def test_firmware_uuid_wins():
    doc = vmi_doc(firmware={"uuid": "5D307CA9-B3EF-428C-8861-06E72D69F223"})
    xml = render(parse_vmi(doc), ROOT, Host())
    assert "<uuid>5d307ca9-b3ef-428c-8861-06e72d69f223</uuid>" in xml
    assert '<entry name="uuid">5d307ca9-b3ef-428c-8861-06e72d69f223</entry>' in xml


def test_the_default_model_is_host_model_on_kvm_and_qemus_own_on_tcg():
    assert '<cpu mode="host-model">' in render(parse_vmi(vmi_doc()), ROOT, Host(domain_type="kvm"))
    tcg = render(parse_vmi(vmi_doc()), ROOT, Host(domain_type="qemu"))
    assert "<cpu>" in tcg and "mode=" not in tcg.split("<cpu>")[1].split("</cpu>")[0]


def test_an_explicit_host_cpu_model_under_emulation_is_rendered_or_refused_never_dropped():
    # KubeVirt with useEmulation renders the model as written on a qemu domain
    # (pkg/virt-launcher/virtwrap/converter/compute/cpu.go configureCPUModel, kvm/configurator.go);
    # libvirt expands host-model to what TCG emulates (its domcapabilities for virttype qemu, which
    # cmd/virt-launcher/node-labeller/node-labeller.sh reads under emulation) and refuses host-passthrough.
    model = vmi_doc(cpu={"model": "host-model"})
    assert '<cpu mode="host-model">' in render(parse_vmi(model), ROOT, Host(domain_type="qemu"))
    passthrough = vmi_doc(cpu={"model": "host-passthrough"})
    assert '<cpu mode="host-passthrough">' in render(parse_vmi(passthrough), ROOT, Host(domain_type="kvm"))
    refused = render_error(passthrough, ROOT, Host(domain_type="qemu"))
    assert refused.startswith("spec.domain.cpu.model: host-passthrough: CPU mode 'host-passthrough' for x86_64 qemu domain on x86_64 host"
                              " is not supported by hypervisor"), refused
    assert "\n" not in refused


def test_pci_address_is_rendered_for_virtio_disks(tmp_path):
    doc = vmi_doc([{"name": "root", "disk": {"bus": "virtio", "pciAddress": "0000:0a:01.2"}}])
    xml = render(parse_vmi(doc), ROOT, Host())
    assert '<address type="pci" domain="0x0000" bus="0x0a" slot="0x01" function="0x2" />' in xml
    (tmp_path / "pci.xml").write_text(xml)
    validate(tmp_path / "pci.xml")


# ---------------------------------------------------------------- network disks

CHAP = NetworkSource("iscsi", "iqn.2013-07.com.example:secure/2", (("san.example.com", 3260),), "vmuser", "iscsi", "diskkit-ns-pv-chap")
RBD = NetworkSource("rbd", "kube/vm-data", (("10.0.0.1", 6789),), "kube", "ceph", "diskkit-ns-pv-rbd")
SAN_LUN = vmi_doc([{"name": "san", "lun": {"bus": "scsi"}}], [{"name": "san", "persistentVolumeClaim": {"claimName": "san"}}])


def network(source: NetworkSource | None) -> dict[str, ResolvedDisk]:
    return {"san": ResolvedDisk("net", "raw", type="network", network=source)}


@pytest.mark.parametrize("source", [CHAP, RBD])
def test_secret_xml_is_a_valid_libvirt_secret_with_a_stable_uuid(tmp_path, source):
    xml = secret_xml(source)
    tag = "target" if source.protocol == "iscsi" else "name"
    assert f'<usage type="{source.secret_type}">\n    <{tag}>{source.secret_usage}</{tag}>' in xml
    assert '<secret ephemeral="no" private="yes">' in xml and secret_xml(source) == xml
    (tmp_path / "secret.xml").write_text(xml)
    validate(tmp_path / "secret.xml", "secret")


def test_secret_xml_needs_credentials():
    with pytest.raises(ValueError):
        secret_xml(NetworkSource("iscsi", "iqn.x:y/0", (("h", 3260),)))


def test_lun_passthrough_is_for_iscsi_network_disks_only():
    assert 'device="lun"' in render(parse_vmi(SAN_LUN), network(CHAP), Host())
    assert render_error(SAN_LUN, network(RBD)) == "spec.domain.devices.disks[0]: device san is of type lun. Not compatible with protocol rbd"


@pytest.mark.parametrize("source, problem", [
    (None, "is a network disk without a network source"),
    (NetworkSource("gluster", "x", (("h", 24007),)), "uses the unsupported network protocol gluster"),
    (NetworkSource("nbd", "x", ()), "has no host for its nbd source"),
    (NetworkSource("iscsi", "q/0", (), socket="/run/x.sock"), "has a unix socket for its iscsi source; only NBD sources without hosts take one"),
    (NetworkSource("nbd", "x", (), "u", socket="/run/x.sock"), "has nbd credentials, which the disk server does not take"),
    (NetworkSource("rbd", "p/i", ()), "has no host for its rbd source"),
    (NetworkSource("rbd", "p/i", (("h", 6789),), "kube"), "has rbd credentials but no ceph secret usage"),
    (NetworkSource("iscsi", "q/0", (("h", 3260),), "u", "ceph", "x"), "has iscsi credentials but no iscsi secret usage"),
])
def test_incomplete_network_sources_are_refused(source, problem):
    assert render_error(SAN_LUN, network(source)) == f"spec.domain.devices.disks[0]: volume san {problem}"


def test_auto_pool_is_one_thread_beside_an_isolated_emulator_thread():
    # iothreads.go getThreadPoolLimit: with a dedicated pCPU for the emulator thread the IOThread shares it
    volumes = [{"name": n, "emptyDisk": {"capacity": "1Mi"}} for n in "abc"]
    disks = [{"name": n, "disk": {"bus": "virtio"}} for n in "abc"]
    resources = {"requests": {"memory": "64Mi", "cpu": "2"}, "limits": {"memory": "64Mi", "cpu": "2"}}
    cpu = {"dedicatedCpuPlacement": True, "isolateEmulatorThread": True}
    assert io_threads(parse_vmi(vmi_doc(disks, volumes, ioThreadsPolicy="auto", resources=resources, cpu=cpu))) == (1, 1)
    assert io_threads(parse_vmi(vmi_doc(disks, volumes, ioThreadsPolicy="auto", resources=resources))) == (3, 3)

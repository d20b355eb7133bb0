"""The devices every KubeVirt domain has besides its disks and NICs, and the spec fields that shape
them, rendered as KubeVirt's converter renders them (pkg/virt-launcher/virtwrap/converter/compute:
graphics.go, input_device.go, balloon.go, channels.go, sysinfo.go; network/virtio-queues.go) and
refused as its admitter refuses them (pkg/virt-api/webhooks/validating-webhook/admitters/
vmi-create-admitter.go validateInputDevices, validateVideoConfig; pkg/virt-api/webhooks/amd64.go
validateVideoTypeAmd64). The goldens (tests/golden/domain/display-inputs, devices-off) and the
conformance corpus (tests/conformance/default-devices.yaml) hold whole domains; these are the rules."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from launcher.render.domain import Host, ResolvedDisk, render
from launcher.runtime import rundir
from launcher.spec.fields import SpecError
from launcher.spec.instancetype import expand
from launcher.spec.k8s import Objects
from launcher.spec.vmi import parse_vmi

ROOT = {"root": ResolvedDisk("/run/root.qcow2", "qcow2", backing=("/cache/root.img", "raw"))}
V1B1 = "instancetype.kubevirt.io/v1beta1"


def vmi_doc(devices=None, annotations=None, **domain):
    meta = {"name": "dev", "namespace": "ns", **({"annotations": annotations} if annotations else {})}
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": meta,
            "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}}, "devices": devices or {}, **domain},
                     "volumes": [{"name": "root", "containerDisk": {"image": "quay.io/x/y:1"}}]}}


def vm_doc(devices=None, preference=None):
    doc = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "vm1", "namespace": "ns"},
           "spec": {"template": {"spec": vmi_doc(devices)["spec"]}}}
    if preference:
        doc["spec"]["preference"] = {"name": preference}
    return doc


def domain(doc, host=Host(), objects=None) -> ET.Element:
    return ET.fromstring(render(parse_vmi(doc, objects=objects), ROOT, host))


def refusal(doc) -> str:
    with pytest.raises(SpecError) as err:
        render(parse_vmi(doc), ROOT, Host())
    return str(err.value)


def test_a_vmi_gets_kubevirts_display_balloon_agent_channel_and_smbios():
    xml = domain(vmi_doc())
    assert xml.find("devices/graphics").get("type") == "vnc"
    assert xml.find("devices/graphics/listen").attrib == {"type": "socket"}  # libvirt names the socket when the host gives none
    assert xml.find("devices/video/model").attrib == {"type": "vga", "vram": "16384", "heads": "1"}
    assert xml.find("devices/memballoon").attrib == {"model": "virtio-non-transitional", "freePageReporting": "on"}
    assert xml.find("devices/memballoon/stats").get("period") == "10"
    assert xml.find("devices/channel/target").attrib == {"type": "virtio", "name": "org.qemu.guest_agent.0"}
    assert xml.find("devices/input") is None  # amd64 adds no input of its own
    # pkg/virt-config: the cluster's SMBIOS defaults, after the firmware's uuid
    assert [(e.get("name"), e.text) for e in xml.findall("sysinfo/system/entry")][1:] == [
        ("manufacturer", "KubeVirt"), ("family", "KubeVirt"), ("product", "None"), ("sku", None), ("version", None)]


def test_the_host_names_the_vnc_and_agent_sockets():
    xml = domain(vmi_doc(), Host(vnc_socket="/run/vm/console/virt-vnc", agent_socket="/run/vm/console/virt-agent"))
    assert xml.find("devices/graphics/listen").attrib == {"type": "socket", "socket": "/run/vm/console/virt-vnc"}
    assert xml.find("devices/channel/source").attrib == {"mode": "bind", "path": "/run/vm/console/virt-agent"}


def test_an_efi_guest_gets_bochs_without_vram():
    # virt-handler hands virt-launcher BochsDisplayForEFIGuests unless the VGADisplayForEFIGuests gate is on
    efi = Host(efi_code="/usr/share/OVMF/OVMF_CODE_4M.fd", efi_vars="/usr/share/OVMF/OVMF_VARS_4M.fd", nvram="/run/l/VARS.fd")
    xml = domain(vmi_doc(firmware={"bootloader": {"efi": {"secureBoot": False}}}), efi)
    assert xml.find("devices/video/model").attrib == {"type": "bochs", "heads": "1"}


@pytest.mark.parametrize("kind", ["vga", "cirrus", "virtio", "ramfb", "bochs"])
def test_a_video_type_is_rendered_with_kubevirts_vram_and_heads(kind):
    xml = domain(vmi_doc({"video": {"type": kind}}))
    assert xml.find("devices/video/model").attrib == {"type": kind, "vram": "16384", "heads": "1"}


def test_headless_memballoonless():
    xml = domain(vmi_doc({"autoattachGraphicsDevice": False, "autoattachMemBalloon": False}))
    assert xml.find("devices/graphics") is None and xml.find("devices/video") is None
    assert xml.find("devices/memballoon").attrib == {"model": "none"}
    assert xml.find("devices/channel") is not None  # channels.go: always


@pytest.mark.parametrize("doc", [
    vmi_doc(cpu={"dedicatedCpuPlacement": True}, resources={"requests": {"memory": "64Mi", "cpu": "1"}, "limits": {"memory": "64Mi", "cpu": "1"}}),
    vmi_doc(annotations={"kubevirt.io/free-page-reporting-disabled": "true"}),
], ids=["dedicated-cpus", "annotation"])
def test_free_page_reporting_is_off_for_high_performance_vmis_and_by_annotation(doc):
    # virtwrap/manager.go isFreePageReportingEnabled; balloon.go still writes the attribute, "off"
    host = Host(topology=(((0,), (1,)),), cpuset=(0, 1))  # the pod's CPUs, for the pinned one
    assert domain(doc, host).find("devices/memballoon").get("freePageReporting") == "off"


def test_inputs_default_to_a_usb_tablet_which_needs_the_usb_controller():
    xml = domain(vmi_doc({"inputs": [{"name": "t0"}, {"name": "t1", "bus": "virtio", "type": "tablet"}]}))
    assert [i.attrib for i in xml.findall("devices/input")] == [
        {"type": "tablet", "bus": "usb"}, {"type": "tablet", "bus": "virtio", "model": "virtio"}]
    assert [a.get("name") for a in xml.findall("devices/input/alias")] == ["ua-t0", "ua-t1"]
    assert xml.find("devices/controller[@type='usb']").get("model") == "qemu-xhci"  # arch/amd64.go IsUSBNeeded
    virtio_only = domain(vmi_doc({"inputs": [{"name": "t", "bus": "virtio", "type": "tablet"}]}))
    assert virtio_only.find("devices/controller[@type='usb']").get("model") == "none"


@pytest.mark.parametrize("devices, message", [
    ({"inputs": [{"name": "t", "bus": "ps2"}]}, "spec.domain.devices.inputs[0].bus: Input device can have only virtio or usb bus."),
    ({"inputs": [{"name": "t", "type": "keyboard"}]}, "spec.domain.devices.inputs[0].type: Input device can have only tablet type."),
    ({"inputs": [{"bus": "usb", "type": "tablet"}]}, "spec.domain.devices.inputs[0].name: required"),
    ({"video": {"type": "qxl"}}, "spec.domain.devices.video.type: video model 'qxl' is not supported on amd64 architecture"),
    ({"video": {}}, "spec.domain.devices.video.type: video model '' is not supported on amd64 architecture"),
    ({"autoattachGraphicsDevice": False, "video": {"type": "vga"}},
     "spec.domain.devices.video: Video configuration is not allowed when autoattachGraphicsDevice is set to false"),
])
def test_refusals_in_kubevirts_words(devices, message):
    assert refusal(vmi_doc(devices)) == message


def test_network_multiqueue_is_a_queue_per_vcpu_and_more_than_one_is_refused():
    # network/virtio-queues.go NetworkQueuesCapacity; configurator.go newVirtioDriver: virtio NICs only
    one = domain(vmi_doc({"networkInterfaceMultiqueue": True}))
    assert one.find("devices/interface/driver").attrib == {"name": "vhost", "queues": "1"}
    assert domain(vmi_doc()).find("devices/interface/driver") is None
    two = vmi_doc({"networkInterfaceMultiqueue": True}, cpu={"cores": 2})
    assert refusal(two) == ("spec.domain.devices.networkInterfaceMultiqueue: 2 queues (one per vCPU) are not supported by the"
                            " launcher's pod network, a stream socket to the VM's pod switch (one queue); leave it out or give the VM one vCPU")
    # nothing to refuse without a virtio NIC
    assert domain(vmi_doc({"networkInterfaceMultiqueue": True, "autoattachPodInterface": False}, cpu={"cores": 2})).find("devices/interface") is None
    e1000 = vmi_doc({"networkInterfaceMultiqueue": True, "interfaces": [{"name": "default", "model": "e1000", "masquerade": {}}]}, cpu={"cores": 2})
    e1000["spec"]["networks"] = [{"name": "default", "pod": {}}]
    assert domain(e1000).find("devices/interface/driver") is None


def test_a_vm_with_autoattach_input_device_gets_default_0_and_a_vmi_does_not():
    # pkg/virt-controller/watch/vm/vm.go AutoAttachInputDevice: the VM controller's, for VMs only
    assert [i.name for i in parse_vmi(vm_doc({"autoattachInputDevice": True})).domain.devices.inputs] == ["default-0"]
    assert parse_vmi(vm_doc({"autoattachInputDevice": True})).domain.devices.inputs[0].bus == "usb"
    assert parse_vmi(vmi_doc({"autoattachInputDevice": True})).domain.devices.inputs == ()
    named = parse_vmi(vm_doc({"autoattachInputDevice": True, "inputs": [{"name": "mine", "bus": "virtio", "type": "tablet"}]}))
    assert [i.name for i in named.domain.devices.inputs] == ["mine"]


def test_a_preference_attaches_the_input_then_gives_it_its_bus_and_sets_the_video_type():
    # common-clusterpreferences-bundle.yaml centos.stream9.desktop; preference/apply/device.go:
    # ApplyAutoAttachPreferences, then the VM controller's input, then applyInputPreferences
    desktop = {"apiVersion": V1B1, "kind": "VirtualMachineClusterPreference", "metadata": {"name": "desktop"},
               "spec": {"devices": {"preferredAutoattachInputDevice": True, "preferredInputBus": "virtio",
                                    "preferredInputType": "tablet", "preferredVideoType": "virtio"}}}
    vmi = parse_vmi(vm_doc(preference="desktop"), objects=Objects([desktop]))
    assert [(i.name, i.bus, i.type) for i in vmi.domain.devices.inputs] == [("default-0", "virtio", "tablet")]
    assert vmi.domain.devices.video == "virtio"
    # what the VM says wins
    mine = parse_vmi(vm_doc({"autoattachInputDevice": False, "video": {"type": "vga"}}, "desktop"), objects=Objects([desktop]))
    assert mine.domain.devices.inputs == () and mine.domain.devices.video == "vga"
    expanded = expand(vm_doc({"inputs": [{"name": "t", "bus": "usb"}]}, "desktop"), Objects([desktop]))
    assert expanded["spec"]["template"]["spec"]["domain"]["devices"]["inputs"] == [{"name": "t", "bus": "usb", "type": "tablet"}]


def test_qemus_sockets_go_in_the_console_directory_or_a_short_link_to_it(tmp_path):
    short = tmp_path / "run" / "default_vm"
    assert rundir.socket_dir(short) == short / "console"
    long = tmp_path / "run" / ("a" * 90)
    link = rundir.socket_dir(long)
    assert link.parent == long.parent and link.name.startswith(".") and len(str(link / rundir.AGENT_SOCKET)) <= 107
    (tmp_path / "run").mkdir()
    rundir.create(long)
    assert link.is_symlink() and link.resolve() == (long / "console").resolve()
    rundir.remove(long)
    assert not long.exists() and not link.is_symlink()
    deep = Path("/" + "d" * 100) / "run" / "default_vm"
    assert rundir.socket_dir(deep) is None and rundir.qemu_socket(deep, rundir.VNC_SOCKET) is None

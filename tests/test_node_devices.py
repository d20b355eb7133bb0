"""Devices and networks this node lacks: GPUs, host devices, DRA claims, SR-IOV VFs, Multus networks.

The corpus (tests/conformance/host-devices.yaml, multus.yaml) holds KubeVirt's own cases; these are
the edges around them: an instance type's GPU (pkg/instancetype/apply/gpu.go copies it into the VM,
where virt-controller judges it as the VM's own), NADs whose config Multus could not run, and the
command line's one line.
"""

from __future__ import annotations

import yaml
import pytest

from launcher.spec.fields import SpecError
from launcher.spec.k8s import Objects
from launcher.spec.vmi import parse_vmi

NAD = "NetworkAttachmentDefinition"


def _vmi(interfaces=None, networks=None, **devices) -> dict:
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "v", "namespace": "ns"},
            "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}},
                                "devices": {**({"interfaces": interfaces} if interfaces else {}), **devices}},
                     **({"networks": networks} if networks else {})}}


def _refusal(doc, objects=()) -> str:
    with pytest.raises(SpecError) as err:
        parse_vmi(doc, objects=Objects(list(objects)))
    return err.value.line()


def _nad(config, name="net", namespace="ns", annotations=None) -> dict:
    return {"apiVersion": "k8s.cni.cncf.io/v1", "kind": NAD,
            "metadata": {"name": name, "namespace": namespace, **({"annotations": annotations} if annotations else {})},
            "spec": {} if config is None else {"config": config}}


MULTUS = ([{"name": "m", "bridge": {}}], [{"name": "m", "multus": {"networkName": "net"}}])


def test_an_instance_types_gpu_is_refused_as_the_vms_own():
    objects = [{"apiVersion": "instancetype.kubevirt.io/v1beta1", "kind": "VirtualMachineClusterInstancetype",
                "metadata": {"name": "gn1"},
                "spec": {"cpu": {"guest": 1}, "memory": {"guest": "1Gi"}, "gpus": [{"name": "g", "deviceName": "nvidia.com/A10"}]}}]
    doc = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "v"},
           "spec": {"instancetype": {"name": "gn1"}, "template": {"spec": {"domain": {"devices": {}}}}}}
    assert _refusal(doc, objects) == ("spec.template.spec.domain.devices.gpus[0].deviceName:"
                                      " GPU nvidia.com/A10 is not permitted in permittedHostDevices configuration")


def test_ignore_unsupported_does_not_drop_a_device_the_node_lacks():
    with pytest.raises(SpecError, match="is not permitted in permittedHostDevices configuration"):
        parse_vmi(_vmi(gpus=[{"name": "g", "deviceName": "x.com/y"}]), ignore_unsupported=True)


@pytest.mark.parametrize("config, expected", [
    # a conflist: the first plugin Multus would run
    ('{"cniVersion": "1.0.0", "name": "n", "plugins": [{"type": "macvlan"}, {"type": "tuning"}]}',
     'spec.networks[0].multus: failed to find plugin "macvlan" in path [/opt/cni/bin]'),
    # the bridge plugin first: the launcher's own (launcher.network.linuxbridge), but for what it does not do
    ('{"cniVersion": "1.0.0", "name": "n", "plugins": [{"type": "bridge", "bridge": "br0", "vlan": 100}, {"type": "tuning"}]}',
     "NetworkAttachmentDefinition ns/net spec.config vlan: VLAN tagging on the bridge port: not supported by the launcher"),
    (None, "NetworkAttachmentDefinition ns/net spec.config: empty: Multus would read the network's config from the node's"
           " CNI directory, which the launcher has none of"),
    ("{not json", "NetworkAttachmentDefinition ns/net spec.config: not a CNI JSON config: Expecting property name enclosed"
                  " in double quotes: line 1 column 2 (char 1)"),
    ('["bridge"]', "NetworkAttachmentDefinition ns/net spec.config: not a CNI JSON config: must be an object"),
    ('{"name": "n", "plugins": [{"bridge": "br0"}]}', "NetworkAttachmentDefinition ns/net spec.config: every CNI plugin config needs a type"),
])
def test_a_nads_config_is_read_as_multus_reads_it(config, expected):
    assert _refusal(_vmi(*MULTUS), [_nad(config)]) == expected


def test_a_nad_in_another_namespace_is_found_by_its_namespace():
    interfaces, _ = MULTUS
    networks = [{"name": "m", "multus": {"networkName": "other/net"}}]
    assert _refusal(_vmi(interfaces, networks), [_nad('{"type": "ptp"}')]) == \
        "spec.networks[0].multus.networkName: failed to locate network attachment definition other/net"
    assert _refusal(_vmi(interfaces, networks), [_nad('{"type": "ptp"}', namespace="other")]) == \
        'spec.networks[0].multus: failed to find plugin "ptp" in path [/opt/cni/bin]'


def test_a_nads_device_resource_stops_a_bridge_interface_too():
    # bridge-marker's resource: the scheduler finds no node with it, whatever the binding
    nad = _nad('{"type": "bridge", "bridge": "br1"}', annotations={"k8s.v1.cni.cncf.io/resourceName": "bridge.network.kubevirt.io/br1"})
    assert _refusal(_vmi(*MULTUS), [nad]) == "spec.networks[0].multus: 0/1 nodes are available: 1 Insufficient bridge.network.kubevirt.io/br1."


def test_the_cli_refuses_a_gpu_in_one_line(tmp_path):
    from tests.conftest import run_launcher

    spec = tmp_path / "vmi.yaml"
    spec.write_text(yaml.safe_dump(_vmi(gpus=[{"name": "g", "deviceName": "nvidia.com/GP102GL_Tesla_P40"}])))
    refused = run_launcher("domain", "--ignore-unsupported", spec, env={"DISKKIT_CACHE": str(tmp_path / "cache")})
    assert refused.code == 1
    assert refused.err.strip().splitlines() == ["launcher: spec.domain.devices.gpus[0].deviceName: GPU nvidia.com/GP102GL_Tesla_P40"
                                                " is not permitted in permittedHostDevices configuration"]

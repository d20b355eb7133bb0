"""spec.networks / interfaces: KubeVirt's defaulting and admission (launcher.spec.network), pure.

Sources: pkg/network/vmispec/defaults.go (SetDefaultNetworkInterface), pkg/virt-config/virt-config.go
(DefaultNetworkInterface), pkg/network/admitter/{netsource,netiface,binding,discontinued,passt}.go,
pkg/network/link/mac.go and vmi-create-admitter.go validateInterfaceBootOrder, in kubevirt/kubevirt.
"""

from __future__ import annotations

import pytest

from launcher.spec.fields import SpecError
from launcher.spec.network import Interface, Port
from launcher.spec.vmi import parse_vmi

IFACES = "spec.domain.devices.interfaces"


def vmi(interfaces=None, networks=None, **devices):
    doc = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "n"},
           "spec": {"domain": {"resources": {"requests": {"memory": "64Mi"}}, "devices": dict(devices)}}}
    if interfaces is not None:
        doc["spec"]["domain"]["devices"]["interfaces"] = interfaces
    if networks is not None:
        doc["spec"]["networks"] = networks
    return doc


def nics(doc):
    return parse_vmi(doc).domain.devices.interfaces


def refusal(doc) -> str:
    with pytest.raises(SpecError) as err:
        parse_vmi(doc)
    return str(err.value)


POD = [{"name": "pod", "pod": {}}]


def test_no_networks_gives_kubevirts_default_bridge_interface():
    assert nics(vmi()) == (Interface("default", -1, "bridge"),)


def test_autoattach_false_gives_none():
    assert nics(vmi(autoattachPodInterface=False)) == ()


def test_autoattach_true_with_interfaces_does_not_add_another():
    got = nics(vmi([{"name": "pod", "masquerade": {}}], POD, autoattachPodInterface=True))
    assert [i.name for i in got] == ["pod"]


def test_masquerade_with_everything():
    got = nics(vmi([{"name": "pod", "masquerade": {}, "macAddress": "DE-AD-00-00-BE-AF", "model": "e1000e",
                     "pciAddress": "0000:00:0a.0", "bootOrder": 3, "ports": [{"name": "http", "port": 80}, {"port": 53, "protocol": "UDP"}]}],
                   [{"name": "pod", "pod": {"vmNetworkCIDR": "10.9.0.0/16"}}]))
    assert got == (Interface("pod", 0, "masquerade", "10.9.0.0/16", "e1000e", "de:ad:00:00:be:af", "0000:00:0a.0", 3,
                             (Port(80, "TCP", "http"), Port(53, "UDP"))),)


def test_link_down():
    assert nics(vmi([{"name": "pod", "bridge": {}, "state": "down"}], POD))[0].link_down


def test_masquerade_subnets_default_as_kubevirts():
    # pkg/virt-launcher/virtwrap/api/defaults.go DefaultVMCIDR, DefaultVMIpv6CIDR
    (got,) = nics(vmi([{"name": "pod", "masquerade": {}}], POD))
    assert (got.cidr, got.cidr6) == ("10.0.2.0/24", "fd10:0:2::/120")
    (got,) = nics(vmi([{"name": "pod", "masquerade": {}}], [{"name": "pod", "pod": {"vmIPv6NetworkCIDR": "fd20::/64", "vmNetworkCIDR": "10.1.0.0/30"}}]))
    assert (got.cidr, got.cidr6) == ("10.1.0.0/30", "fd20::/64")


def test_passt_binding_plugin():
    assert nics(vmi([{"name": "pod", "binding": {"name": "passt"}}], POD))[0].binding == "passt"


@pytest.mark.parametrize("interfaces,networks,expected", [
    # netiface.go validateInterfacesAssignedToNetworks / validateNetworksAssignedToInterfaces
    ([{"name": "x", "masquerade": {}}], POD, f"{IFACES}[0].name: Masquerade interface only implemented with pod network"),
    ([{"name": "x", "bridge": {}}], POD, "spec.networks[0].name: 'pod' not found."),
    ([], POD, "spec.networks[0].name: 'pod' not found."),
    ([{"name": "x", "bridge": {}}], [], f"{IFACES}[0].name: 'x' not found."),
    # netiface.go validateInterfaceNameUnique, validateNetworkNameUnique
    ([{"name": "pod", "bridge": {}}, {"name": "pod", "bridge": {}}], POD, f"{IFACES}[1].name: Only one interface can be connected to one specific network"),
    # netsource.go validateSinglePodNetwork
    ([{"name": "a", "bridge": {}}, {"name": "b", "bridge": {}}], [{"name": "a", "pod": {}}, {"name": "b", "pod": {}}],
     # KubeVirt names spec.interfaces, a path that does not exist, in its own words
     "spec.interfaces: more than one interface is connected to a pod network in spec.interfaces"),
    ([{"name": "a", "bridge": {}}], [{"name": "a"}], "spec.networks[0]: should have a network type"),
    ([{"name": "a", "bridge": {}}], [{"name": "a", "pod": {}, "multus": {"networkName": "x"}}], "spec.networks[0]: should have only one network type"),
    # binding.go validateInterfaceBindingExists
    ([{"name": "pod"}], POD, f"{IFACES}[0]: logical pod interface must have exactly one binding method or binding plugin"),
    ([{"name": "pod", "bridge": {}, "masquerade": {}}], POD, f"{IFACES}[0]: logical pod interface must have exactly one binding method or binding plugin"),
    # binding.go validateMasqueradeBinding, link/mac.go StaticMasqueradeBridgeMAC
    ([{"name": "pod", "masquerade": {}, "macAddress": "02:00:00:00:00:00"}], POD,
     f"{IFACES}[0].macAddress: The requested MAC address is reserved for the in-pod bridge. Please choose another one."),
    # discontinued.go
    ([{"name": "pod", "slirp": {}}], POD, f"{IFACES}[0].slirp: Slirp interface support has been discontinued since v1.3"),
    ([{"name": "pod", "passt": {}}], POD, f"{IFACES}[0].passt: Passt network binding has been discontinued since v1.3"),
    ([{"name": "pod", "macvtap": {}}], POD, f"{IFACES}[0].macvtap: Macvtap network binding has been discontinued since v1.3"),
    # passt.go: the core binding needs its gate
    ([{"name": "pod", "passtBinding": {}}], POD, f"{IFACES}[0].name: PasstBinding feature gate is not enabled"),
    # netiface.go validateInterfacesFields
    ([{"name": "p.d", "bridge": {}}], [{"name": "p.d", "pod": {}}],
     f"{IFACES}[0].name: Network interface name can only contain alphabetical characters, numbers, dashes (-) or underscores (_)"),
    ([{"name": "pod", "bridge": {}, "model": "vmxnet3"}], POD, f"{IFACES}[0].model: interface {IFACES}[0].name uses model vmxnet3 that is not supported."),
    ([{"name": "pod", "bridge": {}, "macAddress": "de:ad:be:ef"}], POD, f"{IFACES}[0].macAddress: interface {IFACES}[0].name has malformed MAC address (de:ad:be:ef)."),
    ([{"name": "pod", "bridge": {}, "macAddress": "de:ad:be:ef:00:01:02:03"}], POD,
     f"{IFACES}[0].macAddress: interface {IFACES}[0].name has too long MAC address (de:ad:be:ef:00:01:02:03)."),
    ([{"name": "pod", "bridge": {}, "pciAddress": "0000:00:0a"}], POD, f"{IFACES}[0].pciAddress: interface {IFACES}[0].name has malformed PCI address (0000:00:0a)."),
    ([{"name": "pod", "masquerade": {}, "ports": [{"port": 0}]}], POD, f"{IFACES}[0].ports[0].port: Port field is mandatory."),
    ([{"name": "pod", "masquerade": {}, "ports": [{"port": 70000}]}], POD, f"{IFACES}[0].ports[0].port: Port field must be in range 0 < x < 65536."),
    ([{"name": "pod", "masquerade": {}, "ports": [{"port": 80, "protocol": "SCTP"}]}], POD, f"{IFACES}[0].ports[0].protocol: Unknown protocol, only TCP or UDP allowed"),
    ([{"name": "pod", "masquerade": {}, "ports": [{"port": 80, "name": "a"}, {"port": 81, "name": "a"}]}], POD, f"{IFACES}[0].ports[1].name: Duplicate name of the port: a"),
    ([{"name": "pod", "masquerade": {}, "ports": [{"port": 80, "name": "HTTP"}]}], POD, f"{IFACES}[0].ports[0].name: Invalid name of the port: HTTP"),
    ([{"name": "pod", "masquerade": {}, "portRanges": [{"protocol": "TCP", "start": 1, "end": 2}]}], POD,
     f"{IFACES}[0].name: portRanges is specified on interface but the PortRangesSpec feature gate is not enabled"),
    # vmi-create-admitter.go validateInterfaceBootOrder
    ([{"name": "pod", "bridge": {}, "bootOrder": 0}], POD, f"{IFACES}[0].bootOrder: {IFACES}[0] must have a boot order > 0, if supplied"),
    # admit.go validateInterfaceStateValue
    ([{"name": "pod", "bridge": {}, "state": "gone"}], POD, f"{IFACES}[0].state: logical pod interface state value is unsupported: gone"),
    ([{"name": "pod", "masquerade": {}, "state": "absent"}], POD, f'{IFACES}[0].state: "pod" interface\'s state "absent" is supported only for bridge binding'),
    ([{"name": "pod", "bridge": {}, "state": "absent"}], POD, f'{IFACES}[0].state: "pod" interface\'s state "absent" is not supported on default networks'),
    # pkg/network/setup/netpod/netpod.go gatewayIP: the gateway and the guest need two host addresses
    ([{"name": "pod", "masquerade": {}}], [{"name": "pod", "pod": {"vmNetworkCIDR": "10.0.2.0/31"}}],
     "spec.networks[0].pod.vmNetworkCIDR: VM CIDR subnet is too small, at least 2 host addresses are required: 10.0.2.0/31"),
    ([{"name": "pod", "masquerade": {}}], [{"name": "pod", "pod": {"vmIPv6NetworkCIDR": "fd10::/127"}}],
     "spec.networks[0].pod.vmIPv6NetworkCIDR: VM CIDR subnet is too small, at least 2 host addresses are required: fd10::/127"),
    ([{"name": "pod", "masquerade": {}}], [{"name": "pod", "pod": {"vmNetworkCIDR": "10.0.2/24"}}],
     "spec.networks[0].pod.vmNetworkCIDR: failed to parse VM CIDR: 10.0.2/24, invalid CIDR address: 10.0.2/24"),
    # Multus and SR-IOV: as a node without the NetworkAttachmentDefinition or the VF (launcher.spec.multus)
    ([{"name": "m", "bridge": {}}], [{"name": "m", "multus": {"networkName": "x"}}],
     "spec.networks[0].multus.networkName: failed to locate network attachment definition default/x"),
    ([{"name": "pod", "sriov": {}}], POD, f"{IFACES}[0].sriov: found no SR-IOV networks to PCI-Address mapping"),
    # admit.go: SR-IOV NICs have no link state; netsource.go: Multus network names and default networks
    ([{"name": "m", "sriov": {}, "state": "down"}], [{"name": "m", "multus": {"networkName": "x"}}],
     f'{IFACES}[0].state: "m" interface\'s state "down" is not supported for SR-IOV NICs'),
    ([{"name": "m", "bridge": {}}], [{"name": "m", "multus": {"networkName": ""}}],
     "spec.networks[0]: CNI delegating plugin must have a networkName"),
    ([{"name": "pod", "bridge": {}}, {"name": "m", "bridge": {}}], POD + [{"name": "m", "multus": {"networkName": "x", "default": True}}],
     "spec.networks: Pod network cannot be defined when Multus default network is defined"),
    ([{"name": "m", "bridge": {}}, {"name": "n", "bridge": {}}],
     [{"name": "m", "multus": {"networkName": "x", "default": True}}, {"name": "n", "multus": {"networkName": "y", "default": True}}],
     "spec.networks: Multus CNI should only have one default network"),
    ([{"name": "pod", "binding": {"name": "macvtap"}}], POD, f"{IFACES}[0].binding.name: binding plugin macvtap is not known to the launcher (it knows passt)"),
])
def test_kubevirts_refusals(interfaces, networks, expected):
    assert refusal(vmi(interfaces, networks)) == expected


def test_interface_boot_order_clashes_with_a_disks():
    doc = vmi([{"name": "pod", "bridge": {}, "bootOrder": 1}], POD)
    doc["spec"]["domain"]["devices"]["disks"] = [{"name": "root", "bootOrder": 1}]
    doc["spec"]["volumes"] = [{"name": "root", "emptyDisk": {"capacity": "1Mi"}}]
    assert refusal(doc) == f"{IFACES}[0].bootOrder: Boot order for {IFACES}[0].bootOrder already set for a different device."

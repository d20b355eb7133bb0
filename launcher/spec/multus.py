"""Multus secondary networks and SR-IOV interfaces on a node without them (pure).

In a cluster, a Multus network names a NetworkAttachmentDefinition (NAD): virt-controller reads it to
ask the scheduler for the device its `k8s.v1.cni.cncf.io/resourceName` annotation names (an SR-IOV
virtual function from the SR-IOV device plugin), and Multus runs the CNI plugin of its `spec.config`
when the pod starts. The NADs come from --manifests (or --kube-api) here; the node has no device
plugin and no CNI plugin binaries, so every Multus network but a bridge one is refused where the
cluster would stop it, in the words of what stops it:
- no such NAD: virt-controller, pkg/network/multus/nad.go NetworkToResource;
- a NAD with a device resource: the scheduler, which finds no node with that resource;
- an SR-IOV interface on a NAD without one: virt-launcher, which finds no VF in the pod's network
  status (pkg/virt-launcher/virtwrap/device/hostdevice/sriov/hostdev.go CreateHostDevices);
- any other NAD: Multus, which finds no plugin binary (libcni pkg/invoke/find.go FindInPath), except
  the bridge plugin's: the launcher does its work itself (launcher.network.linuxbridge, as root), so a
  NAD whose config is the bridge plugin's (or a list whose first plugin is) becomes a BridgeNetwork.

A bridge network is read as the plugin reads its config (containernetworking/plugins
plugins/main/bridge/bridge.go NetConf, loadNetConf): `bridge` (default cni0), `mtu` (0: the veth's
default, 1500), `hairpinMode`, `promiscMode`, `portIsolation`, `macspoofchk`, and the MAC of
`args.cni.mac` / `runtimeConfig.mac`. What the launcher does not do and what changes what the guest
sees is refused in one line naming the field: `vlan` and `vlanTrunk`, and `ipam` (KubeVirt hands the
address an IPAM plugin gives the pod interface to the guest by DHCP, pkg/network/dhcp/bridge.go, and
the launcher runs neither), with `isGateway`, `isDefaultGateway` and `ipMasq`, which need one.
`disableContainerInterface` and `enabledad` concern the pod's side of the veth, which KubeVirt moves
into its in-pod bridge and which does not exist here: nothing to do.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Protocol

from launcher.spec.fields import SpecError, as_map, field_error, get_bool, get_str

NAD_KIND = "NetworkAttachmentDefinition"
RESOURCE_ANNOTATION = "k8s.v1.cni.cncf.io/resourceName"  # pkg/network/multus ResourceNameAnnotation
CNI_PATH = "/opt/cni/bin"  # Multus' default binDir
BRIDGE_PLUGIN = "bridge"
DEFAULT_BRIDGE = "cni0"  # bridge.go defaultBrName
DEFAULT_MTU = 1500  # a veth's, which the plugin makes with mtu 0 when the config has none
IFNAMSIZ = 16  # the kernel's, its NUL included: a device's name has 15 bytes at most
# What the kernel's dev_valid_name allows (no '/', ':' or whitespace, not . or ..), narrowed to what
# `ip` takes as a name wherever it stands: no leading '-'.
_IFNAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
# bridge.go NetConf fields the launcher refuses: each changes what the guest sees, and it does not do it
_REFUSED = {
    "vlan": "VLAN tagging on the bridge port",
    "vlanTrunk": "VLAN trunks on the bridge port",
    "ipam": "an IPAM plugin's address, which KubeVirt hands the guest by DHCP",
    "isGateway": "the gateway address on the bridge, from an IPAM plugin",
    "isDefaultGateway": "the gateway address on the bridge, from an IPAM plugin",
    "ipMasq": "masquerading the network's traffic (iptables rules)",
}


@dataclass(frozen=True)
class BridgeNetwork:
    """A Multus network whose NAD is a bridge CNI config, as the launcher makes it on the node."""

    nad: str  # namespace/name, for messages
    at: str  # the network's path in the spec (spec.networks[N])
    bridge: str  # the Linux bridge's name, checked by bridge_name_problem
    mtu: int  # the pod interface's (the veth's): the tap's and the guest's
    hairpin: bool = False
    promisc: bool = False
    isolated: bool = False  # portIsolation
    mac: str | None = None  # args.cni.mac or runtimeConfig.mac: the pod interface's MAC, so the guest's
    mtu_set: bool = False  # the config names an MTU: a bridge the launcher makes gets it too
    spoofcheck: bool = False  # macspoofchk: only frames from the guest's MAC enter the bridge
    primary: bool = False  # multus.default: the pod's eth0, not a secondary network


def bridge_name_problem(name: str) -> str | None:
    """Why `name` is no device name root may create or look up, or None: the one check every name
    the launcher gives `ip` passes (IFNAMSIZ bounds it)."""
    if not isinstance(name, str) or not name:
        return "is empty"
    if len(name.encode()) >= IFNAMSIZ:
        return f"is {len(name.encode())} bytes long; a network device's name has at most {IFNAMSIZ - 1} (IFNAMSIZ)"
    if name in (".", "..") or not _IFNAME.fullmatch(name):
        return "is not a network device name (letters, digits, '_', '.' and '-', not first)"
    return None


class NADSource(Protocol):
    def get(self, kind: str, namespace: str | None, name: str) -> dict | None: ...


def check_sources(networks: list[tuple[str, dict]], pod_networks: int, at: str) -> None:
    """netsource.go validateMultusNetworkSource and validateSinglePodNetwork on the Multus networks
    (path, network document), before the launcher looks them up."""
    defaults = 0
    for nat, doc in networks:
        multus = as_map(doc.get("multus"), f"{nat}.multus")
        if not get_str(multus, "networkName", f"{nat}.multus"):
            raise field_error(nat, "CNI delegating plugin must have a networkName")
        defaults += bool(get_bool(multus, "default", f"{nat}.multus"))
    if defaults > 1:
        raise field_error(at, "Multus CNI should only have one default network")
    if defaults and pod_networks:
        raise field_error(at, "Pod network cannot be defined when Multus default network is defined")


def _nad_name(network_name: str, namespace: str) -> tuple[str, str]:
    """nad.go NetAttachDefNamespacedName: `namespace/name`, or a name in the VMI's namespace."""
    if "/" in network_name:
        ns, name = network_name.split("/", 1)
        return ns, name
    return namespace, network_name


def _plugins(nad: dict, where: str) -> list[dict]:
    """The CNI plugin configs a NAD's spec.config runs, in order: a single config, a list's `plugins`."""
    text = as_map(nad.get("spec"), f"{where} spec").get("config")
    if not isinstance(text, str) or not text.strip():
        # Multus would look for a file of the NAD's name in its own config directory, which this node lacks.
        raise SpecError(f"{where} spec.config", "empty: Multus would read the network's config from the node's CNI directory, which the launcher has none of")
    try:
        config = json.loads(text)
    except ValueError as err:
        raise SpecError(f"{where} spec.config", f"not a CNI JSON config: {err}") from None
    if not isinstance(config, dict):
        raise SpecError(f"{where} spec.config", "not a CNI JSON config: must be an object")
    plugins = config["plugins"] if isinstance(config.get("plugins"), list) else [config]
    plugins = [p for p in plugins if isinstance(p, dict)]
    if not plugins or not all(isinstance(p.get("type"), str) and p["type"] for p in plugins):
        raise SpecError(f"{where} spec.config", "every CNI plugin config needs a type")
    return plugins


def _bridge_config(plugin: dict, where: str, at: str) -> BridgeNetwork:
    """bridge.go loadNetConf, and the launcher's refusals of what it does not do."""
    cat = f"{where} spec.config"
    for key, what in _REFUSED.items():
        value = plugin.get(key)
        if key == "ipam" and isinstance(value, dict) and not value.get("type"):
            continue  # `"ipam": {}`: no plugin, no address (KubeVirt's IPAMDisabled: no DHCP either)
        if value not in (None, False, 0, [], ""):
            raise SpecError(f"{cat} {key}", f"{what}: not supported by the launcher")
    name = plugin.get("bridge", DEFAULT_BRIDGE)
    if not isinstance(name, str):
        raise SpecError(f"{cat} bridge", "must be a string")
    problem = bridge_name_problem(name)
    if problem:
        raise SpecError(f"{cat} bridge", f"{name!r} {problem}")
    mtu = plugin.get("mtu", 0)
    if isinstance(mtu, bool) or not isinstance(mtu, int) or not 0 <= mtu <= 65535:
        raise SpecError(f"{cat} mtu", "must be an integer from 68 to 65535")
    if 0 < mtu < 68:
        raise SpecError(f"{cat} mtu", f"{mtu} is below IPv4's minimum of 68")
    flags = {}
    for key in ("hairpinMode", "promiscMode", "portIsolation", "macspoofchk"):
        value = plugin.get(key, False)
        if not isinstance(value, bool):
            raise SpecError(f"{cat} {key}", "must be true or false")
        flags[key] = value
    mac = None
    for path in (("args", "cni", "mac"), ("runtimeConfig", "mac")):  # the later wins, as in loadNetConf
        node = plugin
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, str) and node:
            mac = node
    return BridgeNetwork(f"{where.removeprefix(NAD_KIND + ' ')}", at, name, mtu or DEFAULT_MTU, flags["hairpinMode"],
                         flags["promiscMode"], flags["portIsolation"], mac, bool(mtu), flags["macspoofchk"])


def resolve(nat: str, doc: dict, iat: str, iface: dict, namespace: str, objects: NADSource | None) -> BridgeNetwork:
    """The bridge network of the Multus network at `nat` (its interface at `iat`), or its refusal."""
    network_name = get_str(as_map(doc.get("multus"), f"{nat}.multus"), "networkName", f"{nat}.multus", required=True)
    ns, name = _nad_name(network_name, namespace)
    nad = objects.get(NAD_KIND, ns, name) if objects is not None else None
    if nad is None:
        raise field_error(f"{nat}.multus.networkName", f"failed to locate network attachment definition {ns}/{name}")
    where = f"{NAD_KIND} {ns}/{name}"
    sriov = iface.get("sriov") is not None
    annotations = as_map(as_map(nad.get("metadata"), f"{where} metadata").get("annotations"), f"{where} metadata.annotations")
    resource = annotations.get(RESOURCE_ANNOTATION)
    if isinstance(resource, str) and resource:
        # The pod asks for one; no device plugin on this node offers any.
        raise field_error(f"{iat}.sriov" if sriov else f"{nat}.multus", f"0/1 nodes are available: 1 Insufficient {resource}.")
    if sriov:
        raise field_error(f"{iat}.sriov", "found no SR-IOV networks to PCI-Address mapping")
    first = _plugins(nad, where)[0]
    if first["type"] != BRIDGE_PLUGIN:
        raise field_error(f"{nat}.multus", f'failed to find plugin "{first["type"]}" in path [{CNI_PATH}]')
    return replace(_bridge_config(first, where, nat), primary=bool(get_bool(as_map(doc.get("multus"), f"{nat}.multus"), "default", f"{nat}.multus")))

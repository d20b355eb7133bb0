"""Multus secondary networks and SR-IOV interfaces on a node without them (pure).

In a cluster, a Multus network names a NetworkAttachmentDefinition (NAD): virt-controller reads it to
ask the scheduler for the device its `k8s.v1.cni.cncf.io/resourceName` annotation names (an SR-IOV
virtual function from the SR-IOV device plugin), and Multus runs the CNI plugin of its `spec.config`
when the pod starts. The NADs come from --manifests here; the node has no device plugin and no CNI
plugin binaries, so every Multus network is refused where the cluster would stop it, in the words of
what stops it:
- no such NAD: virt-controller, pkg/network/multus/nad.go NetworkToResource;
- a NAD with a device resource: the scheduler, which finds no node with that resource;
- an SR-IOV interface on a NAD without one: virt-launcher, which finds no VF in the pod's network
  status (pkg/virt-launcher/virtwrap/device/hostdevice/sriov/hostdev.go CreateHostDevices);
- any other NAD: Multus, which finds no plugin binary (libcni pkg/invoke/find.go FindInPath), except
  the bridge plugin's, which the launcher could run as root on a Linux bridge of the node's and does
  not yet: said so in one line.
"""

from __future__ import annotations

import json
from typing import Protocol

from launcher.spec.fields import SpecError, as_map, field_error, get_bool, get_str

NAD_KIND = "NetworkAttachmentDefinition"
RESOURCE_ANNOTATION = "k8s.v1.cni.cncf.io/resourceName"  # pkg/network/multus ResourceNameAnnotation
CNI_PATH = "/opt/cni/bin"  # Multus' default binDir
BRIDGE_PLUGIN = "bridge"


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


def _plugin_types(nad: dict, where: str) -> list[str]:
    """The CNI plugins a NAD's spec.config runs, in order: a single config's `type`, a list's `plugins`."""
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
    types = [p.get("type") for p in plugins if isinstance(p, dict)]
    if not types or not all(isinstance(t, str) and t for t in types):
        raise SpecError(f"{where} spec.config", "every CNI plugin config needs a type")
    return types


def refuse(nat: str, doc: dict, iat: str, iface: dict, namespace: str, objects: NADSource | None) -> None:
    """Raise the refusal for the Multus network at `nat` (its interface at `iat`)."""
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
    types = _plugin_types(nad, where)
    if types[0] == BRIDGE_PLUGIN:
        raise field_error(f"{nat}.multus", f"{where} is a bridge CNI network: it needs root and a Linux bridge on the node,"
                                           " which the launcher does not set up yet: not supported by the launcher")
    raise field_error(f"{nat}.multus", f'failed to find plugin "{types[0]}" in path [{CNI_PATH}]')

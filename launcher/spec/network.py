"""spec.networks and spec.domain.devices.interfaces: KubeVirt's defaulting and admission (pure).

The pod network exists here; what each of its bindings (masquerade, bridge, the passt binding
plugin) gives the guest is launcher.network's. Multus networks and SR-IOV interfaces are admitted as
KubeVirt admits them, then refused where a node without them stops them (launcher.spec.multus), but
for a bridge CNI network with KubeVirt's bridge binding: its NIC is an Interface with `network` set,
in its place among the others (the guest's PCI order is the spec's), and launcher.network.linuxbridge
puts it on the node's Linux bridge.

Defaulting follows pkg/network/vmispec/defaults.go SetDefaultNetworkInterface with KubeVirt's default
cluster config (pkg/virt-config/virt-config.go DefaultNetworkInterface "bridge",
permitBridgeInterfaceOnPodNetwork true): no networks and no interfaces give one pod network
"default" with a bridge interface "default", unless autoattachPodInterface is false.
Admission follows pkg/network/admitter (validator.go runs the checks in this order) and
vmi-create-admitter.go validateInterfaceBootOrder, with their words.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, replace

from launcher.spec import multus
from launcher.spec.fields import as_list, as_map, field_error, get_bool, get_str

DEFAULT_NAME = "default"  # staging/src/kubevirt.io/api/core/v1/defaults.go DefaultPodNetwork
DEFAULT_BINDING = "bridge"  # pkg/virt-config/virt-config.go DefaultNetworkInterface
# pkg/network/link/mac.go StaticMasqueradeBridgeMAC: the in-pod bridge's own address
RESERVED_MAC = "02:00:00:00:00:00"
# pkg/network/admitter/netiface.go validInterfaceModels
MODELS = ("e1000", "e1000e", "igb", "ne2k_pci", "pcnet", "rtl8139", "virtio")
# pkg/virt-launcher/virtwrap/api/defaults.go: masquerade's subnets when vmNetworkCIDR and
# vmIPv6NetworkCIDR are unset
DEFAULT_CIDR = "10.0.2.0/24"
DEFAULT_CIDR6 = "fd10:0:2::/120"
# binding plugins the launcher implements (KubeVirt's come from the cluster's config)
PLUGINS = ("passt",)
PCI_ADDRESS = re.compile(r"([0-9a-fA-F]{4}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])")
_INTERFACE_NAME = re.compile(r"[A-Za-z0-9-_]+")
_PORT_NAME = re.compile(r"[-a-z0-9]+")
_MAC_COLON = re.compile(r"[0-9a-fA-F]{2}(?P<sep>[:-])[0-9a-fA-F]{2}(?:(?P=sep)[0-9a-fA-F]{2})*")
_MAC_DOT = re.compile(r"[0-9a-fA-F]{4}(?:\.[0-9a-fA-F]{4})+")


@dataclass(frozen=True)
class Port:
    port: int
    protocol: str = "TCP"
    name: str | None = None


@dataclass(frozen=True)
class Interface:
    name: str
    index: int  # in spec.domain.devices.interfaces; -1 for the defaulted one
    binding: str  # "masquerade" | "bridge" | "passt"
    cidr: str = DEFAULT_CIDR  # the pod network's vmNetworkCIDR
    model: str = "virtio"
    mac: str | None = None  # normalised: lower case, colons
    pci_address: str | None = None
    boot_order: int | None = None
    ports: tuple[Port, ...] = ()
    link_down: bool = False  # state: down (admit.go InterfaceStateLinkDown)
    cidr6: str = DEFAULT_CIDR6  # the pod network's vmIPv6NetworkCIDR
    network: multus.BridgeNetwork | None = None  # a Multus bridge network's NIC; None: the pod network's

    @property
    def on_pod_network(self) -> bool:
        return self.network is None


def _mac(value: str) -> str | None:
    """Go's net.ParseMAC forms (6, 8 or 20 bytes); the normalised address, or None if malformed."""
    if _MAC_COLON.fullmatch(value):
        octets = re.split("[:-]", value)
    elif _MAC_DOT.fullmatch(value):
        octets = [g[i:i + 2] for g in value.split(".") for i in (0, 2)]
    else:
        return None
    return ":".join(o.lower() for o in octets) if len(octets) in (6, 8, 20) else None


def _port_name_ok(name: str) -> bool:
    # k8s.io/apimachinery validation.IsValidPortName (IANA_SVC_NAME)
    return (len(name) <= 15 and bool(_PORT_NAME.fullmatch(name)) and re.search("[a-z]", name) is not None
            and "--" not in name and not name.startswith("-") and not name.endswith("-"))


def _ports(items: list, at: str) -> tuple[Port, ...]:
    """netiface.go validatePortConfiguration: names unique and IANA service names, port set and in range,
    protocol TCP or UDP (default TCP)."""
    ports, names = [], set()
    for i, item in enumerate(items):
        pat = f"{at}[{i}]"
        doc = as_map(item, pat)
        name = get_str(doc, "name", pat)
        if name is not None:
            if name in names:
                raise field_error(f"{pat}.name", f"Duplicate name of the port: {name}")
            if not _port_name_ok(name):
                raise field_error(f"{pat}.name", f"Invalid name of the port: {name}")
            names.add(name)
        port = doc.get("port")
        if port is None or port == 0:
            raise field_error(f"{pat}.port", "Port field is mandatory.")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise field_error(f"{pat}.port", "Port field must be in range 0 < x < 65536.")
        protocol = get_str(doc, "protocol", pat) or "TCP"
        if protocol not in ("TCP", "UDP"):
            raise field_error(f"{pat}.protocol", "Unknown protocol, only TCP or UDP allowed")
        ports.append(Port(port, protocol, name))
    return tuple(ports)


def _binding(doc: dict, at: str) -> str:
    """binding.go validateInterfaceBindingExists: one binding each."""
    name = doc.get("name")
    found = [key for key in ("bridge", "masquerade", "sriov", "passtBinding", "binding") if doc.get(key) is not None]
    if len(found) != 1:
        raise field_error(at, f"logical {name} interface must have exactly one binding method or binding plugin")
    kind = found[0]
    if kind == "passtBinding":
        # binding.go validatePasstBinding: the core passt binding sits behind a gate the launcher does not offer
        raise field_error(f"{at}.name", "PasstBinding feature gate is not enabled")
    if kind == "binding":
        plugin = get_str(as_map(doc["binding"], f"{at}.binding"), "name", f"{at}.binding", required=True)
        if plugin not in PLUGINS:
            raise field_error(f"{at}.binding.name", f"binding plugin {plugin} is not known to the launcher (it knows {', '.join(PLUGINS)})")
        return plugin
    as_map(doc[kind], f"{at}.{kind}")
    return kind


def _cidr(pod: dict, key: str, default: str, family, at: str) -> str:
    """pkg/network/setup/netpod/netpod.go gatewayIP: the subnet masquerade takes its gateway and the
    guest's address from (the 1st and 2nd host addresses), in its words; virt-launcher finds them
    when it sets up the pod, the launcher before anything is pulled."""
    cidr = get_str(pod, key, at) or default
    try:
        if "/" not in cidr:  # Go's net.ParseCIDR wants the prefix length
            raise ValueError(cidr)
        net = family(cidr, strict=False)
    except ValueError as exc:
        raise field_error(f"{at}.{key}", f"failed to parse VM CIDR: {cidr}, invalid CIDR address: {cidr}") from exc
    if net.prefixlen > net.max_prefixlen - 2:
        raise field_error(f"{at}.{key}", f"VM CIDR subnet is too small, at least 2 host addresses are required: {cidr}")
    return str(net)


def _networks(items: list, at: str) -> tuple[dict[str, tuple[int, str, str]], dict[str, tuple[str, str, dict]]]:
    """name -> (index, vmNetworkCIDR, vmIPv6NetworkCIDR) of each pod network, after netsource.go's checks,
    and name -> (kind, path, document) of the networks the launcher cannot give (refused once KubeVirt's
    own checks had their say)."""
    pods: dict[str, tuple[int, str, str]] = {}
    others: dict[str, tuple[str, str, dict]] = {}
    seen = set()
    pod_count = 0
    for i, item in enumerate(items):
        nat = f"{at}[{i}]"
        doc = as_map(item, nat)
        name = get_str(doc, "name", nat, required=True)
        kinds = [k for k in ("pod", "multus", "resourceClaim") if doc.get(k) is not None]
        if not kinds:
            raise field_error(nat, "should have a network type")
        if len(kinds) > 1:
            raise field_error(nat, "should have only one network type")
        if name in seen:
            raise field_error(f"{nat}.name", f'Network with name "{name}" already exists, every network must have a unique name')
        seen.add(name)
        if kinds[0] != "pod":
            others[name] = (kinds[0], nat, doc)
            continue
        pod_count += 1
        if pod_count > 1:
            raise field_error(f"{at.rsplit('.', 1)[0]}.interfaces",
                            f"more than one interface is connected to a pod network in {at.rsplit('.', 1)[0]}.interfaces")
        pod = as_map(doc["pod"], f"{nat}.pod")
        pods[name] = (i, _cidr(pod, "vmNetworkCIDR", DEFAULT_CIDR, ipaddress.IPv4Network, f"{nat}.pod"),
                      _cidr(pod, "vmIPv6NetworkCIDR", DEFAULT_CIDR6, ipaddress.IPv6Network, f"{nat}.pod"))
    multus.check_sources([(nat, doc) for kind, nat, doc in others.values() if kind == "multus"], len(pods), at)
    return pods, others


def parse_interfaces(spec: dict, devices: dict, root: str, disk_boot_orders: frozenset[int] = frozenset(), *,
                     namespace: str = "default", objects: multus.NADSource | None = None) -> tuple[Interface, ...]:
    """The VMI's NICs, defaulted and admitted as KubeVirt's webhooks do; `root` is the spec's path,
    `disk_boot_orders` the boot orders the disks already took; `objects` holds the
    NetworkAttachmentDefinitions a Multus network names."""
    dat = f"{root}.domain.devices"
    net_items = as_list(spec.get("networks"), f"{root}.networks")
    iface_items = as_list(devices.get("interfaces"), f"{dat}.interfaces")
    autoattach = get_bool(devices, "autoattachPodInterface", dat, default=None)
    if not net_items and not iface_items:
        if autoattach is False:
            return ()
        return (Interface(DEFAULT_NAME, -1, DEFAULT_BINDING),)
    iat = f"{dat}.interfaces"
    for i, item in enumerate(iface_items):
        # discontinued.go: ValidateCreation runs before the rest
        doc = as_map(item, f"{iat}[{i}]")
        for key, message in (("slirp", "Slirp interface support has been discontinued since v1.3"),
                             ("passt", "Passt network binding has been discontinued since v1.3"),
                             ("macvtap", "Macvtap network binding has been discontinued since v1.3")):
            if doc.get(key) is not None:
                raise field_error(f"{iat}[{i}].{key}", message)
    pods, others = _networks(net_items, f"{root}.networks")
    network_names = {item["name"] for item in net_items}
    docs = [as_map(item, f"{iat}[{i}]") for i, item in enumerate(iface_items)]
    names = [get_str(doc, "name", f"{iat}[{i}]", required=True) for i, doc in enumerate(docs)]
    bindings = []
    for i, doc in enumerate(docs):
        fat = f"{iat}[{i}]"
        binding = _binding(doc, fat)
        if binding == "masquerade" and names[i] not in pods:
            raise field_error(f"{fat}.name", "Masquerade interface only implemented with pod network")
        if binding == "masquerade" and doc.get("macAddress") == RESERVED_MAC:
            raise field_error(f"{fat}.macAddress", "The requested MAC address is reserved for the in-pod bridge. Please choose another one.")
        bindings.append(binding)
    for i, item in enumerate(net_items):
        name = item["name"]
        if name not in names:
            raise field_error(f"{root}.networks[{i}].name", f"{root}.networks[{i}].name '{name}' not found.")
    seen = set()
    for i, name in enumerate(names):
        if name in seen:
            raise field_error(f"{iat}[{i}].name", "Only one interface can be connected to one specific network")
        seen.add(name)
    for i, name in enumerate(names):
        if name not in network_names:
            raise field_error(f"{iat}[{i}].name", f"{iat}[{i}].name '{name}' not found.")
    interfaces = []
    boot_orders = set(disk_boot_orders)
    for i, doc in enumerate(docs):
        fat = f"{iat}[{i}]"
        if not _INTERFACE_NAME.fullmatch(names[i]):
            raise field_error(f"{fat}.name", "Network interface name can only contain alphabetical characters, numbers, dashes (-) or underscores (_)")
        model = get_str(doc, "model", fat) or "virtio"
        if model not in MODELS:
            raise field_error(f"{fat}.model", f"interface {fat}.name uses model {model} that is not supported.")
        mac = get_str(doc, "macAddress", fat)
        normal = _mac(mac) if mac is not None else None
        if mac is not None and normal is None:
            raise field_error(f"{fat}.macAddress", f"interface {fat}.name has malformed MAC address ({mac}).")
        if normal is not None and len(normal) > 17:
            raise field_error(f"{fat}.macAddress", f"interface {fat}.name has too long MAC address ({mac}).")
        pci = get_str(doc, "pciAddress", fat)
        if pci is not None and not PCI_ADDRESS.fullmatch(pci):
            raise field_error(f"{fat}.pciAddress", f"interface {fat}.name has malformed PCI address ({pci}).")
        ports = _ports(as_list(doc.get("ports"), f"{fat}.ports"), f"{fat}.ports")
        if doc.get("portRanges") is not None:
            raise field_error(f"{fat}.name", "portRanges is specified on interface but the PortRangesSpec feature gate is not enabled")
        if doc.get("dhcpOptions") is not None:
            raise field_error(f"{fat}.dhcpOptions", "DHCP options need KubeVirt's in-pod DHCP server: not supported by the launcher")
        boot = doc.get("bootOrder")
        if boot is not None:
            if isinstance(boot, bool) or not isinstance(boot, int):
                raise field_error(f"{fat}.bootOrder", "must be a non-negative integer")
            if boot < 1:
                raise field_error(f"{fat}.bootOrder", f"{iat}[{i}] must have a boot order > 0, if supplied")
            if boot in boot_orders:
                raise field_error(f"{fat}.bootOrder", f"Boot order for {fat}.bootOrder already set for a different device.")
            boot_orders.add(boot)
        state = get_str(doc, "state", fat)
        if state not in (None, "up", "down", "absent"):
            raise field_error(f"{fat}.state", f"logical {names[i]} interface state value is unsupported: {state}")
        if bindings[i] == "sriov" and state in ("up", "down"):
            raise field_error(f"{fat}.state", f'"{names[i]}" interface\'s state "{state}" is not supported for SR-IOV NICs')
        if state == "absent" and bindings[i] != "bridge":
            raise field_error(f"{fat}.state", f'"{names[i]}" interface\'s state "absent" is supported only for bridge binding')
        if state == "absent" and names[i] in pods:  # the pod network is always the default network (vmispec.LookUpDefaultNetwork)
            raise field_error(f"{fat}.state", f'"{names[i]}" interface\'s state "absent" is not supported on default networks')
        if names[i] in pods:
            _, cidr, cidr6 = pods[names[i]]
            interfaces.append(Interface(names[i], i, bindings[i], cidr, model, normal, pci, boot, ports, state == "down", cidr6))
        else:
            interfaces.append(Interface(names[i], i, bindings[i], model=model, mac=normal, pci_address=pci, boot_order=boot,
                                        ports=ports, link_down=state == "down"))
    secondary = {}
    for i, name in enumerate(names):  # KubeVirt's checks all passed: what the node cannot give
        if name in others:
            kind, nat, doc = others[name]
            if kind != "multus":
                raise field_error(f"{nat}.{kind}", f"{kind} networks need a cluster's DRA network driver: not supported by the launcher")
            network = multus.resolve(nat, doc, f"{iat}[{i}]", docs[i], namespace, objects)
            if bindings[i] != "bridge":
                raise field_error(f"{iat}[{i}].{'binding' if bindings[i] in PLUGINS else bindings[i]}",
                                  f"interface {name} is on {network.nad}, a bridge CNI network: the launcher gives it the bridge binding alone")
            if network.mac is not None and _mac(network.mac) is None:
                # bridge.go setupVeth: net.ParseMAC fails the pod's start
                raise field_error(f"{multus.NAD_KIND} {network.nad} spec.config", f"invalid MAC address {network.mac}")
            if network.mac is not None:
                network = replace(network, mac=_mac(network.mac))
            # converter/network/configurator.go: an absent interface is no device of the domain
            if get_str(docs[i], "state", f"{iat}[{i}]") != "absent":
                secondary[name] = network
        elif bindings[i] == "sriov":  # on the pod network: the pod's network status lists no VF
            raise field_error(f"{iat}[{i}].sriov", "found no SR-IOV networks to PCI-Address mapping")
    return tuple(iface if iface.name in pods else replace(iface, network=secondary[iface.name])
                 for iface in interfaces if iface.name in pods or iface.name in secondary)

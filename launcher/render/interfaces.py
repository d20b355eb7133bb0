"""The VMI's pod-network NICs -> libvirt elements (pure).

The device follows pkg/virt-launcher/virtwrap/converter/network (configurator.go, builder.go): alias
ua-NAME, the virtio model as every other virtio device here, the MAC, PCI address, boot order, the
option ROM disabled unless the NIC boots, the link state. Its backend is the VM's pod switch
(launcher.network.switch), reached over a unix socket with qemu's stream netdev, the framing passt
speaks. libvirt 9.0 as Debian ships it refuses <backend type='passt'/> ("Invalid value for attribute
'type' in element 'backend'") and has no element for a stream netdev, so the device is libvirt's
user-mode interface, which libvirt places and boots as any NIC, and two elements of libvirt's qemu
namespace take it off qemu's own stack: qemu:commandline adds the stream netdev, qemu:override points
the device at it. The user-mode netdev libvirt still adds is left with no device (qemu says "netdev
... has no peer"): no frame reaches it, and it never opens a socket.

A Multus bridge network's NIC is KubeVirt's bridge binding on a secondary network
(converter/network/configurator.go tapBindingOptions, pkg/network/domainspec/generators.go
TapLibvirtSpecGenerator): libvirt's `ethernet` interface on a tap made beforehand, `managed='no'`
(libvirt only opens it, as an unprivileged daemon may: the tap is the VM's uid's), with the pod
interface's MTU and MAC (the spec's, else the pod interface's, which here is the one the launcher
gives: launcher.network.linuxbridge). In the pod the tap is `tap` and the pod interface's hash
(pkg/network/link/names.go GenerateTapDeviceName, namescheme GenerateHashedInterfaceName); on a node
it must be unique among every VM's, so the launcher names it, and `launcher domain`, which makes no
tap, shows KubeVirt's name.
"""

from __future__ import annotations

import hashlib
import xml.etree.ElementTree as ET

from launcher.spec.network import Interface

QEMU_NS = "http://libvirt.org/schemas/domain/qemu/1.0"
ET.register_namespace("qemu", QEMU_NS)


def alias(iface: Interface) -> str:
    return f"ua-{iface.name}"  # api.NewUserDefinedAlias


def netdev_id(iface: Interface) -> str:
    return f"pod-{iface.name}"  # a qemu id: starts with a letter, as an interface name need not


def socket_path(net_dir: str, position: int) -> str:
    """The switch socket of the VM's `position`th NIC: short, as a unix socket's path is at most 107 bytes."""
    return f"{net_dir}/{position}.sock"


def netdev(iface: Interface, socket_path: str) -> str:
    # qemu's option syntax: a comma in a value is written twice
    return f"stream,id={netdev_id(iface)},server=off,addr.type=unix,addr.path={socket_path.replace(',', ',,')}"


def pod_tap_name(iface: Interface) -> str:
    """The tap KubeVirt makes in the pod for a secondary network's NIC: `tap` and the hashed pod
    interface name without its `pod` prefix (namescheme.go: sha256 of the network's name, 11 hex digits);
    tap0 for the Multus default network's, whose pod interface is eth0."""
    if iface.network is not None and iface.network.primary:
        return "tap0"
    return "tap" + hashlib.sha256(iface.name.encode()).hexdigest()[:11]


def render(iface: Interface, virtio_model: str, devices: ET.Element, queues: int = 0,
           tap: tuple[str, str | None] | None = None) -> None:
    """`queues`: network/virtio-queues.go NetworkQueuesCapacity, 0 without networkInterfaceMultiqueue;
    `tap`: (device, MAC) the launcher made for a bridge network's NIC (None: KubeVirt's in-pod name, no MAC
    unless the spec or the NAD gives one)."""
    if iface.network is None:
        element = ET.SubElement(devices, "interface", type="user")
        mac = iface.mac
    else:
        element = ET.SubElement(devices, "interface", type="ethernet")
        device, made_mac = tap if tap is not None else (pod_tap_name(iface), None)
        mac = iface.mac or iface.network.mac or made_mac
    if mac:
        ET.SubElement(element, "mac", address=mac)
    if iface.network is not None:
        ET.SubElement(element, "target", dev=device, managed="no")
        ET.SubElement(element, "mtu", size=str(iface.network.mtu))
    ET.SubElement(element, "model", type=virtio_model if iface.model == "virtio" else iface.model)
    if iface.model == "virtio" and queues:
        ET.SubElement(element, "driver", name="vhost", queues=str(queues))  # configurator.go newVirtioDriver
    ET.SubElement(element, "alias", name=alias(iface))
    if iface.boot_order is not None:
        ET.SubElement(element, "boot", order=str(iface.boot_order))
    else:
        ET.SubElement(element, "rom", enabled="no")
    if iface.link_down:
        ET.SubElement(element, "link", state="down")  # builder.go withLinkStateDown
    if iface.pci_address:
        domain_, bus, rest = iface.pci_address.split(":")
        slot, function = rest.split(".")
        ET.SubElement(element, "address", type="pci", domain=f"0x{domain_}", bus=f"0x{bus}", slot=f"0x{slot}", function=f"0x{function}")


def backends(domain: ET.Element, nics: list[tuple[Interface, str]]) -> None:
    """The stream netdev of each pod-network (interface, switch socket) and the device pointed at it."""
    if not nics:
        return
    commandline = ET.SubElement(domain, f"{{{QEMU_NS}}}commandline")
    for iface, socket_path in nics:
        ET.SubElement(commandline, f"{{{QEMU_NS}}}arg", value="-netdev")
        ET.SubElement(commandline, f"{{{QEMU_NS}}}arg", value=netdev(iface, socket_path))
    override = ET.SubElement(domain, f"{{{QEMU_NS}}}override")
    for iface, _ in nics:
        device = ET.SubElement(override, f"{{{QEMU_NS}}}device", alias=alias(iface))
        frontend = ET.SubElement(device, f"{{{QEMU_NS}}}frontend")
        ET.SubElement(frontend, f"{{{QEMU_NS}}}property", name="netdev", type="string", value=netdev_id(iface))

"""The VMI's pod-network NICs -> libvirt <interface> elements (pure).

Follows pkg/virt-launcher/virtwrap/converter/network (configurator.go, builder.go) for the device:
alias ua-NAME, the virtio model as every other virtio device here, the MAC, PCI address, boot order,
and the option ROM disabled unless the NIC boots. The backend differs, because there is no pod: every
binding becomes qemu's user-mode stack (type='user') on the network's vmNetworkCIDR, which needs no
privilege, touches no host bridge or firewall, lives inside qemu (no helper process to outlive the VM),
and takes forwards at run time (hostfwd_add), which is how `launcher port-forward` reaches any port.
qemu derives the netdev id from the alias: host<alias>, see netdev_id.
"""

from __future__ import annotations

import ipaddress
import xml.etree.ElementTree as ET

from launcher.spec.network import Interface


def alias(iface: Interface) -> str:
    return f"ua-{iface.name}"  # api.NewUserDefinedAlias


def netdev_id(iface: Interface) -> str:
    """The id libvirt gives the NIC's -netdev (qemuAssignDeviceNetAlias: "host" + the device alias)."""
    return f"host{alias(iface)}"


def render(iface: Interface, virtio_model: str, devices: ET.Element, queues: int = 0) -> None:
    """`queues`: network/virtio-queues.go NetworkQueuesCapacity, 0 without networkInterfaceMultiqueue."""
    element = ET.SubElement(devices, "interface", type="user")
    if iface.mac:
        ET.SubElement(element, "mac", address=iface.mac)
    net = ipaddress.IPv4Network(iface.cidr)
    ET.SubElement(element, "ip", family="ipv4", address=str(net.network_address), prefix=str(net.prefixlen))
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

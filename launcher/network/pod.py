"""The pod's network, as a VM the launcher runs sees it: the network namespace the launcher runs in.

In KubeVirt the guest's NIC sits behind its virt-launcher pod's interface, and what a binding gives
the guest comes from that interface: its address (bridge and the passt binding hand it to the
guest), its MTU, whether it has IPv4 and IPv6 at all (masquerade configures each family the pod has,
pkg/network/setup/netpod/netpod.go hasIPGlobalUnicast), and the pod's resolv.conf (the guest's DNS,
pkg/network/dhcp/configurator.go). Here the launcher's own network namespace is the pod: on a laptop
the host's, in a pod the pod's. Its interface is the one with the default route, as passt picks it.
Read from /proc and /sys, no tool run.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

RESOLV_CONF = Path("/etc/resolv.conf")
RESOLV_LIMIT = 64 << 10  # resolv.conf is a few lines; what is past this is not read
SIOCGIFADDR, SIOCGIFNETMASK = 0x8915, 0x891B


@dataclass(frozen=True)
class PodNet:
    ipv4: Optional[ipaddress.IPv4Interface] = None  # the interface's address and prefix
    gateway4: Optional[ipaddress.IPv4Address] = None
    ipv6: Optional[ipaddress.IPv6Interface] = None  # a global unicast one
    gateway6: Optional[ipaddress.IPv6Address] = None
    mtu: int = 1500
    nameservers: tuple[ipaddress._BaseAddress, ...] = ()


def default_route4(text: str) -> Optional[tuple[str, ipaddress.IPv4Address]]:
    """/proc/net/route: the interface and gateway of the IPv4 default route of lowest metric."""
    best = None
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 8 or fields[1] != "00000000" or fields[7] != "00000000" or not int(fields[3], 16) & 0x1:
            continue  # RTF_UP
        gateway = ipaddress.IPv4Address(struct.pack("<I", int(fields[2], 16)))
        if best is None or int(fields[6]) < best[0]:
            best = (int(fields[6]), fields[0], gateway)
    return None if best is None else (best[1], best[2])


def default_route6(text: str) -> Optional[tuple[str, ipaddress.IPv6Address]]:
    """/proc/net/ipv6_route: the interface and next hop of the IPv6 default route of lowest metric."""
    best = None
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 10 or fields[0] != "0" * 32 or fields[1] != "00" or fields[9] == "lo":
            continue
        flags = int(fields[8], 16)
        if not flags & 0x1 or flags & 0x200:  # RTF_UP, not RTF_REJECT
            continue
        if best is None or int(fields[5], 16) < best[0]:
            best = (int(fields[5], 16), fields[9], ipaddress.IPv6Address(bytes.fromhex(fields[4])))
    return None if best is None else (best[1], best[2])


def global_address6(text: str, interface: str) -> Optional[ipaddress.IPv6Interface]:
    """/proc/net/if_inet6: the interface's first global-scope address not tentative or deprecated."""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 6 or fields[5] != interface or int(fields[3], 16) != 0:
            continue
        if int(fields[4], 16) & (0x40 | 0x20):  # IFA_F_TENTATIVE, IFA_F_DEPRECATED
            continue
        return ipaddress.IPv6Interface((bytes.fromhex(fields[0]), int(fields[2], 16)))
    return None


def nameservers(text: str) -> tuple[ipaddress._BaseAddress, ...]:
    """resolv.conf's nameserver lines, as glibc reads them (an IPv6 address may carry a %zone)."""
    found = []
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[0] == "nameserver":
            try:
                found.append(ipaddress.ip_address(fields[1].split("%", 1)[0]))
            except ValueError:
                continue
    return tuple(found)


def _ioctl_address(interface: str, request: int) -> Optional[ipaddress.IPv4Address]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            answer = fcntl.ioctl(s.fileno(), request, struct.pack("16s16x", interface.encode()[:15]))
        except OSError:
            return None
    return ipaddress.IPv4Address(answer[20:24])


def _read(path: str | Path, limit: int = 1 << 20) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


def read() -> PodNet:
    """This network namespace as a pod's network."""
    ipv4 = gateway4 = ipv6 = gateway6 = None
    mtu_of = None
    route4 = default_route4(_read("/proc/net/route"))
    if route4 is not None:
        interface, gateway4 = route4
        address, mask = _ioctl_address(interface, SIOCGIFADDR), _ioctl_address(interface, SIOCGIFNETMASK)
        if address is not None and mask is not None:
            ipv4 = ipaddress.IPv4Interface(f"{address}/{mask}")
            mtu_of = interface
        else:
            gateway4 = None
    route6 = default_route6(_read("/proc/net/ipv6_route"))
    if route6 is not None:
        interface, gateway6 = route6
        ipv6 = global_address6(_read("/proc/net/if_inet6"), interface)
        if ipv6 is None:
            gateway6 = None
        mtu_of = mtu_of or (interface if ipv6 else None)
    mtu = 1500
    if mtu_of:
        text = _read(f"/sys/class/net/{mtu_of}/mtu").strip()
        mtu = int(text) if text.isdigit() else mtu
    return PodNet(ipv4, gateway4, ipv6, gateway6, mtu, nameservers(_read(RESOLV_CONF, RESOLV_LIMIT)))

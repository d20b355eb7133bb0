"""What a guest's frames may reach (pure): the one check every frame a guest NIC sends passes before
the user-mode stack behind it (passt, in the host's network namespace) turns it into a socket of the
host's, and the translation of the launcher's own forwards to guest ports.

A user-mode stack opens, for each connection a guest starts, a socket of the host's to the address
the guest named. An address that means the host itself there (127.0.0.0/8, 0.0.0.0/8, ::1, ::,
IPv4-mapped ones) would hand the guest the host's loopback, where the node keeps what it binds to
127.0.0.1 only: a local registry, other VMs' forwarded ports. qemu's user-mode stack even mapped its
gateway onto 127.0.0.1 by design; passt does too unless told not to (--no-map-gw), and still connects
wherever a hand-made packet points. So every frame is judged here by where it goes, whatever its
protocol, before anything sees it:

- never to an address of the host's loopback, nor to IPv4/IPv6 multicast or broadcast, except what
  DHCP, DHCPv6 and neighbour discovery need;
- masquerade (KubeVirt's in-pod bridge, pkg/network/setup/netpod/netpod.go masqueradeBindingSpec):
  on the guest's subnet only the gateway answers, and it serves DNS over UDP (the switch forwards it
  to the pod's resolver) and echo requests, nothing else: the pod's bridge is no door to the node. ARP
  and neighbour solicitations for any other address of the subnet go unanswered, as on an empty bridge;
- the replies of the launcher's own forwards (see `Forwards`) go to the stack that made them, and so
  do the guest's answers to connections the stack brings in from the gateway's address (a published
  port reached over the loopback: passt shows such a peer as the gateway), seen as they pass
  (`stack_frame`).

Anything malformed, fragmented where ports matter, or of another ethertype is dropped: a frame is
passed on only when every field the rules read is there.
"""

from __future__ import annotations

import ipaddress
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

ETH_HEADER = 14
ETH_IPV4, ETH_IPV6, ETH_ARP = 0x0800, 0x86DD, 0x0806
TCP, UDP, ICMP, ICMPV6 = 6, 17, 1, 58
DNS_PORT, DHCP_SERVER_PORT, DHCPV6_SERVER_PORT = 53, 67, 547
# ICMPv6 router and neighbour discovery (RFC 4861): solicitation and advertisement types 133-137
NDP_TYPES = range(133, 138)
NEIGHBOR_SOLICITATION = 135
ECHO_REQUEST4, ECHO_REPLY4, ECHO_REQUEST6, ECHO_REPLY6 = 8, 0, 128, 129

# Where a socket of the host's would land on the host itself: never a guest's to name.
HOST_ONLY4 = (ipaddress.IPv4Network("0.0.0.0/8"), ipaddress.IPv4Network("127.0.0.0/8"))
HOST_ONLY6 = (ipaddress.IPv6Network("::/128"), ipaddress.IPv6Network("::1/128"),
              ipaddress.IPv6Network("::ffff:0:0/96"), ipaddress.IPv6Network("::/96"))
LINK_LOCAL6 = ipaddress.IPv6Network("fe80::/10")


# The port the forwards' stack listens on for each protocol, in the switch's own network namespace
# (nothing else is there to take it).
ENTRY = 10000


class Route(Enum):
    DROP = "drop"
    STACK = "stack"  # the user-mode stack of the guest's own traffic
    FORWARDS = "forwards"  # the stack that carries the launcher's forwards into the guest
    REPLY = "reply"  # answered here: the frame to send back to the guest
    DNS = "dns"  # a DNS query to the gateway, for the switch's forwarder


@dataclass(frozen=True)
class Policy:
    """The guest's side of the link, as its binding gives it (launcher.network.bindings)."""

    gateway4: Optional[ipaddress.IPv4Address] = None
    gateway6: Optional[ipaddress.IPv6Address] = None
    # masquerade: the guest's subnets, where nothing but the gateway answers, and the gateway serves
    # DNS and echo only; None where the guest sits on the pod's own network (bridge, passt binding)
    closed4: Optional[ipaddress.IPv4Network] = None
    closed6: Optional[ipaddress.IPv6Network] = None
    dns_forwarder: bool = False  # the gateway's DNS is the switch's, forwarding to the pod's resolver


@dataclass
class Forwards:
    """The launcher's forwards into the guest. Their stack (a passt of the switch's own, in a network
    namespace nothing else is in) has one listener per protocol, whose connections all reach guest
    port `placeholder` from the gateway at the source port the switch connected from; each such port
    is registered here with the guest port it stands for, and the frames of its flow are rewritten
    between the two on their way (ports only: the checksums are adjusted, RFC 1624)."""

    placeholder: int = 1
    flows: dict[tuple[int, int], int] = field(default_factory=dict)  # (protocol, source port) -> guest port
    # (protocol, gateway port, guest port) of what the guest's own stack brought in from the gateway,
    # the latest INBOUND_LIMIT of them
    inbound: OrderedDict = field(default_factory=OrderedDict)


INBOUND_LIMIT = 4096


@dataclass(frozen=True)
class _Packet:
    family: int  # 4 or 6
    protocol: int
    src: ipaddress._BaseAddress
    dst: ipaddress._BaseAddress
    l4: int  # offset of the transport header in the frame; -1 if it cannot be read (a later fragment)


def _packet(frame: bytes) -> Optional[_Packet]:
    kind = struct.unpack_from("!H", frame, 12)[0]
    if kind == ETH_IPV4:
        if len(frame) < ETH_HEADER + 20 or frame[ETH_HEADER] >> 4 != 4:
            return None
        ihl = (frame[ETH_HEADER] & 0x0F) * 4
        if ihl < 20 or len(frame) < ETH_HEADER + ihl:
            return None
        fragment = struct.unpack_from("!H", frame, ETH_HEADER + 6)[0]
        l4 = ETH_HEADER + ihl if fragment & 0x3FFF == 0 else -1  # MF set or an offset: no whole header here
        return _Packet(4, frame[ETH_HEADER + 9], ipaddress.IPv4Address(frame[ETH_HEADER + 12:ETH_HEADER + 16]),
                       ipaddress.IPv4Address(frame[ETH_HEADER + 16:ETH_HEADER + 20]), l4)
    if kind == ETH_IPV6:
        if len(frame) < ETH_HEADER + 40 or frame[ETH_HEADER] >> 4 != 6:
            return None
        # Extension headers are not followed: a frame with one is judged by its address alone and its
        # transport unknown, so it passes only where the protocol does not matter.
        return _Packet(6, frame[ETH_HEADER + 6], ipaddress.IPv6Address(frame[ETH_HEADER + 8:ETH_HEADER + 24]),
                       ipaddress.IPv6Address(frame[ETH_HEADER + 24:ETH_HEADER + 40]), ETH_HEADER + 40)
    return None


def _ports(frame: bytes, packet: _Packet) -> Optional[tuple[int, int]]:
    if packet.protocol not in (TCP, UDP) or packet.l4 < 0 or len(frame) < packet.l4 + (20 if packet.protocol == TCP else 8):
        return None
    return struct.unpack_from("!HH", frame, packet.l4)


def _icmp_type(frame: bytes, packet: _Packet) -> Optional[int]:
    wanted = ICMP if packet.family == 4 else ICMPV6
    if packet.protocol != wanted or packet.l4 < 0 or len(frame) < packet.l4 + 8:
        return None
    return frame[packet.l4]


def guest_frame(frame: bytes, policy: Policy, forwards: Forwards) -> tuple[Route, Optional[bytes]]:
    """Where a frame from the guest goes, and the frame to send there (rewritten for a forward's flow,
    or the reply the switch gives itself)."""
    if len(frame) < ETH_HEADER:
        return Route.DROP, None
    kind = struct.unpack_from("!H", frame, 12)[0]
    if kind == ETH_ARP:
        return (Route.STACK, frame) if _arp_allowed(frame, policy) else (Route.DROP, None)
    packet = _packet(frame)
    if packet is None:
        return Route.DROP, None
    if packet.family == 4:
        return _ipv4(frame, packet, policy, forwards)
    return _ipv6(frame, packet, policy, forwards)


def _arp_allowed(frame: bytes, policy: Policy) -> bool:
    # Ethernet/IPv4 ARP (RFC 826): htype 1, ptype 0x0800, hlen 6, plen 4; the target address at 24..28
    if len(frame) < ETH_HEADER + 28 or frame[ETH_HEADER:ETH_HEADER + 6] != b"\x00\x01\x08\x00\x06\x04":
        return False
    if policy.closed4 is None:
        return True
    return ipaddress.IPv4Address(frame[ETH_HEADER + 24:ETH_HEADER + 28]) == policy.gateway4


def _ipv4(frame: bytes, packet: _Packet, policy: Policy, forwards: Forwards) -> tuple[Route, Optional[bytes]]:
    dst = packet.dst
    if any(dst in net for net in HOST_ONLY4) or dst.is_multicast:
        return Route.DROP, None
    ports = _ports(frame, packet)
    if dst == ipaddress.IPv4Address("255.255.255.255") or (policy.closed4 is not None and dst == policy.closed4.broadcast_address):
        return (Route.STACK, frame) if packet.protocol == UDP and ports and ports[1] == DHCP_SERVER_PORT else (Route.DROP, None)
    if dst == policy.gateway4:
        reply = _forward_reply(frame, packet, ports, forwards)
        if reply is not None:
            return Route.FORWARDS, reply
        if policy.dns_forwarder and packet.protocol == UDP and ports and ports[1] == DNS_PORT:
            return Route.DNS, frame
        if policy.closed4 is None or _answers_inbound(packet, ports, forwards):
            return Route.STACK, frame
        return _closed_gateway(frame, packet, ports)
    if policy.closed4 is not None and dst in policy.closed4:
        return Route.DROP, None
    return Route.STACK, frame


def _ipv6(frame: bytes, packet: _Packet, policy: Policy, forwards: Forwards) -> tuple[Route, Optional[bytes]]:
    dst = packet.dst
    if any(dst in net for net in HOST_ONLY6):
        return Route.DROP, None
    ports = _ports(frame, packet)
    icmp = _icmp_type(frame, packet)
    if dst.is_multicast or dst in LINK_LOCAL6:
        # link-local and multicast: neighbour and router discovery, DHCPv6, and nothing else
        if icmp in NDP_TYPES and _solicits_allowed(frame, packet, icmp, policy):
            return Route.STACK, frame
        if dst.is_multicast and packet.protocol == UDP and ports and ports[1] == DHCPV6_SERVER_PORT:
            return Route.STACK, frame
        return Route.DROP, None
    if dst == policy.gateway6:
        reply = _forward_reply(frame, packet, ports, forwards)
        if reply is not None:
            return Route.FORWARDS, reply
        if policy.dns_forwarder and packet.protocol == UDP and ports and ports[1] == DNS_PORT:
            return Route.DNS, frame
        if policy.closed6 is None or _answers_inbound(packet, ports, forwards) or (icmp in NDP_TYPES and _solicits_allowed(frame, packet, icmp, policy)):
            return Route.STACK, frame
        return _closed_gateway(frame, packet, ports)
    if policy.closed6 is not None and dst in policy.closed6:
        return Route.DROP, None
    return Route.STACK, frame


def _solicits_allowed(frame: bytes, packet: _Packet, icmp: int, policy: Policy) -> bool:
    """masquerade: a neighbour solicitation is answered for the gateway only (the target at 8..24)."""
    if icmp != NEIGHBOR_SOLICITATION or policy.closed6 is None:
        return True
    if len(frame) < packet.l4 + 24:
        return False
    return ipaddress.IPv6Address(frame[packet.l4 + 8:packet.l4 + 24]) == policy.gateway6


def _closed_gateway(frame: bytes, packet: _Packet, ports: Optional[tuple[int, int]]) -> tuple[Route, Optional[bytes]]:
    """masquerade's gateway: echo answered here, nothing else (its DNS is the forwarder's, above)."""
    if _icmp_type(frame, packet) == (ECHO_REQUEST4 if packet.family == 4 else ECHO_REQUEST6):
        return Route.REPLY, echo_reply(frame, packet)
    return Route.DROP, None


def stack_frame(frame: bytes, policy: Policy, forwards: Forwards) -> None:
    """Note a connection (a TCP SYN) or datagram the guest's stack brings in from the gateway's address."""
    if len(frame) < ETH_HEADER:
        return
    packet = _packet(frame)
    if packet is None or packet.src not in (policy.gateway4, policy.gateway6):
        return
    ports = _ports(frame, packet)
    if ports is None:
        return
    if packet.protocol == TCP and frame[packet.l4 + 13] & 0x12 != 0x02:  # SYN without ACK: a connection begins
        return
    key = (packet.protocol, ports[0], ports[1])
    forwards.inbound[key] = None
    forwards.inbound.move_to_end(key)
    while len(forwards.inbound) > INBOUND_LIMIT:
        forwards.inbound.popitem(last=False)


def _answers_inbound(packet: _Packet, ports: Optional[tuple[int, int]], forwards: Forwards) -> bool:
    return ports is not None and (packet.protocol, ports[1], ports[0]) in forwards.inbound


def _forward_reply(frame: bytes, packet: _Packet, ports: Optional[tuple[int, int]], forwards: Forwards) -> Optional[bytes]:
    """The guest's side of a forward's flow: from the guest port the flow stands for, to the source
    port the switch connected from; rewritten to come from the placeholder."""
    if ports is None:
        return None
    sport, dport = ports
    if forwards.flows.get((packet.protocol, dport)) != sport:
        return None
    return _rewrite_port(frame, packet, 0, forwards.placeholder)


def forwards_frame(frame: bytes, forwards: Forwards, policy: Policy, guest_mac: bytes, gateway_mac: bytes) -> Optional[bytes]:
    """A frame from the forwards' stack to the guest: only a registered flow's, from the gateway to the
    placeholder, rewritten to the guest port it stands for; its addresses are the gateway's and the
    guest's MAC (that stack knows neither)."""
    if len(frame) < ETH_HEADER:
        return None
    packet = _packet(frame)
    if packet is None or packet.src not in (policy.gateway4, policy.gateway6):
        return None
    ports = _ports(frame, packet)
    if ports is None or ports[1] != forwards.placeholder:
        return None
    port = forwards.flows.get((packet.protocol, ports[0]))
    if port is None:
        return None
    out = bytearray(_rewrite_port(frame, packet, 2, port))
    out[0:6], out[6:12] = guest_mac, gateway_mac
    return bytes(out)


def _checksum_offset(packet: _Packet) -> int:
    return packet.l4 + (16 if packet.protocol == TCP else 6)


def _adjust(checksum: int, old: int, new: int) -> int:
    """RFC 1624 eqn. 3: HC' = ~(~HC + ~m + m')."""
    total = (~checksum & 0xFFFF) + (~old & 0xFFFF) + new
    total = (total & 0xFFFF) + (total >> 16)
    total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _rewrite_port(frame: bytes, packet: _Packet, where: int, port: int) -> bytes:
    """The source (`where` 0) or destination (2) port of a TCP or UDP header set to `port`."""
    out = bytearray(frame)
    at = packet.l4 + where
    old = struct.unpack_from("!H", out, at)[0]
    struct.pack_into("!H", out, at, port)
    csum_at = _checksum_offset(packet)
    checksum = struct.unpack_from("!H", out, csum_at)[0]
    if packet.protocol == UDP and packet.family == 4 and checksum == 0:
        return bytes(out)  # no checksum sent (RFC 768)
    new = _adjust(checksum, old, port)
    if packet.protocol == UDP and new == 0:
        new = 0xFFFF
    struct.pack_into("!H", out, csum_at, new)
    return bytes(out)


def echo_reply(frame: bytes, packet: Optional[_Packet] = None) -> bytes:
    """The gateway's answer to an echo request: addresses swapped, the type a reply's, the checksum
    adjusted (the ICMPv6 pseudo-header sums the same addresses, swapped)."""
    packet = packet or _packet(frame)
    out = bytearray(frame)
    out[0:6], out[6:12] = frame[6:12], frame[0:6]
    if packet.family == 4:
        out[ETH_HEADER + 12:ETH_HEADER + 16], out[ETH_HEADER + 16:ETH_HEADER + 20] = frame[ETH_HEADER + 16:ETH_HEADER + 20], frame[ETH_HEADER + 12:ETH_HEADER + 16]
        request, reply = ECHO_REQUEST4, ECHO_REPLY4
    else:
        out[ETH_HEADER + 8:ETH_HEADER + 24], out[ETH_HEADER + 24:ETH_HEADER + 40] = frame[ETH_HEADER + 24:ETH_HEADER + 40], frame[ETH_HEADER + 8:ETH_HEADER + 24]
        request, reply = ECHO_REQUEST6, ECHO_REPLY6
    out[packet.l4] = reply
    checksum = struct.unpack_from("!H", out, packet.l4 + 2)[0]
    struct.pack_into("!H", out, packet.l4 + 2, _adjust(checksum, request << 8, reply << 8))
    return bytes(out)


def dns_query(frame: bytes) -> Optional[bytes]:
    """The payload of a UDP frame the guard routed to the DNS forwarder."""
    packet = _packet(frame)
    if packet is None or packet.l4 < 0 or len(frame) < packet.l4 + 8:
        return None
    length = struct.unpack_from("!H", frame, packet.l4 + 4)[0]
    if length < 8 or packet.l4 + length > len(frame):
        return None
    return frame[packet.l4 + 8:packet.l4 + length]


def udp_reply(request: bytes, payload: bytes) -> bytes:
    """The answer to a guest's UDP `request` frame, from where it was sent to: addresses and ports
    swapped, `payload` carried, lengths and checksums made afresh."""
    packet = _packet(request)
    sport, dport = struct.unpack_from("!HH", request, packet.l4)
    segment = bytearray(struct.pack("!HHHH", dport, sport, 8 + len(payload), 0) + payload)
    src, dst = packet.dst.packed, packet.src.packed
    if packet.family == 4:
        pseudo = src + dst + struct.pack("!BBH", 0, UDP, len(segment))
        header = bytearray(struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(segment), 0, 0x4000, 64, UDP, 0, src, dst))
        struct.pack_into("!H", header, 10, _sum(bytes(header)))
        kind = ETH_IPV4
    else:
        pseudo = src + dst + struct.pack("!IxxxB", len(segment), UDP)
        header = bytearray(struct.pack("!IHBB16s16s", 0x60000000, len(segment), UDP, 64, src, dst))
        kind = ETH_IPV6
    struct.pack_into("!H", segment, 6, _sum(pseudo + bytes(segment)) or 0xFFFF)
    return request[6:12] + request[0:6] + struct.pack("!H", kind) + bytes(header) + bytes(segment)


def _sum(data: bytes) -> int:
    """The Internet checksum (RFC 1071)."""
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF

"""Frames as a guest's NIC sends them, and a guest's end of qemu's stream netdev (a 4-byte big-endian
length, then the Ethernet frame): to talk to a VM's pod switch, or to passt, with no VM booted."""

from __future__ import annotations

import ipaddress
import select
import socket
import struct
import time
from typing import Optional

GUEST_MAC = bytes.fromhex("020000aabbcc")
BROADCAST = b"\xff" * 6


def checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def _pseudo(src: str, dst: str, protocol: int, length: int) -> bytes:
    a, b = ipaddress.ip_address(src), ipaddress.ip_address(dst)
    if a.version == 4:
        return a.packed + b.packed + struct.pack("!BBH", 0, protocol, length)
    return a.packed + b.packed + struct.pack("!IxxxB", length, protocol)


def ip(src: str, dst: str, protocol: int, payload: bytes, hop_limit: int = 64) -> tuple[int, bytes]:
    """(ethertype, the IPv4 or IPv6 packet)"""
    a, b = ipaddress.ip_address(src), ipaddress.ip_address(dst)
    if a.version == 4:
        header = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(payload), 1, 0, hop_limit, protocol, 0, a.packed, b.packed)
        header = header[:10] + struct.pack("!H", checksum(header)) + header[12:]
        return 0x0800, header + payload
    return 0x86DD, struct.pack("!IHBB16s16s", 0x60000000, len(payload), protocol, hop_limit, a.packed, b.packed) + payload


def _l4(src: str, dst: str, protocol: int, segment: bytes, at: int) -> bytes:
    value = checksum(_pseudo(src, dst, protocol, len(segment)) + segment)
    if protocol == 17 and value == 0:
        value = 0xFFFF
    return segment[:at] + struct.pack("!H", value) + segment[at + 2:]


def tcp(src: str, sport: int, dst: str, dport: int, flags: int = 0x02, seq: int = 1, ack: int = 0, data: bytes = b"") -> tuple[int, bytes]:
    segment = struct.pack("!HHIIBBHHH", sport, dport, seq, ack, 5 << 4, flags, 64240, 0, 0) + data
    return ip(src, dst, 6, _l4(src, dst, 6, segment, 16))


def udp(src: str, sport: int, dst: str, dport: int, data: bytes, hop_limit: int = 64) -> tuple[int, bytes]:
    segment = struct.pack("!HHHH", sport, dport, 8 + len(data), 0) + data
    return ip(src, dst, 17, _l4(src, dst, 17, segment, 6), hop_limit)


def icmp_echo(src: str, dst: str, ident: int = 7) -> tuple[int, bytes]:
    if ipaddress.ip_address(src).version == 4:
        body = struct.pack("!BBHHH", 8, 0, 0, ident, 1) + b"ping"
        return ip(src, dst, 1, body[:2] + struct.pack("!H", checksum(body)) + body[4:])
    body = struct.pack("!BBHHH", 128, 0, 0, ident, 1) + b"ping"
    return ip(src, dst, 58, _l4(src, dst, 58, body, 2))


def icmp6(src: str, dst: str, kind: int, body: bytes) -> tuple[int, bytes]:
    message = struct.pack("!BBH", kind, 0, 0) + body
    return ip(src, dst, 58, _l4(src, dst, 58, message, 2), 255)


def arp_request(sender: str, target: str) -> tuple[int, bytes]:
    return 0x0806, struct.pack("!HHBBH6s4s6s4s", 1, 0x0800, 6, 4, 1, GUEST_MAC, ipaddress.IPv4Address(sender).packed,
                               b"\0" * 6, ipaddress.IPv4Address(target).packed)


def frame(packet: tuple[int, bytes], dst_mac: bytes = BROADCAST, src_mac: bytes = GUEST_MAC) -> bytes:
    kind, payload = packet
    return dst_mac + src_mac + struct.pack("!H", kind) + payload


def dhcp_discover() -> bytes:
    body = struct.pack("!BBBBIHH4s4s4s4s16s64s128s", 1, 1, 6, 0, 0x1234, 0, 0x8000, b"\0" * 4, b"\0" * 4, b"\0" * 4, b"\0" * 4,
                       GUEST_MAC + b"\0" * 10, b"", b"")
    body += bytes([99, 130, 83, 99, 53, 1, 1, 55, 4, 1, 3, 6, 26, 255])
    return frame(udp("0.0.0.0", 68, "255.255.255.255", 67, body))


def dhcp_options(reply: bytes) -> tuple[str, dict[int, bytes]]:
    """yiaddr and the options of a DHCPv4 reply frame."""
    packet = reply[14:]
    body = packet[(packet[0] & 0x0F) * 4 + 8:]
    options, at = {}, 240
    while at < len(body) and body[at] != 255:
        if body[at] == 0:
            at += 1
            continue
        options[body[at]] = body[at + 2:at + 2 + body[at + 1]]
        at += 2 + body[at + 1]
    return socket.inet_ntoa(body[16:20]), options


LINK_LOCAL = "fe80::ff:feaa:bbcc"


def dhcpv6_solicit() -> bytes:
    duid = struct.pack("!HH", 3, 1) + GUEST_MAC
    message = bytes([1]) + b"\x12\x34\x56" + struct.pack("!HH", 1, len(duid)) + duid + struct.pack("!HHIII", 3, 12, 1, 0, 0)
    message += struct.pack("!HHH", 6, 2, 23)  # option request: DNS servers
    return frame(udp(LINK_LOCAL, 546, "ff02::1:2", 547, message, 1), b"\x33\x33\x00\x01\x00\x02")


def dhcpv6_reply(reply: bytes) -> tuple[list[str], list[str]]:
    """(IA_NA addresses, DNS servers) of a DHCPv6 advertise or reply frame."""
    message = reply[14 + 40 + 8:]
    addresses, servers, at = [], [], 4
    while at + 4 <= len(message):
        code, length = struct.unpack_from("!HH", message, at)
        value = message[at + 4:at + 4 + length]
        at += 4 + length
        if code == 3:  # IA_NA: IAID, T1, T2, then options
            inner = 12
            while inner + 4 <= len(value):
                sub, sub_length = struct.unpack_from("!HH", value, inner)
                if sub == 5:
                    addresses.append(str(ipaddress.IPv6Address(value[inner + 4:inner + 20])))
                inner += 4 + sub_length
        elif code == 23:
            servers += [str(ipaddress.IPv6Address(value[i:i + 16])) for i in range(0, len(value), 16)]
    return addresses, servers


def router_solicitation() -> bytes:
    return frame(icmp6(LINK_LOCAL, "ff02::2", 133, b"\0" * 4 + bytes([1, 1]) + GUEST_MAC), b"\x33\x33\x00\x00\x00\x02")


class Wire:
    """The guest's end of a stream netdev."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def send(self, data: bytes) -> None:
        self.sock.sendall(struct.pack("!I", len(data)) + data)

    def receive(self, timeout: float = 5.0) -> Optional[bytes]:
        if not select.select([self.sock], [], [], timeout)[0]:
            return None
        head = self.sock.recv(4, socket.MSG_WAITALL)
        if len(head) < 4:
            return None
        return self.sock.recv(struct.unpack("!I", head)[0], socket.MSG_WAITALL)

    def frames(self, timeout: float = 2.0) -> list[bytes]:
        """What arrives until `timeout` passes with nothing more."""
        got = []
        while (one := self.receive(timeout)) is not None:
            got.append(one)
        return got

    def first(self, match, timeout: float = 10.0) -> Optional[bytes]:
        """The first frame `match` accepts, within `timeout`."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            one = self.receive(left)
            if one is None:
                return None
            if match(one):
                return one
        return None


def is_udp(port: int):
    def match(one: bytes) -> bool:
        kind = struct.unpack_from("!H", one, 12)[0]
        if kind == 0x0800:
            packet = one[14:]
            at = (packet[0] & 0x0F) * 4
            return packet[9] == 17 and struct.unpack_from("!H", packet, at + 2)[0] == port
        if kind == 0x86DD:
            return one[14 + 6] == 17 and struct.unpack_from("!H", one, 14 + 40 + 2)[0] == port
        return False
    return match


def is_icmp6(kind: int):
    return lambda one: struct.unpack_from("!H", one, 12)[0] == 0x86DD and one[14 + 6] == 58 and one[14 + 40] == kind


def tcp_to_guest(port: int):
    def match(one: bytes) -> bool:
        if struct.unpack_from("!H", one, 12)[0] != 0x0800 or one[14 + 9] != 6:
            return False
        at = 14 + (one[14] & 0x0F) * 4
        return struct.unpack_from("!H", one, at + 2)[0] == port
    return match

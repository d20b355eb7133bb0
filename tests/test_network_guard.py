"""The pod switch's judgement of guest frames, the plans of each binding and the pod's facts read from
/proc text (pure). The switch's tests drive the same through real passt (test_network_switch.py)."""

from __future__ import annotations

import ipaddress
import struct

import pytest

from diskkit.errors import DiskkitError
from launcher.network import bindings, guard
from launcher.network.guard import Forwards, Policy, Route
from launcher.network.pod import PodNet, default_route4, default_route6, global_address6, nameservers
from launcher.spec.fields import SpecError
from launcher.spec.network import Interface, Port
from tests import fakeguest as fg

GW = bytes.fromhex("020000000000")
# masquerade's policy: pkg/network/setup/netpod/netpod.go, the pod's bridge holds the gateway alone
MASQUERADE = Policy(ipaddress.IPv4Address("10.0.2.1"), ipaddress.IPv6Address("fd10:0:2::1"),
                    ipaddress.IPv4Network("10.0.2.0/24"), ipaddress.IPv6Network("fd10:0:2::/120"), dns_forwarder=True)
POD_ADDRESS = Policy(ipaddress.IPv4Address("192.0.2.1"), ipaddress.IPv6Address("fd00::1"))


def route(packet, policy=MASQUERADE, dst_mac=GW, forwards=None) -> Route:
    return guard.guest_frame(fg.frame(packet, dst_mac), policy, forwards or Forwards())[0]


@pytest.mark.parametrize("packet,expected", [
    # the host's loopback by any name: never, whatever the protocol
    (fg.tcp("10.0.2.2", 1000, "127.0.0.1", 5000), Route.DROP),
    (fg.tcp("10.0.2.2", 1000, "127.255.0.9", 5000), Route.DROP),
    (fg.udp("10.0.2.2", 1000, "127.0.0.53", 53, b"q"), Route.DROP),
    (fg.tcp("10.0.2.2", 1000, "0.0.0.0", 5000), Route.DROP),
    (fg.tcp("10.0.2.2", 1000, "0.1.2.3", 5000), Route.DROP),
    (fg.icmp_echo("10.0.2.2", "127.0.0.1"), Route.DROP),
    (fg.tcp("fd10:0:2::2", 1000, "::1", 5000), Route.DROP),
    (fg.tcp("fd10:0:2::2", 1000, "::", 5000), Route.DROP),
    (fg.tcp("fd10:0:2::2", 1000, "::ffff:127.0.0.1", 5000), Route.DROP),
    (fg.tcp("fd10:0:2::2", 1000, "::7f00:1", 5000), Route.DROP),
    # masquerade's gateway: DNS over UDP (the switch's forwarder), echo answered by the switch, nothing else
    (fg.udp("10.0.2.2", 1000, "10.0.2.1", 53, b"q"), Route.DNS),
    (fg.tcp("10.0.2.2", 1000, "10.0.2.1", 53), Route.DROP),
    (fg.tcp("10.0.2.2", 1000, "10.0.2.1", 22), Route.DROP),
    (fg.udp("10.0.2.2", 1000, "10.0.2.1", 5353, b"q"), Route.DROP),
    (fg.icmp_echo("10.0.2.2", "10.0.2.1"), Route.REPLY),
    (fg.udp("fd10:0:2::2", 1000, "fd10:0:2::1", 53, b"q"), Route.DNS),
    (fg.tcp("fd10:0:2::2", 1000, "fd10:0:2::1", 80), Route.DROP),
    (fg.icmp_echo("fd10:0:2::2", "fd10:0:2::1"), Route.REPLY),
    # the rest of the guest's subnet is an empty bridge
    (fg.tcp("10.0.2.2", 1000, "10.0.2.3", 80), Route.DROP),
    (fg.tcp("fd10:0:2::2", 1000, "fd10:0:2::9", 80), Route.DROP),
    (fg.arp_request("10.0.2.2", "10.0.2.3"), Route.DROP),
    (fg.arp_request("10.0.2.2", "10.0.2.1"), Route.STACK),
    # broadcast and multicast: DHCP, DHCPv6 and neighbour discovery only
    (fg.udp("0.0.0.0", 68, "255.255.255.255", 67, b"d"), Route.STACK),
    (fg.udp("10.0.2.2", 68, "10.0.2.255", 67, b"d"), Route.STACK),
    (fg.udp("10.0.2.2", 1000, "255.255.255.255", 9, b"x"), Route.DROP),
    (fg.udp("10.0.2.2", 1000, "224.0.0.251", 5353, b"x"), Route.DROP),
    (fg.udp(fg.LINK_LOCAL, 546, "ff02::1:2", 547, b"s"), Route.STACK),
    (fg.udp(fg.LINK_LOCAL, 1000, "ff02::fb", 5353, b"x"), Route.DROP),
    (fg.icmp6(fg.LINK_LOCAL, "ff02::2", 133, b"\0" * 4), Route.STACK),
    (fg.icmp6(fg.LINK_LOCAL, "ff02::1:ff00:1", 135, b"\0" * 4 + ipaddress.IPv6Address("fd10:0:2::1").packed), Route.STACK),
    (fg.icmp6(fg.LINK_LOCAL, "ff02::1:ff00:9", 135, b"\0" * 4 + ipaddress.IPv6Address("fd10:0:2::9").packed), Route.DROP),
    (fg.tcp(fg.LINK_LOCAL, 1000, "fe80::1", 80), Route.DROP),
    # the world outside, the node's own address included (as a pod reaches its node)
    (fg.tcp("10.0.2.2", 1000, "192.0.2.2", 80), Route.STACK),
    (fg.tcp("10.0.2.2", 1000, "93.184.216.34", 443), Route.STACK),
    (fg.udp("10.0.2.2", 1000, "8.8.8.8", 53, b"q"), Route.STACK),
    (fg.tcp("fd10:0:2::2", 1000, "2001:db8::1", 443), Route.STACK),
])
def test_masquerade_frames(packet, expected):
    assert route(packet) is expected


@pytest.mark.parametrize("packet,expected", [
    # a guest on the pod's own address: its gateway is the pod's, a router like any other
    (fg.tcp("192.0.2.2", 1000, "192.0.2.1", 80), Route.STACK),
    (fg.arp_request("192.0.2.2", "192.0.2.7"), Route.STACK),
    (fg.tcp("192.0.2.2", 1000, "192.0.2.7", 80), Route.STACK),
    (fg.tcp("192.0.2.2", 1000, "127.0.0.1", 80), Route.DROP),
    (fg.tcp("fd00::2", 1000, "::1", 80), Route.DROP),
    (fg.udp("192.0.2.2", 1000, "192.0.2.1", 53, b"q"), Route.STACK),  # the pod's resolver is its own, not the gateway's
])
def test_pod_address_frames(packet, expected):
    assert route(packet, POD_ADDRESS) is expected


def test_malformed_and_other_frames_are_dropped():
    ipv4 = fg.frame(fg.tcp("10.0.2.2", 1000, "8.8.8.8", 80))
    for frame in (b"", ipv4[:13], ipv4[:30], ipv4[:14] + b"\x46" + ipv4[15:20], GW + fg.GUEST_MAC + b"\x81\x00" + ipv4[12:]):
        assert guard.guest_frame(frame, MASQUERADE, Forwards())[0] is Route.DROP
    # a later fragment to the gateway carries no ports to judge
    kind, packet = fg.udp("10.0.2.2", 1000, "10.0.2.1", 53, b"q")
    fragment = bytearray(packet)
    struct.pack_into("!H", fragment, 6, 0x0010)
    assert route((kind, bytes(fragment))) is Route.DROP


def test_a_forwards_flow_is_translated_both_ways():
    forwards = Forwards()
    forwards.flows[(6, 40000)] = 8080
    # from the forwards' stack: gateway:40000 -> guest:placeholder becomes guest port 8080
    syn = fg.frame(fg.tcp("10.0.2.1", 40000, "10.0.2.2", forwards.placeholder), b"\0" * 6, b"\x02\xaa" * 3)
    out = guard.forwards_frame(syn, forwards, MASQUERADE, fg.GUEST_MAC, GW)
    assert out[:12] == fg.GUEST_MAC + GW and struct.unpack_from("!HH", out, 34) == (40000, 8080)
    assert fg.checksum(fg._pseudo("10.0.2.1", "10.0.2.2", 6, len(out) - 34) + out[34:]) == 0
    # and the guest's answer goes back to it, from the placeholder
    routed, back = guard.guest_frame(fg.frame(fg.tcp("10.0.2.2", 8080, "10.0.2.1", 40000, 0x12), GW), MASQUERADE, forwards)
    assert routed is Route.FORWARDS and struct.unpack_from("!HH", back, 34) == (forwards.placeholder, 40000)
    assert fg.checksum(fg._pseudo("10.0.2.2", "10.0.2.1", 6, len(back) - 34) + back[34:]) == 0
    # an unregistered flow is nobody's: not from that stack, not to it
    assert guard.forwards_frame(fg.frame(fg.tcp("10.0.2.1", 40001, "10.0.2.2", 1)), forwards, MASQUERADE, fg.GUEST_MAC, GW) is None
    assert route(fg.tcp("10.0.2.2", 9999, "10.0.2.1", 40000, 0x12), forwards=forwards) is Route.DROP


def test_answers_to_what_the_stack_brought_in_from_the_gateway_go_back_to_it():
    # a published port reached over the loopback: passt shows the peer as the gateway
    forwards = Forwards()
    guard.stack_frame(fg.frame(fg.tcp("10.0.2.1", 50000, "10.0.2.2", 80)), MASQUERADE, forwards)
    assert route(fg.tcp("10.0.2.2", 80, "10.0.2.1", 50000, 0x12), forwards=forwards) is Route.STACK
    assert route(fg.tcp("10.0.2.2", 81, "10.0.2.1", 50000, 0x12), forwards=forwards) is Route.DROP
    guard.stack_frame(fg.frame(fg.tcp("10.0.2.1", 50001, "10.0.2.2", 80, 0x10)), MASQUERADE, forwards)  # no SYN: no new flow
    assert route(fg.tcp("10.0.2.2", 80, "10.0.2.1", 50001, 0x10), forwards=forwards) is Route.DROP


def test_a_dns_answer_comes_back_as_the_gateways():
    query = fg.frame(fg.udp("10.0.2.2", 40000, "10.0.2.1", 53, b"\x42\x42question"), GW)
    assert guard.dns_query(query) == b"\x42\x42question"
    answer = guard.udp_reply(query, b"\x42\x42answer")
    assert answer[:12] == fg.GUEST_MAC + GW and answer[14 + 12:14 + 20] == bytes([10, 0, 2, 1, 10, 0, 2, 2])
    assert struct.unpack_from("!HH", answer, 34) == (53, 40000) and answer.endswith(b"\x42\x42answer")
    assert fg.checksum(answer[14:34]) == 0 and fg.checksum(fg._pseudo("10.0.2.1", "10.0.2.2", 17, len(answer) - 34) + answer[34:]) == 0
    query6 = fg.frame(fg.udp("fd10:0:2::2", 40000, "fd10:0:2::1", 53, b"q6"), GW)
    answer6 = guard.udp_reply(query6, b"a6")
    assert fg.checksum(fg._pseudo("fd10:0:2::1", "fd10:0:2::2", 17, len(answer6) - 54) + answer6[54:]) == 0


def test_echo_reply_is_a_valid_reply():
    request = fg.frame(fg.icmp_echo("10.0.2.2", "10.0.2.1"), GW)
    reply = guard.guest_frame(request, MASQUERADE, Forwards())[1]
    assert reply[:12] == fg.GUEST_MAC + GW and reply[34] == 0 and fg.checksum(reply[34:]) == 0
    request6 = fg.frame(fg.icmp_echo("fd10:0:2::2", "fd10:0:2::1"), GW)
    reply6 = guard.guest_frame(request6, MASQUERADE, Forwards())[1]
    assert reply6[54] == 129 and fg.checksum(fg._pseudo("fd10:0:2::1", "fd10:0:2::2", 58, len(reply6) - 54) + reply6[54:]) == 0


# ---------------------------------------------------------------- the bindings' plans

DUAL = PodNet(ipaddress.IPv4Interface("192.0.2.2/24"), ipaddress.IPv4Address("192.0.2.1"),
              ipaddress.IPv6Interface("fd00::2/64"), ipaddress.IPv6Address("fd00::1"), 1400, (ipaddress.IPv4Address("10.255.255.53"),))


def options(plan, flag):
    return [plan.stack[i + 1] for i, value in enumerate(plan.stack) if value == flag]


def test_masquerade_plan_is_kubevirts():
    # pkg/network/link/address.go, netpod.go gatewayIP; vmIPv6NetworkCIDR's default in api/defaults.go
    plan = bindings.plan(Interface("pod", 0, "masquerade"), DUAL)
    assert (str(plan.guest4), str(plan.gateway4), str(plan.guest6), str(plan.gateway6)) == ("10.0.2.2/24", "10.0.2.1", "fd10:0:2::2/120", "fd10:0:2::1")
    assert options(plan, "-a") == ["10.0.2.2", "fd10:0:2::2"] and options(plan, "-D") == ["10.0.2.1", "fd10:0:2::1"]
    # the gateway's DNS is the switch's, forwarding to the pod's resolv.conf (pkg/network/dhcp/configurator.go)
    assert plan.policy.dns_forwarder and plan.dns_upstream == DUAL.nameservers
    assert "--no-map-gw" in plan.stack and "--no-ra" in plan.stack and options(plan, "-m") == ["1400"]
    custom = bindings.plan(Interface("pod", 0, "masquerade", cidr="10.11.12.0/30", cidr6="fd20::/64"), DUAL)
    assert (str(custom.guest4), str(custom.gateway4), str(custom.guest6)) == ("10.11.12.2/30", "10.11.12.1", "fd20::2/64")
    # a pod with IPv4 only: no IPv6 for the guest (netpod.go configures each family the pod has)
    single = bindings.plan(Interface("pod", 0, "masquerade"), PodNet(DUAL.ipv4, DUAL.gateway4, mtu=1500))
    assert single.guest6 is None and "-4" in single.stack
    # no route out at all: still its address, for forwards; nothing to publish on
    offline = bindings.plan(Interface("pod", 0, "masquerade"), PodNet())
    assert str(offline.guest4) == "10.0.2.2/24" and not offline.online
    with pytest.raises(DiskkitError, match="--publish-address: interface pod's ports cannot be published"):
        bindings.plan(Interface("pod", 0, "masquerade", ports=(Port(80),)), PodNet(), "127.0.0.1")


def test_bridge_and_passt_plans_take_the_pods_address():
    bridge = bindings.plan(Interface("pod", 0, "bridge"), DUAL)
    assert (str(bridge.guest4), str(bridge.gateway4), bridge.guest6) == ("192.0.2.2/24", "192.0.2.1", None)
    assert options(bridge, "-D") == ["10.255.255.53"] and bridge.policy.closed4 is None
    assert not bridge.policy.dns_forwarder and bridge.dns_upstream == ()
    passt = bindings.plan(Interface("pod", 0, "passt"), DUAL)
    assert (str(passt.guest4), str(passt.guest6)) == ("192.0.2.2/24", "fd00::2/64")
    # a resolver on the pod's loopback cannot serve the guest: the gateway forwards to it
    loopback = bindings.plan(Interface("pod", 0, "bridge"), PodNet(DUAL.ipv4, DUAL.gateway4, mtu=1500, nameservers=(ipaddress.IPv4Address("127.0.0.53"),)))
    assert options(loopback, "-D") == ["192.0.2.1"] and loopback.policy.dns_forwarder
    assert loopback.dns_upstream == (ipaddress.IPv4Address("127.0.0.53"),)
    with pytest.raises(SpecError, match=r"^spec.domain.devices.interfaces\[0\].bridge: interface pod takes the pod's address"):
        bindings.plan(Interface("pod", 0, "bridge"), PodNet())
    with pytest.raises(SpecError, match=r"^spec.domain.devices.interfaces.binding: interface default takes the pod's address"):
        bindings.plan(Interface("default", -1, "passt"), PodNet())


def test_the_gateways_mac_is_no_guests():
    with pytest.raises(SpecError, match=r"interfaces\[0\].macAddress: The requested MAC address is reserved for the in-pod bridge"):
        bindings.plan(Interface("pod", 0, "bridge", mac="02:00:00:00:00:00"), DUAL)


def test_published_ports_are_passts_listeners():
    plan = bindings.plan(Interface("pod", 0, "masquerade", ports=(Port(80), Port(53, "UDP"))), DUAL, "0.0.0.0")
    assert options(plan, "-t") == ["0.0.0.0/80:80"] and options(plan, "-u") == ["0.0.0.0/53:53"]
    assert plan.publish == (("0.0.0.0", 80, "TCP"), ("0.0.0.0", 53, "UDP"))


# ---------------------------------------------------------------- the pod's facts, from /proc

def test_pod_facts_from_proc():
    route = ("Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
             "eth1\t00000000\t0101A8C0\t0003\t0\t0\t200\t00000000\t0\t0\t0\n"
             "eth0\t00000000\t010200C0\t0003\t0\t0\t100\t00000000\t0\t0\t0\n"
             "eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n")
    assert default_route4(route) == ("eth0", ipaddress.IPv4Address("192.0.2.1"))
    assert default_route4(route.splitlines()[0]) is None
    route6 = ("fd000000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001 eth0\n"
              "00000000000000000000000000000000 00 00000000000000000000000000000000 00 fd000000000000000000000000000001 00000400 00000001 00000000 00000003 eth0\n"
              "00000000000000000000000000000000 00 00000000000000000000000000000000 00 00000000000000000000000000000000 ffffffff 00000001 00000000 00200200 lo\n")
    assert default_route6(route6) == ("eth0", ipaddress.IPv6Address("fd00::1"))
    inet6 = ("fe80000000000000000000fffe000001 04 40 20 80     eth0\n"
             "fd000000000000000000000000000002 04 40 00 80     eth0\n")
    assert global_address6(inet6, "eth0") == ipaddress.IPv6Interface("fd00::2/64")
    assert global_address6(inet6.replace(" 80 ", " a0 "), "eth0") is None  # deprecated and tentative are no use
    assert nameservers("# x\nnameserver 10.0.0.1\nnameserver fe80::1%eth0\nnameserver bogus\nsearch a\n") == (
        ipaddress.IPv4Address("10.0.0.1"), ipaddress.IPv6Address("fe80::1"))

"""A VM's pod switch and its passt, driven frame by frame from the guest's end of qemu's stream netdev,
with no VM booted: what DHCP, DHCPv6 and the gateway hand each binding, that no frame of a guest reaches
the host's loopback, and the forwards. Started as a root launcher starts them, running as the qemu
user (107); the host's own facts are read with `ip`, not with the launcher's code."""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import pwd
import select
import socket
import stat
import struct
import subprocess

import pytest

from diskkit.errors import DiskkitError
from launcher.network import backend, bindings, pod
from launcher.spec.network import Interface
from tests import fakeguest as fg
from tests.vmhost import QEMU_UID, qemu_scratch

GATEWAY_MAC = bytes.fromhex(bindings.GATEWAY_MAC.replace(":", ""))


def host(family: str) -> tuple[ipaddress._BaseAddress | None, str | None, int | None]:
    """This host's (address with prefix, default gateway, MTU) of `family` ("-4" or "-6"), per `ip`."""
    routes = json.loads(subprocess.run(["ip", "-j", family, "route", "show", "default"], capture_output=True, text=True, check=True).stdout)
    if not routes:
        return None, None, None
    route = routes[0]
    (link,) = json.loads(subprocess.run(["ip", "-j", family, "addr", "show", "dev", route["dev"]], capture_output=True, text=True, check=True).stdout)
    found = [a for a in link["addr_info"] if a.get("scope") == "global"]
    if not found:
        return None, None, None
    return ipaddress.ip_interface(f"{found[0]['local']}/{found[0]['prefixlen']}"), route["gateway"], link["mtu"]


@contextlib.contextmanager
def switch(binding: str, here: pod.PodNet | None = None):
    """A switch for one NIC of `binding`, as `launcher run` starts it as root for qemu as 107, on this
    host's network (or `here`); yields (the guest's wire, the record's entry, the plan)."""
    with qemu_scratch("diskkit-net-") as root:
        net = root / "net"
        net.mkdir(mode=0o755)
        plan = bindings.plan(Interface("default", 0, binding), here or pod.read())
        started = backend.start([plan], [net / "0.sock"], (QEMU_UID, pwd.getpwuid(QEMU_UID).pw_gid))
        try:
            started.wait()
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as guest:
                guest.connect(str(net / "0.sock"))
                yield fg.Wire(guest), started.entries[0], plan
        finally:
            backend.stop(started.entries)


@contextlib.contextmanager
def listener(address: str, port: int = 0):
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as server:
        server.bind((address, port))
        server.listen(16)
        server.setblocking(False)
        yield server


def accepted(server: socket.socket) -> bool:
    try:
        conn, _ = server.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def test_masquerade_hands_out_kubevirts_addresses():
    # pkg/network/setup/netpod/netpod.go (masqueradeBindingSpec, gatewayIP) and pkg/network/dhcp/masquerade.go:
    # the 2nd address of vmNetworkCIDR for the guest, the 1st for the gateway, the pod's MTU;
    # examples/vmi-masquerade.yaml writes fd10:0:2::2/120 via fd10:0:2::1 for a dual-stack pod.
    _, _, mtu = host("-4")
    address6, _, _ = host("-6")
    with switch("masquerade") as (wire, _, _):
        wire.send(fg.dhcp_discover())
        offer = wire.first(fg.is_udp(68))
        assert offer is not None
        yiaddr, options = fg.dhcp_options(offer)
        assert (yiaddr, options[1], options[3], options[6]) == ("10.0.2.2", socket.inet_aton("255.255.255.0"),
                                                                 socket.inet_aton("10.0.2.1"), socket.inet_aton("10.0.2.1"))
        assert struct.unpack("!H", options[26])[0] == mtu
        wire.send(fg.router_solicitation())
        wire.send(fg.dhcpv6_solicit())
        answer = wire.first(fg.is_udp(546))
        if address6 is None:  # a pod without IPv6: no IPv6 for the guest
            assert answer is None
            return
        assert answer is not None and fg.dhcpv6_reply(answer) == (["fd10:0:2::2"], ["fd10:0:2::1"])
        # KubeVirt's in-pod servers send no router advertisement: the guest's IPv6 route is its own config
        assert wire.first(fg.is_icmp6(134), timeout=3) is None


@pytest.mark.parametrize("binding", ["bridge", "passt"])
def test_bridge_and_passt_give_the_guest_the_pods_address(binding):
    # pkg/network/dhcp/bridge.go: the pod's own IPv4 address and gateway; the passt binding plugin gives
    # both families as passt does. The pod here is the launcher's network namespace: this host's.
    address4, gateway4, _ = host("-4")
    address6, _, _ = host("-6")
    assert address4 is not None, "this host has no IPv4 default route to test with"
    with switch(binding) as (wire, _, _):
        wire.send(fg.dhcp_discover())
        offer = wire.first(fg.is_udp(68))
        yiaddr, options = fg.dhcp_options(offer)
        assert (yiaddr, options[1], options[3]) == (str(address4.ip), address4.netmask.packed, socket.inet_aton(gateway4))
        wire.send(fg.dhcpv6_solicit())
        answer = wire.first(fg.is_udp(546), timeout=3)
        if binding == "bridge" or address6 is None:
            assert answer is None
        else:
            assert answer is not None and fg.dhcpv6_reply(answer)[0] == [str(address6.ip)]


# (destination, port on it the listener is bound to) a hostile guest tries: the host's loopback by
# every name a socket of the host's would take for it, and the gateway and the guest's subnet, which
# in KubeVirt are the pod's bridge (pkg/network/setup/netpod/netpod.go), never the node.
LOOPBACK_NAMES = ["127.0.0.1", "127.1.2.3", "0.0.0.0", "10.0.2.1", "10.0.2.3", "::1", "::", "::ffff:127.0.0.1", "fd10:0:2::1"]


def test_no_frame_of_a_guest_reaches_the_hosts_loopback():
    with listener("127.0.0.1") as lo4, listener("::1", lo4.getsockname()[1]) as lo6, listener("0.0.0.0") as public, \
            switch("masquerade") as (wire, _, plan):
        port = lo4.getsockname()[1]
        for target in LOOPBACK_NAMES:
            source = str(plan.guest4.ip) if ":" not in target else "fd10:0:2::2"
            wire.send(fg.frame(fg.tcp(source, 40000, target, port), GATEWAY_MAC))
        # the control: the host's own address answers, as a node's does from a pod
        address4, _, _ = host("-4")
        wire.send(fg.frame(fg.tcp(str(plan.guest4.ip), 40001, str(address4.ip), public.getsockname()[1]), GATEWAY_MAC))
        synack = wire.first(lambda one: one[12:14] == b"\x08\x00" and one[14 + 9] == 6, timeout=10)
        assert synack is not None and socket.inet_ntoa(synack[14 + 12:14 + 16]) == str(address4.ip)
        assert accepted(public)
        # The loopback frames went first, on the same stream, and passt connects as it reads a SYN (a
        # loopback connect completes at once): had it seen one, its connection would be queued by now.
        assert not accepted(lo4) and not accepted(lo6)


def test_passt_alone_would_hand_the_guest_the_hosts_loopback():
    # Why the switch judges frames: passt with --no-map-gw still connects wherever a frame points.
    plan = bindings.plan(Interface("default", 0, "masquerade"), pod.read())
    ours, theirs = socket.socketpair()
    with listener("127.0.0.1") as lo4:
        proc = subprocess.Popen(["passt", "-f", "-q", "-1", "-F", str(theirs.fileno()), *plan.stack], pass_fds=(theirs.fileno(),),
                                stderr=subprocess.DEVNULL, user=QEMU_UID)
        theirs.close()
        try:
            wire = fg.Wire(ours)
            wire.send(fg.frame(fg.tcp(str(plan.guest4.ip), 40000, "127.0.0.1", lo4.getsockname()[1]), GATEWAY_MAC))
            assert wire.first(lambda one: one[12:14] == b"\x08\x00" and one[14 + 9] == 6) is not None
            assert accepted(lo4)
        finally:
            proc.kill()
            proc.wait()
            ours.close()


def test_the_gateway_forwards_dns_to_the_pods_resolver_even_on_its_loopback():
    # KubeVirt hands the pod's resolv.conf servers (pkg/network/dhcp/configurator.go); a laptop's is
    # often on the loopback (systemd-resolved's 127.0.0.53), where a guest may not go: the gateway
    # forwards to it, port 53 and UDP only. Here the pod's resolver is the test's, on 127.0.0.77.
    resolver = "127.0.0.77"
    here = dataclasses.replace(pod.read(), nameservers=(ipaddress.IPv4Address(resolver),))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server, switch("masquerade", here) as (wire, _, _):
        server.bind((resolver, 53))
        server.settimeout(10)
        # a DNS header (id, flags, counts) and a question for example.com
        question = struct.pack("!HHHH", 0x0100, 1, 0, 0) + b"\x07example\x03com\x00\x00\x01\x00\x01"
        wire.send(fg.frame(fg.udp("10.0.2.2", 40000, resolver, 53, b"\x11\x11" + question), GATEWAY_MAC))
        wire.send(fg.frame(fg.udp("10.0.2.2", 40000, "10.0.2.1", 53, b"\x42\x42" + question), GATEWAY_MAC))
        query, peer = server.recvfrom(512)
        assert query[2:] == question  # the one to the gateway, never the one to the loopback
        server.sendto(query[:2] + b"the-answer", peer)
        answer = wire.first(fg.is_udp(40000))
        assert answer is not None and answer.endswith(b"\x42\x42the-answer")
        assert socket.inet_ntoa(answer[14 + 12:14 + 16]) == "10.0.2.1" and struct.unpack_from("!H", answer, 34)[0] == 53
        assert fg.checksum(fg._pseudo("10.0.2.1", "10.0.2.2", 17, len(answer) - 34) + answer[34:]) == 0
        server.settimeout(1)
        with pytest.raises(TimeoutError):
            server.recvfrom(512)


def test_the_gateway_answers_echo_and_arp_and_nothing_else_of_the_subnet_answers():
    with switch("masquerade") as (wire, _, _):
        wire.send(fg.frame(fg.icmp_echo("10.0.2.2", "10.0.2.1"), GATEWAY_MAC))
        reply = wire.first(lambda one: one[12:14] == b"\x08\x00" and one[14 + 9] == 1)
        assert reply is not None and reply[14 + 20] == 0 and socket.inet_ntoa(reply[14 + 12:14 + 16]) == "10.0.2.1"
        assert fg.checksum(reply[14 + 20:]) == 0
        wire.send(fg.frame(fg.arp_request("10.0.2.2", "10.0.2.3")))
        wire.send(fg.frame(fg.arp_request("10.0.2.2", "10.0.2.1")))
        answer = wire.first(lambda one: one[12:14] == b"\x08\x06")
        assert answer is not None and answer[14 + 14:14 + 18] == socket.inet_aton("10.0.2.1")
        assert wire.first(lambda one: one[12:14] == b"\x08\x06", timeout=2) is None


def test_forwards_reach_any_guest_port_and_come_from_the_gateway():
    with switch("masquerade") as (wire, entry, plan):
        # a guest frame first: the switch learns the guest's MAC from it
        wire.send(fg.frame(fg.arp_request("10.0.2.2", "10.0.2.1")))
        with backend.open_forward(entry, "tcp", 8080) as forward:
            syn = wire.first(fg.tcp_to_guest(8080))
            assert syn is not None and syn[:6] == fg.GUEST_MAC and syn[6:12] == GATEWAY_MAC
            assert socket.inet_ntoa(syn[14 + 12:14 + 16]) == "10.0.2.1"
            assert fg.checksum(fg._pseudo("10.0.2.1", "10.0.2.2", 6, len(syn) - 34) + syn[34:]) == 0
        with backend.open_forward(entry, "udp", 5353) as forward:
            forward.sock.send(b"question")
            datagram = wire.first(fg.is_udp(5353))
            assert datagram is not None and datagram.endswith(b"question")
            source_port = struct.unpack_from("!H", datagram, 34)[0]
            wire.send(fg.frame(fg.udp("10.0.2.2", 5353, "10.0.2.1", source_port, b"answer"), GATEWAY_MAC))
            forward.sock.settimeout(10)
            assert forward.sock.recv(100) == b"answer"


def test_the_forward_control_is_the_launcher_users_alone():
    with switch("masquerade") as (_, entry, _):
        control = os.stat(entry["forward"])
        assert (stat.S_IMODE(control.st_mode), control.st_uid) == (0o600, os.geteuid())
        code = f"import socket; socket.socket(socket.AF_UNIX).connect({entry['forward']!r})"
        for uid in (QEMU_UID, 65534):  # qemu's user runs the switch; it may not ask for forwards either
            refused = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "/usr/bin/python3", "-c", code],
                                     capture_output=True, text=True)
            assert refused.returncode != 0 and "PermissionError" in refused.stderr, refused.stderr


def test_a_switch_ends_with_the_vm_and_takes_its_passts_along():
    with switch("masquerade") as (wire, entry, _):
        with backend.open_forward(entry, "tcp", 22):
            pass
        children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(entry["pid"])], capture_output=True, text=True).stdout.split()
        assert len(children) == 2, children  # the guest's passt and the forwards'
        pidfds = [os.pidfd_open(int(pid)) for pid in [entry["pid"], *children]]
        try:
            wire.sock.close()  # qemu went away
            for pidfd in pidfds:
                assert select.select([pidfd], [], [], 10)[0], "a switch or passt outlived its VM"
        finally:
            for pidfd in pidfds:
                os.close(pidfd)


def test_a_published_port_that_is_taken_is_one_line_naming_it():
    from launcher.spec.network import Port
    with listener("127.0.0.1") as taken, qemu_scratch("diskkit-net-") as root:
        port = taken.getsockname()[1]
        plan = bindings.plan(Interface("default", 0, "masquerade", ports=(Port(port),)), pod.read(), "127.0.0.1")
        started = backend.start([plan], [root / "0.sock"], (QEMU_UID, pwd.getpwuid(QEMU_UID).pw_gid))
        try:
            with pytest.raises(DiskkitError) as refused:
                started.wait()
        finally:
            backend.stop(started.entries)
    line = str(refused.value)
    assert line.startswith("interface default: its pod network did not start") and f"127.0.0.1/{port}:{port}" in line, line
    assert "\n" not in line

"""The guest on the pod network, end to end as the unprivileged qemu user (UID 107): the test guest's
network mode (udhcpc lease, busybox httpd serving its SMBIOS serial) reached through
`launcher port-forward`, as KubeVirt's bindings and `virtctl port-forward` give it, and its probe mode
(a hostile guest looking for the host's loopback and other VMs' forwards)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import signal
import socket
import subprocess
import threading
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import launcher_command
from tests.leftovers import processes_of
from tests.testguest import parse_console
from tests.vmhost import NOREG, QEMU_UID, assert_clean

HTTPD = "NET-HTTPD port=80"
LEASE = re.compile(r"NET-LEASE iface=eth0 ip=(\S+) mask=(\S+) router=(\S+) dns=(\S+) mac=(\S+)")
PROBE = re.compile(r"PROBE addr=(\S+) port=(\d+) got=(.*)")


def net_vmi(user, name, image, interfaces=None, networks=None, devices=None, hold="hold-300"):
    domain = {"firmware": {"serial": f"vm-{name}"}}
    path = user.write_vmi(name, image, serial=hold, domain=domain)
    doc = json.loads(path.read_text())
    devs = doc["spec"]["domain"]["devices"]
    devs.update(devices or {})
    if interfaces is not None:
        devs["interfaces"] = interfaces
    if networks is not None:
        doc["spec"]["networks"] = networks
    path.write_text(json.dumps(doc))
    return path


def start(user, vmi, wait_for=HTTPD):
    result = user.launcher("run", NOREG, "--wait-for", wait_for, "--timeout", "240", vmi)
    assert result.code == 0, result.err
    return result


def console(user, domain) -> str:
    return (user.cache / "run" / domain / "console" / "console.log").read_text(errors="replace")


@contextlib.contextmanager
def forwarding(user, *args):
    proc = subprocess.Popen(launcher_command("port-forward", *args, user=str(QEMU_UID)),
                            env={**os.environ, "CI": "true", **user.env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for _ in args[1:]:
            line = proc.stdout.readline()
            assert line.startswith("Forwarding from"), (line, proc.stderr.read() if proc.poll() is not None else "")
            lines.append(line)
        yield lines
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    assert proc.returncode == 0, proc.stderr.read()


def fetch(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as reply:
        return reply.read().decode()


def helpers_of(user) -> list[str]:
    """passt or slirp helper processes of this qemu user's VMs (qemu's own user-mode stack is in qemu):
    those whose HOME, cache or command line is the user's, not another test's running beside."""
    names = []
    for pid in processes_of(user.root):
        with contextlib.suppress(OSError):
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
    return [name for name in names if name in ("passt", "passt.avx2", "slirp4netns", "pasta")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_network() -> tuple[ipaddress.IPv4Interface, str]:
    """This host's address on its default route's interface, and that route's gateway (as `ip` tells)."""
    (route,) = json.loads(subprocess.run(["ip", "-j", "route", "show", "default"], capture_output=True, text=True, check=True).stdout)[:1]
    (link,) = json.loads(subprocess.run(["ip", "-j", "-4", "addr", "show", "dev", route["dev"]], capture_output=True, text=True, check=True).stdout)
    info = next(a for a in link["addr_info"] if a["family"] == "inet")
    return ipaddress.IPv4Interface(f"{info['local']}/{info['prefixlen']}"), route["gateway"]


@contextlib.contextmanager
def serving(address: str, text: str):
    """A TCP service that answers every connection with one line, on `address` and a free port."""
    server = socket.socket()
    server.bind((address, 0))
    server.listen(16)
    taken: list[tuple] = []

    def one(conn: socket.socket) -> None:
        # the line, then whatever the client sends until it is done: closing on unread bytes would
        # reset the connection, and a reset can discard the line before the client has read it
        with conn:
            conn.settimeout(10)
            conn.sendall(f"{text}\n".encode())
            with contextlib.suppress(OSError):
                while conn.recv(4096):
                    pass

    def answer() -> None:
        while True:
            try:
                conn, peer = server.accept()
            except OSError:
                return
            taken.append(peer)
            threading.Thread(target=one, args=(conn,), daemon=True).start()

    threading.Thread(target=answer, daemon=True).start()
    try:
        yield server.getsockname()[1], taken
    finally:
        server.close()


def as_other_user(port: int) -> str:
    """What another local user (nobody) reads from 127.0.0.1:port after asking for a page."""
    code = ("import socket; s = socket.create_connection(('127.0.0.1', %d), timeout=20); s.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n')\n"
            "data = b''\ntry:\n    while chunk := s.recv(4096): data += chunk\nexcept OSError: pass\nprint(data.decode(errors='replace'))") % port
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", code],
                          capture_output=True, text=True, timeout=60).stdout


def test_masquerade_lease_and_page_through_port_forward(qemu_user, guest_image):
    vmi = net_vmi(qemu_user, "masq", guest_image, [{"name": "pod", "masquerade": {}, "macAddress": "02:00:00:AA:BB:CC",
                                                    "ports": [{"name": "http", "port": 80}]}],
                  [{"name": "pod", "pod": {}}])
    start(qemu_user, vmi)
    try:
        lease = LEASE.search(console(qemu_user, "default_masq"))
        assert lease, console(qemu_user, "default_masq")
        # KubeVirt's masquerade on vmNetworkCIDR 10.0.2.0/24 (pkg/network/setup/netpod/netpod.go gatewayIP,
        # pkg/network/link/address.go GenerateMasqueradeGatewayAndVmIPAddrs): the guest at .2, the gateway
        # at .1, which is also its DNS server (a forwarder to the host's resolver); the MAC the spec asked for
        assert lease.groups() == ("10.0.2.2", "255.255.255.0", "10.0.2.1", "10.0.2.1", "02:00:00:aa:bb:cc"), lease.group(0)
        local = free_port()
        with forwarding(qemu_user, "vmi/masq", f"{local}:80"):
            assert "DISKKIT-TESTGUEST vm=vm-masq" in fetch(local)
            # the forward is its owner's (and root's): another local user gets nothing from it
            assert as_other_user(local).strip() == ""
            assert "DISKKIT-TESTGUEST vm=vm-masq" in fetch(local)
            taken = qemu_user.launcher("port-forward", "masq", f"{local}:80", timeout=60)  # the port is taken: one line
            assert taken.code == 1 and "cannot forward to guest port 80" in taken.err and len(taken.err.strip().splitlines()) == 1, taken.err
        # the forward is gone with the command
        with pytest.raises(OSError):
            fetch(local)
        # --stdio: one connection over stdin/stdout, as ssh's ProxyCommand uses it
        proc = subprocess.run(launcher_command("port-forward", "--stdio", "masq", "80", user=str(QEMU_UID)),
                              input="GET / HTTP/1.0\r\n\r\n", env={**os.environ, "CI": "true", **qemu_user.env},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "200 OK" in proc.stdout and "vm=vm-masq" in proc.stdout, proc.stdout
    finally:
        assert qemu_user.launcher("stop", "masq").code == 0
    assert_clean(qemu_user, "default_masq")
    assert helpers_of(qemu_user) == []


def test_default_interface_without_interfaces_and_none_when_autoattach_is_false(qemu_user, guest_image):
    # pkg/network/vmispec/defaults.go: no networks, no interfaces -> the default pod interface, bridge
    # (pkg/virt-config/virt-config.go DefaultNetworkInterface), which hands the guest the pod's own
    # address by DHCP (pkg/network/dhcp/bridge.go): here the launcher's network is the pod's, the host's.
    start(qemu_user, net_vmi(qemu_user, "dflt", guest_image), wait_for="NET-LEASE")
    try:
        text = console(qemu_user, "default_dflt")
        lease = LEASE.search(text)
        assert "NET-NIC iface=eth0" in text and lease, text
        address, gateway = host_network()
        assert lease.groups()[:3] == (str(address.ip), str(address.netmask), gateway), lease.group(0)
    finally:
        assert qemu_user.launcher("stop", "dflt").code == 0
    vmi = net_vmi(qemu_user, "nonic", guest_image, devices={"autoattachPodInterface": False}, hold="hold-0")
    result = qemu_user.launcher("run", NOREG, "--console", "--timeout", "240", vmi)
    assert result.code == 0, result.err
    assert parse_console(result.out)["done"] and "NET-NIC none" in result.out, result.out
    # after the guest's own poweroff as after a stop: nothing of the network left
    vmi = net_vmi(qemu_user, "gone", guest_image, hold="hold-0")
    result = qemu_user.launcher("run", NOREG, "--console", "--timeout", "240", vmi)
    assert result.code == 0 and "NET-NIC iface=eth0" in result.out, result.err
    assert_clean(qemu_user, "default_gone")
    assert helpers_of(qemu_user) == []


def probe_vmi(user, name, image, ports: list[int], reach: list[tuple[str, int]]):
    """The test guest in probe mode, on masquerade: PORT tried on every way to the host's loopback."""
    vmi = net_vmi(user, name, image, [{"name": "pod", "masquerade": {}}], [{"name": "pod", "pod": {}}])
    doc = json.loads(vmi.read_text())
    serials = [f"probe-{port}" for port in ports] + [f"reach-{ipaddress.IPv4Address(a).packed.hex()}-{port}" for a, port in reach]
    for i, serial in enumerate(serials):
        doc["spec"]["domain"]["devices"]["disks"].append({"name": f"p{i}", "serial": serial, "disk": {"bus": "virtio"}})
        doc["spec"]["volumes"].append({"name": f"p{i}", "emptyDisk": {"capacity": "1Mi"}})
    vmi.write_text(json.dumps(doc))
    return vmi


def test_two_vms_each_answer_on_their_own_forward_and_a_hostile_guest_reaches_neither_the_hosts_loopback_nor_another_vms(
        qemu_user, guest_image):
    # The second guest is hostile: it tries a service the host binds on 127.0.0.1 only, and the first VM's
    # forward (on 127.0.0.1 too), by its gateway, its DNS server, 10.0.2.2 (where qemu's user-mode stack
    # mapped the host's loopback) and 127.0.0.1 routed out of its NIC by hand. In KubeVirt the guest sits
    # behind its pod's network namespace, and the node's loopback is not in it. The host's own address
    # stays reachable, as a node's is from a pod: the guest's probes of a service there are the control.
    address, _ = host_network()
    ports = {"one": free_port(), "two": free_port()}
    try:
        with serving("127.0.0.1", "SECRET-ON-THE-HOSTS-LOOPBACK") as (secret, secret_peers), \
                serving("0.0.0.0", "ON-THE-NODES-ADDRESS") as (public, _):
            start(qemu_user, net_vmi(qemu_user, "one", guest_image))
            with forwarding(qemu_user, "vmi/one", f"{ports['one']}:80"):
                start(qemu_user, probe_vmi(qemu_user, "two", guest_image, [secret, ports["one"]], [(str(address.ip), public)]), "PROBE-DONE")
                text = console(qemu_user, "default_two")
                probes = {(a, int(p)): got for a, p, got in PROBE.findall(text)}
                assert probes[(str(address.ip), public)] == "ON-THE-NODES-ADDRESS", text
                lease = LEASE.search(text)
                tried = {lease.group(3), lease.group(4), "10.0.2.2", "127.0.0.1"}
                assert {(a, p) for a, p in probes} >= {(a, p) for a in tried for p in (secret, ports["one"])}, text
                reached = {k: got for k, got in probes.items() if k[1] in (secret, ports["one"]) and got != "nothing"}
                assert reached == {} and secret_peers == [], text
                with forwarding(qemu_user, "two", f"{ports['two']}:80"):
                    assert "vm=vm-one " in fetch(ports["one"])
                    assert "vm=vm-two " in fetch(ports["two"])
    finally:
        for name in ("one", "two"):
            qemu_user.launcher("stop", name)
    assert helpers_of(qemu_user) == []


def test_port_forward_refusals(qemu_user):
    for args, words in ((("vmi/", "80"), "name cannot be empty"), (("pod/x", "80"), "unsupported resource type 'pod'"),
                        (("a/b/c/d", "80"), "more than two '/'"), (("x", "sctp/80"), "unsupported protocol sctp"),
                        (("nosuchvm", "80"), "no VM of this name")):
        result = qemu_user.launcher("port-forward", *args)
        assert result.code == (5 if args[0] == "nosuchvm" else 1) and words in result.err and len(result.err.strip().splitlines()) == 1, result.err


def test_root_launcher_forwards_too(qemu_user, guest_image, root_side):
    # A root launcher with qemu as the qemu user: the forward is qemu's socket, added through libvirt.
    cache, uri = root_side
    env = {**os.environ, "CI": "true", "DISKKIT_CACHE": str(cache)}
    vmi = net_vmi(qemu_user, "rooted", guest_image)
    started = subprocess.run(launcher_command("run", NOREG, "--wait-for", HTTPD, "--timeout", "240", "--connect", uri, str(vmi)),
                             env=env, capture_output=True, text=True, timeout=300)
    assert started.returncode == 0, started.stderr
    try:
        proc = subprocess.run(launcher_command("port-forward", "--stdio", "vmi/rooted", "80"), input="GET / HTTP/1.0\r\n\r\n",
                              env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "vm=vm-rooted" in proc.stdout, (proc.stdout, proc.stderr)
    finally:
        stopped = subprocess.run(launcher_command("stop", "rooted"), env=env, capture_output=True, text=True, timeout=120)
        assert stopped.returncode == 0, stopped.stderr
    assert "default_rooted" not in qemu_user.virsh("list", "--all", "--name").split()


def test_declared_ports_are_published_and_only_they(qemu_user, guest_image):
    # KubeVirt's masquerade: traffic to the pod's IP on a declared port reaches the guest. Here the
    # address is the caller's (--publish-address; 0.0.0.0 in a pod), loopback in the test. The guest
    # serves its page on both ports (disk serials http-N); only the declared one is published.
    declared, undeclared = free_port(), free_port()
    vmi = net_vmi(qemu_user, "pub", guest_image, [{"name": "pod", "masquerade": {}, "ports": [{"name": "web", "port": declared}]}],
                  [{"name": "pod", "pod": {}}])
    doc = json.loads(vmi.read_text())
    for i, port in enumerate((declared, undeclared)):
        doc["spec"]["domain"]["devices"]["disks"].append({"name": f"p{i}", "serial": f"http-{port}", "disk": {"bus": "virtio"}})
        doc["spec"]["volumes"].append({"name": f"p{i}", "emptyDisk": {"capacity": "1Mi"}})
    vmi.write_text(json.dumps(doc))
    result = qemu_user.launcher("run", NOREG, "--publish-address", "127.0.0.1", "--wait-for", f"NET-HTTPD port={undeclared}",
                                "--timeout", "240", vmi)
    assert result.code == 0, result.err
    try:
        assert f"127.0.0.1:{declared}/TCP -> pod port {declared}" in result.err, result.err
        assert "vm=vm-pub " in fetch(declared)
        with pytest.raises(OSError):
            fetch(undeclared)
    finally:
        assert qemu_user.launcher("stop", "pub").code == 0

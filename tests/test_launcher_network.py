"""The guest on the pod network, end to end as the unprivileged qemu user (UID 107): the test guest's
network mode (udhcpc lease, busybox httpd serving its SMBIOS serial) reached through
`launcher port-forward`, as KubeVirt's masquerade binding and `virtctl port-forward` give it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import urllib.request

import pytest

from tests.conftest import launcher_command
from tests.testguest import parse_console
from tests.vmhost import NOREG, QEMU_UID, assert_clean

HTTPD = "NET-HTTPD port=80"
LEASE = re.compile(r"NET-LEASE iface=eth0 ip=(\S+) mask=(\S+) router=(\S+) dns=(\S+) mac=(\S+)")


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
    """passt or slirp helper processes of the qemu user (qemu's own user-mode stack is in qemu)."""
    out = subprocess.run(["ps", "-u", str(QEMU_UID), "-o", "comm="], capture_output=True, text=True).stdout.split()
    return [c for c in out if c in ("passt", "passt.avx2", "slirp4netns", "pasta")]


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_masquerade_lease_and_page_through_port_forward(qemu_user, guest_image):
    vmi = net_vmi(qemu_user, "masq", guest_image, [{"name": "pod", "masquerade": {}, "macAddress": "02:00:00:AA:BB:CC",
                                                    "ports": [{"name": "http", "port": 80}]}],
                  [{"name": "pod", "pod": {}}])
    start(qemu_user, vmi)
    try:
        lease = LEASE.search(console(qemu_user, "default_masq"))
        assert lease, console(qemu_user, "default_masq")
        # qemu's user-mode stack on KubeVirt's masquerade subnet 10.0.2.0/24: the guest at .15, the
        # gateway at .2, a DNS proxy to the host's resolv.conf at .3; the MAC the spec asked for
        assert lease.groups() == ("10.0.2.15", "255.255.255.0", "10.0.2.2", "10.0.2.3", "02:00:00:aa:bb:cc"), lease.group(0)
        local = free_port()
        with forwarding(qemu_user, "vmi/masq", f"{local}:80"):
            assert "DISKKIT-TESTGUEST vm=vm-masq" in fetch(local)
            taken = qemu_user.launcher("port-forward", "masq", f"{local}:80", timeout=60)  # qemu's own refusal, one line
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
    # pkg/network/vmispec/defaults.go: no networks, no interfaces -> the default pod interface
    start(qemu_user, net_vmi(qemu_user, "dflt", guest_image), wait_for="NET-LEASE")
    try:
        text = console(qemu_user, "default_dflt")
        assert "NET-NIC iface=eth0" in text and LEASE.search(text), text
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


def test_two_vms_each_answer_on_their_own_forward(qemu_user, guest_image):
    names = ("one", "two")
    try:
        for name in names:
            start(qemu_user, net_vmi(qemu_user, name, guest_image))
        ports = {name: free_port() for name in names}
        with forwarding(qemu_user, "vmi/one", f"{ports['one']}:80"), forwarding(qemu_user, "two", f"{ports['two']}:80"):
            assert "vm=vm-one " in fetch(ports["one"])
            assert "vm=vm-two " in fetch(ports["two"])
    finally:
        for name in names:
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

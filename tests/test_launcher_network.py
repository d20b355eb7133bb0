"""The guest on the pod network, end to end as the unprivileged qemu user (UID 107): the test guest's
network mode (udhcpc lease, busybox httpd serving its SMBIOS serial) reached through
`launcher port-forward`, as KubeVirt's masquerade binding and `virtctl port-forward` give it."""

from __future__ import annotations

import contextlib
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
    doc = __import__("json").loads(path.read_text())
    devs = doc["spec"]["domain"]["devices"]
    devs.update(devices or {})
    if interfaces is not None:
        devs["interfaces"] = interfaces
    if networks is not None:
        doc["spec"]["networks"] = networks
    path.write_text(__import__("json").dumps(doc))
    return path


def start(user, vmi, wait_for=HTTPD):
    result = user.launcher("run", NOREG, "--wait-for", wait_for, "--timeout", "240", vmi)
    assert result.code == 0, result.err
    return result


def console(user, domain) -> str:
    return (user.cache / "run" / domain / "console.log").read_text(errors="replace")


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
    vmi = net_vmi(qemu_user, "masq", guest_image, [{"name": "pod", "masquerade": {}, "ports": [{"name": "http", "port": 80}]}],
                  [{"name": "pod", "pod": {}}])
    start(qemu_user, vmi)
    try:
        lease = LEASE.search(console(qemu_user, "default_masq"))
        assert lease, console(qemu_user, "default_masq")
        ip, mask, router, dns, _mac = lease.groups()
        # qemu's user-mode stack on KubeVirt's masquerade subnet 10.0.2.0/24
        assert ip.startswith("10.0.2.") and mask == "255.255.255.0" and router.startswith("10.0.2."), lease.group(0)
        local = free_port()
        with forwarding(qemu_user, "vmi/masq", f"{local}:80"):
            assert "DISKKIT-TESTGUEST vm=vm-masq" in fetch(local)
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
        assert result.code == 1 and words in result.err and len(result.err.strip().splitlines()) == 1, result.err

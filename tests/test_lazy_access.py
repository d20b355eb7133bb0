"""Who can reach a root disk server's NBD socket: qemu as libvirt's system daemon runs it (the user
and group of /etc/libvirt/qemu.conf, else libvirt's built-in ones), and each unprivileged user's
session qemu on a socket of its own; checked with qemu-img run under exactly those identities.
Its control socket is open to the group of KubeVirt's qemu user (the launchers' group) or the one
--socket-group names, never to whatever group 107 is on the host."""

from __future__ import annotations

import grp
import json
import os
import pwd
import stat
import subprocess
import sys

import pytest

from launcher.diskserver.qemuid import QEMU_CONF, configured_group, system_qemu_gid
from tests.conftest import run_diskkit
from tests.lazyhost import QEMU_UID, disk_server, random_disk
from tests.vmhost import qemu_scratch

NOREG = "--tls-verify=false"
MIB = 1 << 20


@pytest.fixture(scope="module")
def scratch():
    with qemu_scratch("access-") as root:
        yield root


@pytest.fixture(scope="module")
def lazy_image(registry, scratch) -> str:
    ref = f"{registry.host}/access/guest:toc"
    assert run_diskkit("build", NOREG, "--lazy", random_disk(scratch / "guest.img", 4 * MIB), "-t", ref).code == 0
    return ref


def system_qemu() -> pwd.struct_passwd:
    """libvirt's system qemu user here (Debian's build default, unless qemu.conf says otherwise)."""
    text = QEMU_CONF.read_text()
    assert configured_group(text) is None, "this test expects the distribution's qemu.conf"
    return pwd.getpwnam("libvirt-qemu")


def as_user(uid: int, gid: int, *cmd, init_groups: bool = False) -> subprocess.CompletedProcess:
    groups = ["--init-groups"] if init_groups else ["--clear-groups"]
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", *groups, *map(str, cmd)], capture_output=True, text=True)


def open_as(uid: int, gid: int, cache, ref: str) -> dict:
    """The open request a launcher run by `uid` sends (the server tells callers apart by SO_PEERCRED)."""
    code = ("import json, sys; from launcher.diskserver.control import request; "
            "print(json.dumps(request(__import__('pathlib').Path(sys.argv[1]), json.loads(sys.argv[2]))))")
    req = {"op": "open", "image": ref, "registry": {"tls_verify": False}, "clients": 0}
    proc = as_user(uid, gid, sys.executable, "-c", code, cache / "serve" / "control.sock", json.dumps(req))
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["ok"], answer
    return answer


def test_system_qemu_and_session_users_each_reach_their_socket(scratch, lazy_image):
    qemu = system_qemu()
    libvirt_group = grp.getgrnam("libvirt-qemu").gr_gid
    assert system_qemu_gid() == libvirt_group
    cache = scratch / "cache"
    cache.mkdir()
    with disk_server(cache):
        # As root (qemu:///system): nbd.sock, in libvirt's qemu group, which qemu-img as that user reaches.
        system = open_as(0, 0, cache, lazy_image)
        control = os.stat(cache / "serve" / "control.sock")
        assert (control.st_gid, stat.S_IMODE(control.st_mode)) == (pwd.getpwnam("qemu").pw_gid, 0o660)
        sock = os.stat(system["socket"])
        assert system["socket"] == str(cache / "serve" / "nbd.sock")
        assert (sock.st_gid, stat.S_IMODE(sock.st_mode)) == (libvirt_group, 0o660)
        probe = as_user(qemu.pw_uid, libvirt_group, "qemu-img", "info", "--output=json", system["url"], init_groups=True)
        assert probe.returncode == 0 and json.loads(probe.stdout)["virtual-size"] == 4 * MIB, probe.stderr
        # KubeVirt's qemu (107:107) is not in that group: the system socket is closed to it ...
        refused = as_user(QEMU_UID, QEMU_UID, "qemu-img", "info", system["url"])
        assert refused.returncode != 0 and "Permission denied" in refused.stderr, refused.stderr

        # ... and its own launcher gets a socket of its own, which only it reaches.
        # Its launcher runs in the qemu user's own group, the control socket's.
        session = open_as(QEMU_UID, pwd.getpwuid(QEMU_UID).pw_gid, cache, lazy_image)
        assert session["socket"] == str(cache / "serve" / f"nbd-{QEMU_UID}.sock")
        sock = os.stat(session["socket"])
        assert (sock.st_uid, stat.S_IMODE(sock.st_mode)) == (QEMU_UID, 0o600)
        probe = as_user(QEMU_UID, QEMU_UID, "qemu-img", "info", "--output=json", session["url"])
        assert probe.returncode == 0 and json.loads(probe.stdout)["virtual-size"] == 4 * MIB, probe.stderr
        other = as_user(qemu.pw_uid, libvirt_group, "qemu-img", "info", session["url"], init_groups=True)
        assert other.returncode != 0 and "Permission denied" in other.stderr, other.stderr


def test_qemu_conf_group_setting():
    text = '#group = "libvirt-qemu"\nuser = "qemu"\ngroup = "kvm"  # as on some hosts\n  group="+107"\n'
    assert configured_group(text) == "+107"  # the last setting wins; comments are not settings
    assert configured_group('#group = "x"\n') is None

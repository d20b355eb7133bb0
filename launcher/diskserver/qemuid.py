"""Who qemu runs as under libvirt's system daemon (`qemu:///system`): the group a root disk server
gives its NBD socket to, and the owner a root launcher gives a VM's run directory to, so that
qemu, never root there, can reach them. Also the group of KubeVirt's qemu user, whose launchers
a root disk server takes requests from (its control socket's group).

libvirt reads `user` and `group` from /etc/libvirt/qemu.conf ("NAME", "+ID", or a number naming
no one), and without them uses the ones it was built with: `libvirt-qemu` on Debian and Ubuntu,
`qemu` on Fedora and RHEL, `root` upstream (src/qemu/qemu_conf.c, virQEMUDriverConfigNew and
virQEMUDriverConfigLoadSecurityEntry; the group is never taken from the user's entry). The file
is parsed here (pure) and read at the edge.
"""

from __future__ import annotations

import grp
import pwd
import re
from pathlib import Path
from urllib.parse import urlsplit

from diskkit.errors import DiskkitError

QEMU_CONF = Path("/etc/libvirt/qemu.conf")
BUILT_IN_NAMES = ("libvirt-qemu", "qemu")  # libvirt's build defaults by distribution (user and group alike), then root


def _setting(key: str) -> re.Pattern:
    return re.compile(rf'^\s*{key}\s*=\s*"([^"]*)"\s*(#.*)?$')


def configured(text: str, key: str) -> str | None:
    """The `key = "..."` qemu.conf sets (the last one wins, as in libvirt's parser); None: unset."""
    found, setting = None, _setting(key)
    for line in text.splitlines():
        match = setting.match(line)
        if match:
            found = match.group(1)
    return found


def configured_group(text: str) -> str | None:
    return configured(text, "group")


def resolve(name: str, where: str, lookup=grp.getgrnam, kind: str = "group") -> int:
    """libvirt's virGetGroupID / virGetUserID: "+N" is N, a name is looked up, a number naming no one is N."""
    if name.startswith("+") and name[1:].isdigit():
        return int(name[1:])
    try:
        entry = lookup(name)
    except KeyError:
        if name.isdigit():
            return int(name)
        raise DiskkitError(where, f"{kind} {name!r} does not exist") from None
    return entry.gr_gid if kind == "group" else entry.pw_uid


def _read(conf: Path) -> str:
    try:
        return conf.read_text()
    except FileNotFoundError:
        return ""
    except OSError as exc:
        raise DiskkitError(conf, f"cannot be read ({exc.strerror})") from None


def _system_id(text: str, conf: Path, kind: str) -> int:
    lookup = grp.getgrnam if kind == "group" else pwd.getpwnam
    name = configured(text, kind)
    if name is not None:
        return resolve(name, f"{conf}: {kind}", lookup, kind)
    for name in BUILT_IN_NAMES:
        try:
            return resolve(name, str(conf), lookup, kind)
        except DiskkitError:
            continue
    return 0


def system_qemu_gid(conf: Path = QEMU_CONF) -> int:
    return _system_id(_read(conf), conf, "group")


def system_qemu_ids(conf: Path = QEMU_CONF) -> tuple[int, int]:
    """(uid, gid) of the qemu processes the system daemon starts."""
    text = _read(conf)
    return _system_id(text, conf, "user"), _system_id(text, conf, "group")


def is_system_uri(uri: str) -> bool:
    """A local URI of libvirt's system daemon (qemu:///system, qemu+unix:///system?socket=...)."""
    parts = urlsplit(uri)
    return parts.scheme.split("+")[0] == "qemu" and not parts.netloc and parts.path.rstrip("/") == "/system"


KUBEVIRT_QEMU_ID = 107  # virt-launcher's qemu user (KubeVirt's pkg/util/util.go: NonRootUID, NonRootUserString "qemu")
KUBEVIRT_GROUP_NAMES = ("qemu", "kvm")  # what 107 is named where it is KubeVirt's group


def launcher_group(name: str | None, user=pwd.getpwnam, group=grp.getgrnam, gid_entry=grp.getgrgid) -> int | None:
    """The group a root disk server's control socket is opened to. `name` (`--socket-group`), which
    must name a group here; else the group of user `qemu` (KubeVirt's qemu user, as whom launchers
    run VMs on their session daemon), else 107 where that is a group named qemu or kvm; None when
    there is none of these: the socket stays root's. Never a bare 107, whatever group that is."""
    if name is not None:
        try:
            return gid_entry(int(name)).gr_gid if name.isdigit() else group(name).gr_gid
        except (KeyError, OverflowError):
            raise DiskkitError(f"--socket-group {name}", "names no group on this host") from None
    try:
        return user("qemu").pw_gid
    except KeyError:
        pass
    try:
        entry = gid_entry(KUBEVIRT_QEMU_ID)
    except KeyError:
        return None
    return entry.gr_gid if entry.gr_name in KUBEVIRT_GROUP_NAMES else None

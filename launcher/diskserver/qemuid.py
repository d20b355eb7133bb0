"""Who qemu runs as under libvirt's system daemon (`qemu:///system`): the group a root disk server
gives its NBD socket to, and the owner a root launcher gives a VM's run directory to, so that
qemu, never root there, can reach them.

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

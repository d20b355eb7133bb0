"""The group qemu runs as under libvirt's system daemon (`qemu:///system`): the one a root disk
server gives its NBD socket to, so that qemu, never root there, can connect.

libvirt reads `group` from /etc/libvirt/qemu.conf ("NAME" or "+GID"), and without one uses the
group it was built with: `libvirt-qemu` on Debian and Ubuntu, `qemu` on Fedora and RHEL, `root`
upstream. The file is parsed here (pure) and read at the edge.
"""

from __future__ import annotations

import grp
import re
from pathlib import Path

from diskkit.errors import DiskkitError

QEMU_CONF = Path("/etc/libvirt/qemu.conf")
BUILT_IN_GROUPS = ("libvirt-qemu", "qemu")  # libvirt's build defaults by distribution, then root
_SETTING = re.compile(r'^\s*group\s*=\s*"([^"]*)"\s*(#.*)?$')


def configured_group(text: str) -> str | None:
    """The `group = "..."` qemu.conf sets (the last one wins, as in libvirt's parser); None: unset."""
    found = None
    for line in text.splitlines():
        match = _SETTING.match(line)
        if match:
            found = match.group(1)
    return found


def resolve(name: str, where: str) -> int:
    if name.startswith("+") and name[1:].isdigit():
        return int(name[1:])
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        if name.isdigit():
            return int(name)  # libvirt's rule: a number that names no group is a GID
        raise DiskkitError(where, f"group {name!r} does not exist") from None


def system_qemu_gid(conf: Path = QEMU_CONF) -> int:
    try:
        text = conf.read_text()
    except FileNotFoundError:
        text = ""
    except OSError as exc:
        raise DiskkitError(conf, f"cannot be read ({exc.strerror})") from None
    name = configured_group(text)
    if name is not None:
        return resolve(name, f"{conf}: group")
    for name in BUILT_IN_GROUPS:
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            continue
    return 0

"""A Multus bridge network on the node, made as the bridge CNI plugin makes it (root alone).

In a cluster Multus runs the bridge plugin (containernetworking/plugins plugins/main/bridge/bridge.go)
when the VM's pod starts: it makes the Linux bridge the NAD's config names if the node has none
(ensureBridge: `"%q already exists but is not a bridge"` when the name is taken by another kind of
device), gives it the config's MTU, turns off its IPv6 router advertisements, and puts a veth on it
whose other end is the pod's interface; KubeVirt's bridge binding then puts a tap owned by the qemu
user behind that interface (pkg/network/setup/netpod/netpod.go bridgeBindingSpec). With no pod, the
launcher puts the tap on the node's bridge itself: one per NIC, owned by the VM's own uid and gid
(launcher.runtime.vmuser: only that VM's qemu may open it), with the pod interface's MTU, and the
plugin's hairpin and isolation flags on its bridge port. The plugin's `macspoofchk` (pkg/link/spoofcheck.go:
nftables rules in the bridge family's nat PREROUTING that drop what comes in on the pod's veth from
another MAC) is the same rule through ebtables (Debian's ebtables is nftables' own front end), on the tap.

Every device name `ip` or `ebtables` is given passes `_tool`, which checks it (launcher.spec.multus.bridge_name_problem:
IFNAMSIZ, no path or option syntax); a tap's name is made from the VM's uid (`tap_name`), so what a VM
left is found by its uid alone: its taps go with it (`remove_taps`, from launcher.runtime.vmuser when
the uid is given back, or taken again after a crash). A bridge stays, as the plugin's DEL leaves it:
other VMs, and whatever the admin put on it, may use it.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
from pathlib import Path

from diskkit.errors import DiskkitError
from launcher.spec.multus import NAD_KIND, bridge_name_problem
from launcher.spec.network import Interface
from launcher.spec.vmi import VMI

TUN = Path("/dev/net/tun")
PROC_CONF4 = Path("/proc/sys/net/ipv4/conf")
PROC_CONF6 = Path("/proc/sys/net/ipv6/conf")
TAP_PREFIX = "dk"


def bridge_nics(vmi: VMI) -> list[Interface]:
    return [iface for iface in vmi.domain.devices.interfaces if iface.network is not None]


def tap_name(uid: int, position: int) -> str:
    """The tap of the VM of host uid `uid`'s `position`th bridge NIC: unique on the node while the VM
    has the uid (at most 14 bytes: a uid below 2**28, fewer than 1000 NICs)."""
    return f"{TAP_PREFIX}{uid:x}n{position}"


def random_mac() -> str:
    """What the kernel gives a new veth (eth_random_addr): random, unicast, locally administered."""
    octets = bytearray(secrets.token_bytes(6))
    octets[0] = (octets[0] & 0xFE) | 0x02
    return ":".join(f"{b:02x}" for b in octets)


def check(vmi: VMI, own_uid: bool, session: bool) -> None:
    """Refuse before anything is pulled: a bridge network needs a root launcher whose VM has a uid of its
    own, and, on the VM's own session daemon (`session`), a /dev/net/tun that uid may open: libvirt opens
    the tap as the VM's uid there (the system daemon opens it as root and hands qemu the file)."""
    nics = bridge_nics(vmi)
    if not nics:
        return
    network = nics[0].network
    what = f"{NAD_KIND} {network.nad} is a bridge CNI network"
    if os.geteuid() != 0:
        raise DiskkitError(f"{network.at}.multus", f"{what}: its bridge and taps are made by a root launcher alone (run it as root)")
    if shutil.which("ip") is None:
        raise DiskkitError(f"{network.at}.multus", f"{what}: its bridge and taps are made with iproute2's ip, which is not installed")
    if not own_uid:
        raise DiskkitError(f"{network.at}.multus", f"{what}: its taps belong to a VM's own uid, which a root launcher gives a VM on"
                                                   " its own session daemon or the system daemon, not on the daemon --connect names")
    spoofchecked = next((iface.network for iface in nics if iface.network.spoofcheck), None)
    if spoofchecked is not None and shutil.which("ebtables") is None:
        raise DiskkitError(f"{NAD_KIND} {spoofchecked.nad} spec.config macspoofchk",
                           "the check's rule is made with ebtables (Debian package ebtables), which is not installed")
    if session:
        try:
            mode = TUN.stat().st_mode & 0o777
        except OSError as exc:
            raise DiskkitError(TUN, f"{exc.strerror}: {what}, whose taps the VM's qemu opens through it") from None
        if mode & 0o006 != 0o006:
            # udev's default is 0666: opening it grants nothing but the taps one owns (the kernel's tun_not_capable)
            raise DiskkitError(TUN, f"mode {mode:04o}: the VM's qemu, a uid of its own, cannot open its tap on {network.nad}"
                                    " (KubeVirt's pod gets /dev/net/tun from its device plugin; udev's default is 0666: chmod 0666 /dev/net/tun)")


def plan(vmi: VMI, uid: int) -> tuple[tuple[str, str, str], ...]:
    """(interface, tap, MAC) of each bridge NIC: the MAC the spec or the NAD gives, else a new one, as
    the pod interface's (the guest's under KubeVirt's bridge binding) is the kernel's random one."""
    return tuple((iface.name, tap_name(uid, i), iface.mac or iface.network.mac or random_mac()) for i, iface in enumerate(bridge_nics(vmi)))


def _tool(tool: str, command: str, *names: str) -> str:
    """`tool` with `command`'s {0}, {1}... the device `names`, each checked first: root makes, changes and
    looks up no device whose name it did not check. Its output."""
    for name in names:
        problem = bridge_name_problem(name)
        if problem:
            raise DiskkitError(f"network device {name!r}", f"{problem}: not made")
    argv = [tool, *(word.format(*names) for word in command.split())]
    done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        said = " ".join((done.stderr or done.stdout).split())[:300] or f"exit status {done.returncode}"
        raise DiskkitError(f"{tool} {' '.join(argv[1:])}", said)
    return done.stdout


def _ip(command: str, *names: str) -> str:
    return _tool("ip", command, *names)


_MAC = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")
SPOOFCHECK = "-t nat {} PREROUTING -i {{0}} -s ! {} -j DROP"


def _prerouting() -> list[tuple[int, str]]:
    """(rule number, the tap it drops frames of) of every spoof-check rule in the bridge nat table's
    PREROUTING chain, as `ebtables -L` lists them ("-s ! MAC -i TAP -j DROP")."""
    if shutil.which("ebtables") is None:
        return []
    listed = _tool("ebtables", "-t nat -L PREROUTING").splitlines()
    header = next((i for i, line in enumerate(listed) if line.startswith("Bridge chain:")), len(listed))
    rules = [line.split() for line in listed[header + 1:] if line.strip()]
    return [(number, words[words.index("-i") + 1]) for number, words in enumerate(rules, 1)
            if words[:2] == ["-s", "!"] and words[-2:] == ["-j", "DROP"] and "-i" in words[:-1]]


def _add_spoofcheck(tap: str, mac: str) -> None:
    if not _MAC.fullmatch(mac):
        raise DiskkitError(f"interface MAC {mac!r}", "not a MAC address as the launcher writes them: no spoof check made")
    _tool("ebtables", SPOOFCHECK.format("-A", mac), tap)


def _drop_spoofchecks(taps) -> None:
    """Every spoof-check rule on these taps (a device gone meanwhile leaves its rule: it is matched by
    name), by its number, the listing read again after each."""
    while True:
        found = next((number for number, tap in _prerouting() if tap in taps), None)
        if found is None:
            return
        _tool("ebtables", f"-t nat -D PREROUTING {found}")


def _links(command: str = "-d -j link show", *names: str) -> dict[str, dict]:
    """name -> linkinfo of the devices of the launcher's network namespace (`ip`'s, not sysfs', which
    shows the namespace of whoever mounted it)."""
    try:
        listed = json.loads(_ip(command, *names) or "[]")
    except ValueError:
        listed = []
    return {link["ifname"]: link.get("linkinfo") or {} for link in listed if isinstance(link, dict) and isinstance(link.get("ifname"), str)}


def _link(name: str) -> dict | None:
    """The device's linkinfo, None when there is none of the name."""
    try:
        return _links("-d -j link show dev {0}", name).get(name)
    except DiskkitError as exc:
        if "does not exist" in str(exc):
            return None
        raise


def _is_bridge(name: str) -> bool:
    link = _link(name)
    return link is not None and link.get("info_kind") == "bridge"


def _flag(path: Path) -> bool:
    try:
        return path.read_text().strip() not in ("", "0")
    except OSError:
        return False


def _check_bridge(network, name: str) -> None:
    """The guest reaches what is on the bridge, never the node's loopback: with route_localnet on the
    kernel routes a frame to 127.0.0.0/8 that comes in on it to the node's own services."""
    if _flag(PROC_CONF4 / "all" / "route_localnet") or _flag(PROC_CONF4 / name / "route_localnet"):
        raise DiskkitError(f"{NAD_KIND} {network.nad} spec.config bridge",
                           f"{name}: net.ipv4.conf route_localnet is on, so a guest on the bridge would reach this node's loopback: not used")


def ensure_bridge(network) -> bool:
    """bridge.go ensureBridge: the bridge the config names, made if missing (True), up."""
    name = network.bridge
    problem = bridge_name_problem(name)  # checked when the NAD was read; /proc/sys is read by it here
    if problem:
        raise DiskkitError(f"{NAD_KIND} {network.nad} spec.config bridge", f"{name!r} {problem}")
    link = _link(name)
    if link is not None and link.get("info_kind") != "bridge":
        raise DiskkitError(f"{NAD_KIND} {network.nad} spec.config bridge", f'"{name}" already exists but is not a bridge')
    made = False
    if link is None:
        try:
            _ip("link add name {0} " + (f"mtu {network.mtu} " if network.mtu_set else "") + "type bridge", name)
            made = True
        except DiskkitError:
            if not _is_bridge(name):  # another VM's launcher made it meanwhile: the plugin's EEXIST
                raise
        if made:
            # bridge.go: "we want to own the routes for this interface"
            accept_ra = PROC_CONF6 / name / "accept_ra"
            if accept_ra.exists():
                accept_ra.write_text("0")
    _check_bridge(network, name)
    if network.promisc:
        _ip("link set dev {0} promisc on", name)
    _ip("link set dev {0} up", name)
    return made


def make(vmi: VMI, taps: tuple[tuple[str, str, str], ...], uid: int, queues: int = 0) -> list[str]:
    """Each bridge NIC's bridge and tap (the VM's uid's and gid's, on the bridge, up); the taps made.
    A tap of the name already there is what a VM of this uid left: replaced. `queues`: the domain's
    (launcher.render.domain.network_queues); libvirt opens a virtio NIC's tap once per queue, which the
    kernel allows a multiqueue tap alone, as KubeVirt makes it (netpod.go networkQueues)."""
    made: list[str] = []
    by_name = {iface.name: iface for iface in bridge_nics(vmi)}
    try:
        for interface, tap, mac in taps:
            network = by_name[interface].network
            ensure_bridge(network)
            _drop_spoofchecks({tap})  # a killed run's
            if _link(tap) is not None:
                _remove_if_ours(tap, uid)
            multi = " multi_queue" if queues > 1 and by_name[interface].model == "virtio" else ""
            _ip(f"tuntap add dev {{0}} mode tap user {uid} group {uid}{multi}", tap)
            made.append(tap)
            if network.spoofcheck:  # before the tap joins the bridge: no frame of another MAC ever enters it
                _add_spoofcheck(tap, mac)
            _ip(f"link set dev {{0}} mtu {network.mtu} master {{1}}", tap, network.bridge)
            flags = [f"hairpin {'on' if network.hairpin else 'off'}", f"isolated {'on' if network.isolated else 'off'}"]
            _ip("link set dev {0} type bridge_slave " + " ".join(flags), tap)
            _ip("link set dev {0} up", tap)
    except BaseException:
        _drop_spoofchecks(set(made))
        for tap in made:
            _remove_if_ours(tap, uid)
        raise
    return made


def _owner(link: dict | None) -> int | None:
    """A tap's owner uid, None for a device that is no tap or has no owner."""
    if link is None or link.get("info_kind") != "tun":
        return None
    user = (link.get("info_data") or {}).get("user")
    return user if isinstance(user, int) and not isinstance(user, bool) else None


def _remove_if_ours(name: str, uid: int) -> None:
    if _owner(_link(name)) != uid:
        raise DiskkitError(f"network device {name}", f"exists and is not a tap of uid {uid}: left alone")
    _ip("link del dev {0}", name)


def remove_taps(uid: int) -> list[str]:
    """Every tap of this VM uid's names that the uid owns, and their spoof-check rules: the taps its VM
    had (ended, or killed)."""
    prefix = f"{TAP_PREFIX}{uid:x}n"
    removed: list[str] = []
    if shutil.which("ip") is None:
        return removed  # nor could any have been made
    _drop_spoofchecks({tap for _, tap in _prerouting() if tap.startswith(prefix) and tap[len(prefix):].isdigit()})
    for name, link in _links().items():
        if name.startswith(prefix) and name[len(prefix):].isdigit() and _owner(link) == uid:
            try:
                _ip("link del dev {0}", name)
            except DiskkitError:
                if _link(name) is not None:
                    raise
                continue  # gone meanwhile
            removed.append(name)
    return removed

"""What an onDefineDomain hook may hand back (pure): any change to what the guest sees, nothing of the
host the launcher did not give the VM.

KubeVirt defines whatever XML the hook returns, once Go's encoding/xml has read it
(pkg/virt-launcher/virtwrap/util/libvirt_helper.go ApplySidecarHooks); the pod is what bounds it. Here
the domain is defined by the VM's own libvirt daemon, or by the system daemon as root, which labels
every file a domain names for the VM's uid: a hook that added `<source file='/etc/shadow'/>` would have
the host's password file given to the guest. So the hook's domain is compared with the one rendered:
- the same domain: root element, type, name and uuid (the launcher finds its VM by them);
- the elements and attributes of other namespaces as rendered (qemu:commandline and qemu:override pass
  anything to qemu: the launcher's own pod switch netdev is one);
- no DOCTYPE (entities expand out of any bound);
- each device that reaches the host (its type, source, backing store, backend, listen address and disk
  format) is one the rendered domain has, and no more of them (dropping one is fine);
- the emulator, firmware, kernel, security labels, memory backing and crash dumps unchanged;
- no absolute path that the rendered domain does not hold, wherever it is;
- memory and vCPUs no more than the spec asked for (the pod's resources).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from collections import Counter

# Devices whose signature (below) must be one the rendered domain has.
DEVICES = ("disk", "filesystem", "interface", "serial", "console", "channel", "parallel", "graphics", "video", "hostdev",
           "redirdev", "smartcard", "tpm", "rng", "shmem", "memballoon", "vsock", "audio", "sound", "input", "watchdog",
           "panic", "iommu", "crypto", "pstore")
# Which buses the guest has is the guest's business: a hook may add a controller.
GUEST_ONLY = ("emulator", "controller")
# The parts of a device that name what it uses on the host.
HOST_PARTS = ("source", "backingStore", "backend", "listen", "auth", "secret", "encryption", "reservations")
# Elements that must be exactly as rendered, wherever they are (absent stays absent).
FIXED = ("devices/emulator", "os/loader", "os/nvram", "os/kernel", "os/initrd", "os/dtb", "memoryBacking", "resource",
         "seclabel", "keywrap", "launchSecurity", "on_crash", "on_poweroff", "on_reboot", "idmap", "throttlegroups")
_PATH = re.compile(r"(?:^|[\s,=:])(/[^\s,]*)")


class HookRefused(ValueError):
    """The hook's domain oversteps: the message says how, in one line."""


def _canon(element: ET.Element) -> tuple:
    return (element.tag, tuple(sorted(element.attrib.items())), (element.text or "").strip(),
            tuple(_canon(child) for child in element))


def _signature(device: ET.Element) -> tuple:
    parts = [_canon(part) for part in device if part.tag in HOST_PARTS]
    if device.tag == "disk":
        driver = device.find("driver")  # the format qemu reads the source as
        parts.append(("format", driver.get("type") if driver is not None else None))
    if device.tag == "graphics":  # where it listens is in its own attributes
        return (device.tag, device.get("type"), tuple(sorted(device.attrib.items())), tuple(parts))
    return (device.tag, device.get("type"), device.get("model") if device.tag == "tpm" else None, tuple(parts))


def _devices(root: ET.Element) -> Counter:
    found = Counter()
    devices = root.find("devices")
    for device in devices if devices is not None else ():
        if device.tag in DEVICES:
            found[_signature(device)] += 1
        elif device.tag not in GUEST_ONLY:
            found[("other", device.tag)] += 1  # a device kind the launcher never renders: never new
    return found


def _foreign(root: ET.Element) -> Counter:
    """Every outermost element of another namespace, and every attribute of one, whole."""
    found = Counter()

    def walk(element: ET.Element) -> None:
        if element.tag.startswith("{"):
            found[_canon(element)] += 1
            return
        found.update(("attribute", element.tag, key, value) for key, value in element.attrib.items() if key.startswith("{"))
        for child in element:
            walk(child)

    walk(root)
    return found


def _paths(root: ET.Element) -> set[str]:
    found = set()
    for element in root.iter():
        for value in (*element.attrib.values(), element.text or ""):
            found.update(m.group(1) for m in _PATH.finditer(value))
    return found


def _bytes(root: ET.Element, tag: str) -> int | None:
    element = root.find(tag)
    if element is None or not (element.text or "").strip().isdigit():
        return None
    units = {"b": 1, "bytes": 1, "KiB": 1 << 10, "k": 1 << 10, "MiB": 1 << 20, "M": 1 << 20, "GiB": 1 << 30, "G": 1 << 30,
             "TiB": 1 << 40, "T": 1 << 40, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
    unit = element.get("unit", "KiB")
    if unit not in units:
        raise HookRefused(f"<{tag}> has a unit libvirt may read otherwise than the launcher ({unit})")
    return int(element.text.strip()) * units[unit]


def _count(root: ET.Element, tag: str) -> int | None:
    element = root.find(tag)
    if element is None:
        return None
    text = (element.text or "").strip()
    if not text.isdigit():
        raise HookRefused(f"<{tag}> must be a number")
    return int(text)


def check(rendered: str, hooked: str) -> None:
    """Refuse (HookRefused) a hook's domain that reaches beyond the rendered one's host resources."""
    if re.search(r"<!\s*(DOCTYPE|ENTITY)", hooked, re.IGNORECASE):
        raise HookRefused("holds a DOCTYPE or an entity declaration")
    try:
        root = ET.fromstring(hooked)
    except ET.ParseError as exc:
        raise HookRefused(f"not well-formed XML: {exc}") from None
    mine = ET.fromstring(rendered)
    if root.tag != "domain":
        raise HookRefused(f"its root element is <{root.tag}>, not <domain>")
    if _foreign(root) != _foreign(mine):
        raise HookRefused("adds or changes elements or attributes of another namespace (qemu:commandline, qemu:override),"
                          " which pass anything to qemu")
    if root.get("type") != mine.get("type"):
        raise HookRefused(f"changes the domain type ({mine.get('type')} to {root.get('type')}): the launcher chose the accelerator")
    for tag in ("name", "uuid"):
        if (root.findtext(tag) or "").strip() != (mine.findtext(tag) or "").strip():
            raise HookRefused(f"changes the domain's <{tag}>, by which the launcher knows its VM")
    for path in FIXED:
        got, want = [_canon(e) for e in root.findall(path)], [_canon(e) for e in mine.findall(path)]
        if got != want:
            raise HookRefused(f"changes <{path}>, which the launcher sets for this host")
    extra = _devices(root) - _devices(mine)
    if extra:
        kind = next(iter(extra))
        shown = kind[1] if kind[0] == "other" else f"{kind[0]}" + (f" of type {kind[1]}" if isinstance(kind[1], str) else "")
        raise HookRefused(f"adds a <{shown}> device or changes what one uses on the host (its source, backend or format)")
    unknown = sorted(_paths(root) - _paths(mine))
    if unknown:
        raise HookRefused(f"names a host path the launcher did not give the VM: {unknown[0]}")
    for tag in ("memory", "currentMemory", "maxMemory"):
        got, want = _bytes(root, tag), _bytes(mine, tag)
        if got is not None and (want is None or got > want):
            raise HookRefused(f"asks for more <{tag}> than the spec ({got} bytes)")
    got, want = _count(root, "vcpu"), _count(mine, "vcpu")
    if got is not None and (want is None or got > want):
        raise HookRefused(f"asks for more vCPUs than the spec ({got})")

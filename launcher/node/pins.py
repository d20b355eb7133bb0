"""The digest each containerDisk tag of a VirtualMachine resolved to, kept from one run to the next.

A tag can move between a VM's shutdown and its next boot, and a guest whose disk changed under its
own records (a filesystem it had half-written, a package database) may crash on the new one: that is
KubeVirt issue #15967. KubeVirt 1.9 keeps no digest across boots (`status.volumeStatus[].
containerDiskVolume` holds only a deprecated checksum, ContainerDiskInfo in
staging/src/kubevirt.io/api/core/v1/types.go); it resolves tags to digests only for a migration's
target pod (ExtractImageIDsFromSourcePod in pkg/container-disk/container-disk.go). The launcher
does it for every restart: the first run of a VirtualMachine pins each tag to the manifest it
resolved to, later runs boot that digest, and `launcher run --update` resolves the tags again.
A VirtualMachineInstance is made once and pins nothing, as in KubeVirt.

One record per VM (`<cache>/pins/<domain>.json`, written whole by rename), keyed by volume.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from diskkit.oci.reference import parse_ref
from launcher.node.cache import Cache


@dataclass(frozen=True)
class Pin:
    image: str  # as the VM's spec names it: a tag
    pinned: str  # the same repository at the digest the tag resolved to
    digest: str  # the manifest's (the platform's, from an index)
    platform: str
    since: int  # when the tag was resolved


def pinnable(image: str) -> bool:
    """A registry reference by tag: what can move under a VM. Local layouts and archives are files
    of the node, and a digest cannot move."""
    try:
        ref = parse_ref(image)
    except Exception:  # noqa: BLE001 - the pull names a bad reference in its own words
        return False
    return ref.transport == "docker" and ref.name is not None and not ref.name.digest


def with_digest(image: str, digest: str) -> str:
    """`image` with its tag replaced by `digest`, written as the user wrote the rest (a short name
    stays one): KubeVirt's toImageWithDigest in pkg/container-disk/container-disk.go."""
    slash, colon = image.rfind("/"), image.rfind(":")
    base = image[:colon] if colon > slash else image
    return f"{base}@{digest}"


def load(cache: Cache, domain: str) -> dict[str, Pin]:
    """The VM's pins by volume name (none when it never ran, or its record is unreadable: then its
    tags are resolved again, as on a first run)."""
    record = cache.read_json(cache.pin_path(domain)) or {}
    pins = {}
    for volume, fields in (record.get("volumes") or {}).items():
        try:
            pins[volume] = Pin(**fields)
        except TypeError:
            continue
    return pins


def save(cache: Cache, domain: str, pins: dict[str, Pin]) -> None:
    """Replace the VM's pins with `pins` (volumes gone from its spec lose theirs)."""
    path = cache.pin_path(domain)
    if not pins:
        path.unlink(missing_ok=True)
        return
    cache.write_json(path, {"domain": domain, "volumes": {name: asdict(pin) for name, pin in sorted(pins.items())}})


def resolved(old: Pin | None, image: str, digest: str, platform: str) -> Pin:
    """The pin for `image` having resolved to `digest`: the old one while it says the same."""
    if old is not None and (old.image, old.digest, old.platform) == (image, digest, platform):
        return old
    return Pin(image, with_digest(image, digest), digest, platform, int(time.time()))


def every(cache: Cache) -> list[dict]:
    """Every VM's pins, for `launcher ls`."""
    out = []
    for path in sorted((cache.root / "pins").glob("*.json")):
        record = cache.read_json(path) or {}
        for volume, fields in sorted((record.get("volumes") or {}).items()):
            if isinstance(fields, dict):
                out.append({"vm": record.get("domain"), "volume": volume, **fields})
    return out

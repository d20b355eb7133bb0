"""KubeVirt's sizing rules for the disks the launcher creates (pure; messages are KubeVirt's own).

pkg/host-disk (disk.img on filesystem PVCs and hostDisk DiskOrCreate) and
pkg/emptydisk (emptyDisk) in kubevirt/kubevirt.
"""

from __future__ import annotations

from dataclasses import dataclass

from diskkit.errors import DiskkitError

MIB = 1 << 20
RESERVE = 128 << 10  # minimumReservePVCBytes: free space KubeVirt never hands to a disk image
TOLERANCE = 10  # pvcTolerateLessSpaceUpToPercent


def image_size(request: int | None, capacity: int | None) -> int | None:
    """The disk.img size for a filesystem claim: the smaller of request and capacity, whole MiB."""
    known = [size for size in (request, capacity) if size]
    if not known:
        return None
    return min(known) // MIB * MIB


def claim_image_size(request: int | None, capacity: int | None, volume: str) -> int:
    """The disk.img size for a filesystem claim without one, as pkg/host-disk/host-disk.go
    replaceForHostDisk sizes it: the request when the capacity is larger or unknown (the disk the user
    asked for), else the capacity, rounded down to whole MiB. KubeVirt's filesystem overhead
    (PersistentVolumeClaimInfo.FilesystemOverhead) plays no part here: it only bounds the disk
    expansion of ExpandDisks, which the launcher does not do."""
    if not request and not capacity:
        raise DiskkitError(volume, "unable to determine capacity of HostDisk from PVC that provides no storage capacity or requests")
    wanted = request if request and (not capacity or capacity > request) else capacity
    size = wanted // MIB * MIB
    if size == 0:
        raise DiskkitError(volume, f"the size for volume {volume} is too low, must be at least 1MiB")
    return size


@dataclass(frozen=True)
class Fitted:
    size: int
    note: str | None  # KubeVirt's ToleratedSmallPV event text when the disk had to shrink


def fit(requested: int, free: int, volume: str, tolerance: int = TOLERANCE, path: str | None = None) -> Fitted:
    """Size a new image of `path` (on `volume`) for `free` bytes of space: up to `tolerance` % smaller
    is accepted. pkg/host-disk/host-disk.go handleRequestedSizeAndCreateSparseRaw, its words."""
    available = max(free - RESERVE, 0)
    if requested <= available:
        return Fitted(requested, None)
    if requested * (100 - tolerance) // 100 > available:
        raise DiskkitError(
            volume,
            f"unable to create {path or volume}, not enough space, demanded size {requested} B is bigger"
            f" than available space {available} B, also after taking {tolerance} % toleration into account",
        )
    note = f"PV size too small: expected {requested} B, found {available} B. Using it anyway, it is within {tolerance} % toleration"
    return Fitted(available, note)


def empty_disk_size(capacity: int, volume: str) -> int:
    """emptyDisk capacity rounded down to whole MiB; nothing left is KubeVirt's error."""
    size = capacity // MIB * MIB
    if size <= 0:
        raise DiskkitError(volume, f"the size for volume {volume} is too low")
    return size

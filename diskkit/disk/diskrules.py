"""What makes a disk usable as a KubeVirt containerDisk, with KubeVirt's own wording.

Pure functions over `qemu-img info` results, shared by build (refuse early), verify and the launcher.
"""

from __future__ import annotations

from diskkit.disk.qemuimg import DiskInfo

ACCEPTED_FORMATS = ("raw", "qcow2")


def violations(info: DiskInfo) -> list[str]:
    found = []
    if info.format not in ACCEPTED_FORMATS:
        found.append(f"unsupported image format: {info.format}")
    if info.backing_file:
        found.append(f"expected no backing file, but found {info.backing_file}")
    if info.data_file:
        found.append(f"expected no external data file, but found {info.data_file}")
    return found

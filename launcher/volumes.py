"""Make a VMI's volumes real: pull each containerDisk once per node, give each VM its own overlay.

N VMs from one image cost one read-only base in the cache plus N small qcow2 overlays, laid out
as virt-launcher does (`<run dir>/<volume>/disk.qcow2`, mode 0640).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass, field
from pathlib import Path

from diskkit import qemuimg
from diskkit.errors import DiskkitError
from diskkit.image import Platform
from diskkit.registryoptions import RegistryOptions

from .cache import Cache
from .domain import ResolvedDisk
from .pull import Pulled, pull
from .vmi import VMI


@dataclass
class Prepared:
    disks: dict[str, ResolvedDisk] = field(default_factory=dict)
    kernel: str | None = None
    initrd: str | None = None
    pulled: list[Pulled] = field(default_factory=list)
    overlays: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def direct_io_supported(path: Path) -> bool:
    """KubeVirt's probe: can the file be opened with O_DIRECT (tmpfs and some FUSE mounts say EINVAL)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise DiskkitError(path, f"cannot be opened ({exc.strerror})") from None
    os.close(fd)
    return True


def prepare(
    vmi: VMI,
    cache: Cache,
    run_dir: Path,
    registry: RegistryOptions | None = None,
    platform: Platform | None = None,
    create: bool = True,
) -> Prepared:
    """Pull every image the VMI names and, with `create`, make its overlays under `run_dir`.

    Without `create` (the dry run of `launcher domain`) overlay paths are planned, not made.
    """
    out = Prepared()
    for index, volume in enumerate(vmi.volumes):
        where = f"spec.volumes[{index}]"
        if volume.kind != "containerDisk":
            raise DiskkitError(f"{where}.{volume.kind}", "this volume type is not supported by the launcher yet")
        source = volume.source
        base = pull(cache, source.image, source.path, platform, registry, source.image_pull_policy, notes=out.notes)
        out.pulled.append(base)
        overlay = run_dir / volume.name / "disk.qcow2"
        if create:
            overlay.parent.mkdir(parents=True, exist_ok=True)
            qemuimg.create_overlay(base.path, base.format, overlay)
            out.overlays.append(overlay)
        probe = overlay if create else base.path
        direct = direct_io_supported(probe) and direct_io_supported(base.path)
        out.disks[volume.name] = ResolvedDisk(str(overlay), "qcow2", backing=(str(base.path), base.format), direct_io=direct)
    boot = _kernel_boot(vmi)
    if boot is not None:
        container = boot.container
        for attr, file_path in (("kernel", container.kernel_path), ("initrd", container.initrd_path)):
            if file_path:
                pulled = pull(cache, container.image, file_path, platform, registry, container.image_pull_policy, disk=False)
                out.pulled.append(pulled)
                setattr(out, attr, str(pulled.path))
    return out


def _kernel_boot(vmi: VMI):
    firmware = vmi.domain.firmware
    boot = getattr(firmware, "kernel_boot", None) if firmware is not None else None
    return boot if boot is not None and boot.container is not None else None

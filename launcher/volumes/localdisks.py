"""emptyDisk and hostDisk volumes: disks the launcher creates on this node, with KubeVirt's rules."""

from __future__ import annotations

from pathlib import Path

from diskkit.disk import qemuimg
from diskkit.errors import DiskkitError
from launcher.node.cache import within
from launcher.render.domain import ResolvedDisk
from launcher.spec.vmi import Volume
from launcher.volumes import sizing
from launcher.volumes.context import Context
from launcher.volumes.files import create_sparse, file_disk, free_bytes, is_block


def empty_disk(ctx: Context, volume: Volume, where: str) -> ResolvedDisk:
    """A sparse qcow2 in the VM's run directory: it survives guest reboots, not VM re-creation."""
    size = sizing.empty_disk_size(volume.source.capacity, volume.name)
    path = within(ctx.run_dir, "empty-disks", f"{volume.name}.qcow2")
    if ctx.create:
        path.parent.mkdir(parents=True, exist_ok=True)
        qemuimg.create_image(path, "qcow2", size)
    return file_disk(path, "qcow2")


def host_disk(ctx: Context, volume: Volume, where: str) -> ResolvedDisk:
    source = volume.source
    path = Path(source.path)
    if not path.exists():
        if source.type != "DiskOrCreate":
            raise DiskkitError(f"{where}.path", f"hostDisk {source.path} does not exist (type {source.type})")
        if not source.capacity:
            raise DiskkitError(f"{where}.capacity", "required for type DiskOrCreate")
        if not path.parent.is_dir():
            raise DiskkitError(f"{where}.path", f"directory {path.parent} does not exist")
        if ctx.create:
            fitted = sizing.fit(source.capacity, free_bytes(path.parent), source.path, ctx.store.tolerance)
            ctx.note(fitted.note)
            create_sparse(path, fitted.size)
    elif not (path.is_file() or is_block(path)):
        raise DiskkitError(f"{where}.path", f"hostDisk {source.path} is not a regular file")
    return file_disk(path, "raw")

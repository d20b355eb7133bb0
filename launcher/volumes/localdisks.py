"""emptyDisk and hostDisk volumes: disks the launcher creates on this node, with KubeVirt's rules."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from diskkit.disk import qemuimg
from diskkit.errors import DiskkitError
from launcher.node.cache import within
from launcher.render.domain import ResolvedDisk
from launcher.spec.gates import allowed_dir
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
    _refuse_links(path, allowed_dir(source.path, ctx.store.gates), f"{where}.path")
    if not path.exists():
        if source.type != "DiskOrCreate":
            raise DiskkitError(f"{where}.path", f"hostDisk {source.path} does not exist (type {source.type})")
        if not source.capacity:
            # pkg/host-disk/host-disk.go: KubeVirt admits it, then makes the disk of its capacity (0) by a
            # write at capacity - 1, which fails the VM's start and leaves an empty file, next time's disk.
            raise DiskkitError(f"{where}.capacity", f"{source.path} does not exist and a DiskOrCreate disk is made of its capacity,"
                                                    " which is missing: KubeVirt fails the start (writeat: negative offset)")
        if not path.parent.is_dir():
            raise DiskkitError(f"{where}.path", f"directory {path.parent} does not exist")
        if ctx.create:
            fitted = sizing.fit(source.capacity, free_bytes(path.parent), where, ctx.store.tolerance, path=source.path)
            ctx.note(fitted.note)
            create_sparse(path, fitted.size)
    elif not (path.is_file() or is_block(path)):
        raise DiskkitError(f"{where}.path", f"hostDisk {source.path} is not a regular file")
    return file_disk(path, "raw")


def _refuse_links(path: Path, allowed: str | None, at: str) -> None:
    """Nothing between the allowed directory and the disk may be a symbolic link: libvirt would chown
    and qemu open whatever it points to, which the admin never allowed (admission checked only the text)."""
    if allowed is None:  # admission refuses it first; a direct caller gets the same answer
        raise DiskkitError(at, f"{path} is not under a directory allowed for hostDisks")
    current = Path(allowed)
    for part in path.relative_to(allowed).parts:
        current = current / part
        try:
            mode = os.lstat(current).st_mode
        except FileNotFoundError:
            return  # the rest does not exist: DiskOrCreate makes it, Disk refuses it below
        except OSError as exc:
            raise DiskkitError(at, f"{current} cannot be examined ({exc.strerror})") from None
        if stat.S_ISLNK(mode):
            raise DiskkitError(at, f"{current} is a symbolic link; a hostDisk path is never followed through links")

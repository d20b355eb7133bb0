"""The files and devices libvirt opens for a VM's disks: probes, ownership, sparse images, overlays."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from diskkit.disk import qemuimg
from diskkit.errors import DiskkitError
from launcher.node.cache import QEMU_ID
from launcher.render.domain import ResolvedDisk


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


def is_block(path: Path) -> bool:
    try:
        return stat.S_ISBLK(path.stat().st_mode)
    except OSError:
        return False


def give_to_qemu(path: Path) -> None:
    # As root (virt-handler's role) new images go to the qemu user; unprivileged, they are ours already.
    if os.geteuid() == 0:
        os.chown(path, QEMU_ID, QEMU_ID)


def create_sparse(path: Path, size: int) -> None:
    """A raw image of `size` bytes holding nothing yet, appearing complete or not at all."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.truncate(size)
            os.fsync(f.fileno())
        give_to_qemu(tmp)
        os.rename(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise DiskkitError(path, f"cannot be created ({exc.strerror})") from None


def free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def file_disk(path: Path, fmt: str, **kw) -> ResolvedDisk:
    """A disk on a file or block device as it stands (or will stand) at `path`."""
    block = is_block(path)
    direct = direct_io_supported(path) if path.exists() else True
    preallocated = not block and path.exists() and path.stat().st_blocks * 512 >= path.stat().st_size
    return ResolvedDisk(str(path), fmt, type="block" if block else "file", direct_io=direct, preallocated=preallocated, **kw)


def overlay(path: Path, base: Path, base_format: str, create: bool) -> ResolvedDisk:
    """A VM's own qcow2 over a read-only base (KubeVirt's ephemeral disks); `create=False` only plans it."""
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        qemuimg.create_overlay(base, base_format, path)
    probe = path if create else base
    direct = direct_io_supported(probe) and direct_io_supported(base)
    backing_type = "block" if is_block(base) else "file"
    return ResolvedDisk(str(path), "qcow2", backing=(str(base), base_format), direct_io=direct, backing_type=backing_type)

"""What a root launcher's qemu gets as an open file rather than a name: every disk and kernel it uses
from outside the VM's own run directory.

qemu runs as the VM's own uid (launcher.runtime.vmuser), or as the system daemon's qemu user, and
neither may open the node's pulled disks, another image's included, by name: the cache's disks/ is
root's alone. So root opens each disk file the VM needs (a containerDisk's base, a claim's disk.img, a
hostDisk, a disk in a pod's image volume), one name component at a time without following a link, and
libvirt hands the open file to qemu (virDomainFDAssociate and `<source fdgroup=...>`, libvirt 9.0):
qemu reads exactly the files it was given, and its uid reaches nothing else in the cache. Read-only
disks and bases are opened read-only.

libvirt 9.0 takes fd groups for file sources only. A block device (a block claim) becomes a device
node of the VM's own in its run directory, as the container runtime makes one in a pod's /dev for a
block volume; the kernel and initrd of a kernelBoot are copied there (qemu's -kernel takes a name).
The run directory hands them to qemu's uid with everything else in it (launcher.runtime.rundir).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path

from diskkit.errors import DiskkitError
from launcher.hostfs.dirfd import Dir
from launcher.render.domain import ResolvedDisk
from launcher.runtime.rundir import inside

DEVICES_DIR = "devices"
KERNEL_DIR = "kernel-boot"
COPY_CHUNK = 1 << 20


@dataclass
class Handed:
    """The disks as the domain names them, and the open files behind each fd group."""

    disks: dict[str, ResolvedDisk]
    fds: dict[str, list[int]] = field(default_factory=dict)
    kernel: str | None = None
    initrd: str | None = None

    def close(self) -> None:
        for fds in self.fds.values():
            for fd in fds:
                os.close(fd)
        self.fds = {}


def hand_over(disks: dict[str, ResolvedDisk], run_dir: Path, kernel: str | None = None, initrd: str | None = None,
              read_only: set[str] = frozenset()) -> Handed:
    """The disks with every outside file given by fd (or device node), and the boot files copied in;
    the volumes in `read_only` (the guest's read-only disks) and every base are opened read-only."""
    handed = Handed({})
    try:
        for name, disk in disks.items():
            handed.disks[name] = _disk(handed, name, disk, run_dir, name in read_only)
        handed.kernel = _copied(kernel, run_dir, "kernel")
        handed.initrd = _copied(initrd, run_dir, "initrd")
    except BaseException:
        handed.close()
        raise
    return handed


def _disk(handed: Handed, name: str, disk: ResolvedDisk, run_dir: Path, read_only: bool) -> ResolvedDisk:
    if disk.type == "file" and not inside(disk.path, run_dir):
        group = name
        # qemu takes from the group the file whose access mode it opens with (O_RDONLY for <readonly/>).
        handed.fds[group] = [_open(Path(disk.path), read_only=read_only or disk.read_only)]
        disk = replace(disk, fd_group=group)
    elif disk.type == "block":
        disk = replace(disk, path=str(_device_node(Path(disk.path), run_dir, name)))
    if disk.backing is not None:
        base, fmt = disk.backing
        if disk.backing_type == "file" and not inside(base, run_dir):
            group = f"{name}-base"
            handed.fds[group] = [_open(Path(base), read_only=True)]
            disk = replace(disk, backing_fd_group=group)
        elif disk.backing_type == "block":
            disk = replace(disk, backing=(str(_device_node(Path(base), run_dir, f"{name}-base")), fmt))
    return disk


def _open(path: Path, read_only: bool) -> int:
    """The file at `path`, a regular file with one link reached without following a link in its
    directory (a claim's directory is its owner's to plant links in)."""
    with Dir.open(path.parent) as parent:
        return parent.open_file(path.name, os.O_RDONLY if read_only else os.O_RDWR)


def _device_node(device: Path, run_dir: Path, name: str) -> Path:
    """A node of the same block device in the run directory, root's until the run directory is handed over."""
    try:
        st = os.stat(device)
    except OSError as exc:
        raise DiskkitError(device, f"cannot be looked at ({exc.strerror})") from None
    if not stat.S_ISBLK(st.st_mode):
        raise DiskkitError(device, "is not a block device")
    node = run_dir / DEVICES_DIR / name
    try:
        node.parent.mkdir(mode=0o700, exist_ok=True)
        os.mknod(node, stat.S_IFBLK | 0o600, st.st_rdev)
    except OSError as exc:
        raise DiskkitError(node, f"cannot be made for {device} ({exc.strerror})") from None
    return node


def _copied(path: str | None, run_dir: Path, name: str) -> str | None:
    if path is None or inside(path, run_dir):
        return path
    target = run_dir / KERNEL_DIR / name
    try:
        target.parent.mkdir(mode=0o700, exist_ok=True)
        source = _open(Path(path), read_only=True)
        try:
            out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                while chunk := os.read(source, COPY_CHUNK):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(out, view):]
            finally:
                os.close(out)
        finally:
            os.close(source)
    except OSError as exc:
        raise DiskkitError(path, f"cannot be copied into the VM's run directory ({exc.strerror})") from None
    return str(target)

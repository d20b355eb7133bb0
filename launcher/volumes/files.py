"""The files and devices libvirt opens for a VM's disks: probes, ownership, sparse images, overlays."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
from pathlib import Path

from diskkit.disk import qemuimg
from diskkit.errors import DiskkitError
from launcher.diskserver.qemuid import is_system_uri, system_qemu_ids
from launcher.hostfs import asowner
from launcher.hostfs.dirfd import NOFOLLOW, Dir, give
from launcher.node.cache import QEMU_ID


def direct_io_supported(path: Path) -> bool:
    """KubeVirt's probe: can the file be opened with O_DIRECT (tmpfs and some FUSE mounts say EINVAL)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_NONBLOCK)  # a FIFO swapped in cannot hang the probe
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


KUBEVIRT_QEMU = (QEMU_ID, QEMU_ID)


def qemu_owner(uri: str) -> tuple[int, int]:
    """Who qemu runs as for a root launcher: under libvirt's system daemon, qemu.conf's user and
    group (Debian's libvirt-qemu; not 107, which libvirt would be denied a 0700 run directory of);
    on a session daemon, KubeVirt's qemu (107), whose session a root launcher connects to.
    Unprivileged nothing is given away (and qemu.conf, 0600 on Debian, is not ours to read)."""
    if os.geteuid() != 0:
        return os.geteuid(), os.getegid()
    return system_qemu_ids() if is_system_uri(uri) else KUBEVIRT_QEMU


def give_to_qemu(path: Path, owner: tuple[int, int] = KUBEVIRT_QEMU) -> None:
    """As root (virt-handler's role) a new image goes to the qemu user; unprivileged, it is ours already.
    The entry itself is chowned: a link is refused, and one swapped in after the check is what lchown
    changes, never its target."""
    if os.geteuid() != 0:
        return
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            raise DiskkitError(path, NOFOLLOW)
        os.chown(path, *owner, follow_symlinks=False)
    except OSError as exc:
        raise DiskkitError(path, f"cannot be given to uid {owner[0]} ({exc.strerror})") from None


def create_sparse(path: Path, size: int) -> None:
    """A raw image of `size` bytes holding nothing yet, appearing complete or not at all, and qemu's. Its
    directory may be a claim its user writes: root makes the image there as that user
    (launcher.hostfs.asowner), as KubeVirt's non-root virt-launcher makes a claim's disk.img with no
    rights beyond the pod's, then gives the file it finds (regular, one link, no link followed) to qemu.
    The staging name is made fresh either way (a planted one is refused, never truncated)."""
    with Dir.open(path.parent) as parent:
        owner = asowner.owner_of(parent)
        if owner is None:
            _create_sparse_at(parent, path, size)
            return
        asowner.run_as(owner, lambda send: _create_sparse_at(parent, path, size) or {})
        _give_found(parent, path, KUBEVIRT_QEMU)


def _create_sparse_at(parent: Dir, path: Path, size: int) -> None:
    if parent.lstat(path.name) is not None:
        parent.regular(path.name)  # a link or device under the image's name is refused, not replaced
    tmp = f".{path.name}.tmp"
    parent.unlink(tmp)  # a killed run's, or a planted link: the name goes, what it named is untouched
    fd = parent.create(tmp, 0o644)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
        give(fd, KUBEVIRT_QEMU)  # as root in root's own directory; as anyone else, nothing
        parent.rename(tmp, parent, path.name)
    except (OSError, DiskkitError) as exc:
        parent.unlink(tmp)
        raise DiskkitError(path, f"cannot be created ({getattr(exc, 'strerror', None) or exc})") from None
    finally:
        os.close(fd)


def give_claim_image(path: Path, owner: tuple[int, int]) -> None:
    """A claim's disk.img handed to qemu's user by its fd, as virt-handler makes a claim's image the
    non-root qemu's: the file checked (regular, one link, no link followed) is the file chowned, and the
    domain tells libvirt not to chown it again by path. Unprivileged, it is ours already."""
    if os.geteuid() != 0:
        return
    with Dir.open(path.parent) as parent:
        _give_found(parent, path, owner, 0o660)


def _give_found(parent: Dir, path: Path, owner: tuple[int, int], mode: int | None = None) -> None:
    """The file found at `path` (regular, one link, no link followed) chowned through its fd."""
    fd = parent.open_file(path.name)
    try:
        give(fd, owner, mode)
    except OSError as exc:
        raise DiskkitError(path, f"cannot be given to uid {owner[0]} ({exc.strerror})") from None
    finally:
        os.close(fd)


def claim_image(path: Path) -> bool:
    """Whether `path` (a claim's disk.img) exists; anything but a regular file there is refused. Whoever
    owns the claim directory may have put a link there: its target, perhaps a root-only file, is never
    attached."""
    with Dir.open(path.parent) as parent:
        return parent.regular(path.name) is not None


def free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


BLKSSZGET = 0x1268  # linux/fs.h: logical sector size
BLKPBSZGET = 0x127B  # physical block size


def block_io(path: Path) -> tuple[int, int, int] | None:
    """What blockSize.matchVolume gives the guest (storage/disk.go getOptimalBlockIO): a device's own
    logical and physical sizes and discard granularity, or a file's filesystem block size for all three."""
    try:
        if not is_block(path):
            existing = path
            while not existing.exists() and existing != existing.parent:
                existing = existing.parent  # a dry run plans files in directories not made yet
            size = os.statvfs(existing).f_bsize
            return size, size, size
        fd = os.open(path, os.O_RDONLY)
        try:
            logical = struct.unpack("I", fcntl.ioctl(fd, BLKSSZGET, b"\0" * 4))[0]
            physical = struct.unpack("I", fcntl.ioctl(fd, BLKPBSZGET, b"\0" * 4))[0]
        finally:
            os.close(fd)
        rdev = path.stat().st_rdev
        granularity = Path(f"/sys/dev/block/{os.major(rdev)}:{os.minor(rdev)}/queue/discard_granularity")
        discard = int(granularity.read_text()) if granularity.exists() else 0
    except OSError as exc:
        raise DiskkitError(path, f"cannot read its block sizes ({exc.strerror})") from None
    logical, physical = logical or physical, physical or logical
    if discard % logical:
        discard = physical
    return logical, physical, discard


def file_disk(path: Path, fmt: str, **kw) -> ResolvedDisk:
    """A disk on a file or block device as it stands (or will stand) at `path`."""
    # Here, not at the top: DataVolume and upload code uses this module's file helpers without the renderer.
    from launcher.render.domain import ResolvedDisk

    block = is_block(path)
    direct = direct_io_supported(path) if path.exists() else True
    preallocated = not block and path.exists() and path.stat().st_blocks * 512 >= path.stat().st_size
    return ResolvedDisk(str(path), fmt, type="block" if block else "file", direct_io=direct, preallocated=preallocated,
                        block_io=block_io(path), **kw)


def overlay(path: Path, base: Path, base_format: str, create: bool) -> ResolvedDisk:
    """A VM's own qcow2 over a read-only base (KubeVirt's ephemeral disks); `create=False` only plans it."""
    from launcher.render.domain import ResolvedDisk

    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        qemuimg.create_overlay(base, base_format, path)
    probe = path if create else base
    # converter.go SetDriverCacheMode probes the backing store's *file* source; a block device base has
    # none, the probe of "" fails, and KubeVirt falls back to writethrough. Do as it does.
    backing_block = is_block(base)
    direct = direct_io_supported(probe) and not backing_block and direct_io_supported(base)
    backing_type = "block" if backing_block else "file"
    return ResolvedDisk(str(path), "qcow2", backing=(str(base), base_format), direct_io=direct, backing_type=backing_type,
                        block_io=block_io(probe))

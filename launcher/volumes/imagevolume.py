"""containerDisks the pod mounts as Kubernetes image volumes (KEP-4639), used in place of a pull.

KubeVirt 1.9 (its ImageVolume gate) gives the virt-launcher pod one read-only `image:` volume per
containerDisk, mounted at /var/run/kubevirt-image-volume/disk_<index of the volume in spec.volumes>
(addContainerDiskVolumeMount in pkg/virt-controller/services/rendervolumes.go, VirtImageVolumeDir in
pkg/util/util.go), and virt-launcher links the disk it finds there as the VM's backing file
(linkImageVolumeFilePaths in pkg/virt-launcher/virtwrap/manager.go): containerDisk.path when given,
else a single file at the image's root (an ORAS-style artifact), else the single entry of /disk
(findDiskFileInImageVolume). `launcher run --container-disk-dir DIR` reads the same layout under DIR.

The directory is the image's, not ours: names are resolved one component at a time from directory
fds with O_NOFOLLOW; a symbolic link is resolved inside the image's root as in the container, and
one leading out of it is refused. The file found is checked as a pulled disk is (raw or qcow2, no
backing or data file), through its fd. qemu is then given its path, link-free as walked: the mount is
read-only, so what was checked is what qemu opens.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from diskkit.disk.containerdisk import DISK_DIR, path_problem
from diskkit.errors import DiskkitError
from diskkit.ops.verify import DiskFacts, disk_problems
from launcher.hostfs.dirfd import DIR_NOFOLLOW

MAX_LINKS = 40  # the kernel's own limit on links in one lookup
# KubeVirt's words, as virt-launcher logs them (linkImageVolumeFilePaths)
NOT_FOUND = "failed to find disk file from ImageVolume"
NO_KERNEL = "error getting kernel boot artifact path from ImageVolume"


@dataclass(frozen=True)
class Found:
    path: Path  # the disk under the mount, every component a real name
    format: str
    virtual_size: int | None


def mount_of(root: Path | str, index: int) -> Path:
    return Path(root) / f"disk_{index}"


def find_disk(root: Path | str, index: int, path: str | None, where: str) -> Found:
    """The disk of spec.volumes[index] in its image mounted under `root`, checked; refused in one line
    naming `where` (the volume's field) and the rule."""
    base = mount_of(root, index)
    top = _open_mount(base, where)
    try:
        if path is not None:
            if problem := path_problem(path):
                raise DiskkitError(f"{where}.path", problem)
            rel = path.strip("/")
        else:
            rel = _default_disk(top, base, where)
        fd, names = _resolve(top, rel, base, where)
    finally:
        os.close(top)
    shown = base.joinpath(*names)
    try:
        facts = DiskFacts()
        problems = disk_problems(Path(f"/proc/{os.getpid()}/fd/{fd}"), str(shown), facts)
    finally:
        os.close(fd)
    if problems:
        raise DiskkitError(where, "; ".join(problems))
    return Found(shown, facts.format, facts.virtual_size)


def find_file(base: Path | str, path: str, where: str) -> Path:
    """A kernelBoot artifact in the image mounted at `base` (KubeVirt's /var/run/kubevirt-kernel-boot:
    getKernelBootArtifactPathFromImageVolumeView in pkg/virt-launcher/virtwrap/manager.go): its
    link-free path, a regular file."""
    base = Path(base)
    if problem := path_problem(path):
        raise DiskkitError(where, problem)
    top = _open_mount(base, where, NO_KERNEL)
    try:
        fd, names = _resolve(top, path.strip("/"), base, where, prefix=NO_KERNEL)
    finally:
        os.close(top)
    os.close(fd)
    return base.joinpath(*names)


def _open_mount(base: Path, where: str, prefix: str = NOT_FOUND) -> int:
    try:
        return os.open(base, DIR_NOFOLLOW)
    except OSError as exc:
        raise DiskkitError(where, f"{prefix}: failed to read image volume directory {base}: {(exc.strerror or str(exc)).lower()}") from None


def _default_disk(top: int, base: Path, where: str) -> str:
    """findDiskFileInImageVolume: a lone non-directory at the root, else the lone one in /disk."""
    entries = os.listdir(top)
    if len(entries) == 1 and not stat.S_ISDIR(os.stat(entries[0], dir_fd=top, follow_symlinks=False).st_mode):
        return entries[0]
    disk_dir = base / DISK_DIR
    try:
        fd, _ = _resolve(top, DISK_DIR, base, where, directory=True)
    except DiskkitError:
        raise DiskkitError(where, f"{NOT_FOUND}: could not determine disk file in image volume root {base}"
                                  f" (found {len(entries)} entries, no {DISK_DIR} directory)") from None
    try:
        files = os.listdir(fd)
        lone = len(files) == 1 and not stat.S_ISDIR(os.stat(files[0], dir_fd=fd, follow_symlinks=False).st_mode)
    finally:
        os.close(fd)
    if not lone:
        raise DiskkitError(where, f"{NOT_FOUND}: could not determine disk file in {disk_dir}"
                                  f" (expected exactly one non-directory entry, found {len(files)})")
    return f"{DISK_DIR}/{files[0]}"


def _resolve(top: int, rel: str, base: Path, where: str, directory: bool = False, prefix: str = NOT_FOUND) -> tuple[int, list[str]]:
    """`rel` under the directory `top`, links resolved inside it: an fd of the regular file (or, with
    `directory`, the directory) it names, read-only, and the real names leading to it."""
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    held: list[tuple[str, int]] = []  # the directories walked below `top`, by name and fd
    links = 0

    def refuse(rule: str) -> DiskkitError:
        return DiskkitError(where, f"{prefix}: {base / rel}: {rule}")

    try:
        while parts:
            name = parts.pop(0)
            if name == "..":
                if not held:
                    raise refuse(f"leads out of the image volume {base} (a symbolic link or .. above its root)")
                os.close(held.pop()[1])
                continue
            here = held[-1][1] if held else top
            try:
                st = os.stat(name, dir_fd=here, follow_symlinks=False)
            except FileNotFoundError:
                raise refuse(f"no such file or directory ({'/'.join([n for n, _ in held] + [name])})") from None
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > MAX_LINKS:
                    raise refuse("too many levels of symbolic links")
                target = os.readlink(name, dir_fd=here)
                if target.startswith("/"):  # the image's root, as inside the container
                    while held:
                        os.close(held.pop()[1])
                parts = [p for p in target.split("/") if p not in ("", ".")] + parts
                continue
            if parts or directory:
                if not stat.S_ISDIR(st.st_mode):
                    raise refuse(f"{name} is not a directory")
                held.append((name, os.open(name, DIR_NOFOLLOW, dir_fd=here)))
                continue
            return _open_regular(here, name, refuse), [n for n, _ in held] + [name]
        if directory:
            names = [n for n, _ in held]
            return os.dup(held[-1][1] if held else top), names
        raise refuse("is a directory, not a disk file")
    finally:
        for _, fd in held:
            os.close(fd)


def _open_regular(here: int, name: str, refuse) -> int:
    handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=here)
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            raise refuse("is not a regular file (a FIFO, device, socket or directory)")
        return os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        os.close(handle)

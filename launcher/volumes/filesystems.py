"""Volumes shared with the guest over virtiofs (spec.domain.devices.filesystems): the directory each
virtiofsd serves.

KubeVirt's virtiofsd container serves the volume's mount in the pod
(pkg/virt-controller/services/virtiofs.go virtioFSMountPoint): a claim is shared as its directory
itself (not a disk.img in it), a configMap, secret, serviceAccount or downwardAPI volume as the
directory of files the kubelet mounted, read-only. Here those files are written under the VM's run
directory, from --manifests or the pod's mounts, as for the config disks, and served read-only.

virtiofsd serves a share as the qemu user (launcher.runtime.virtiofs), so a writable claim's
directory is that user's, mode 0700: whatever a guest leaves in it (a setuid binary of that user,
say) is out of every other local user's reach.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from diskkit.errors import DiskkitError
from launcher.hostfs.dirfd import DIR_NOFOLLOW, give
from launcher.spec.k8s import network_disk, resolve_claim
from launcher.spec.vmi import Volume
from launcher.volumes import gendisks
from launcher.volumes.context import Context, Share
from launcher.volumes.files import is_block
from launcher.volumes.storage import pv_path

SHARES_DIR = "virtiofs-shares"  # under the VM's run directory: the config volumes' files


def share(ctx: Context, volume: Volume, where: str) -> Share:
    if volume.kind in ("persistentVolumeClaim", "dataVolume"):
        return _claim_share(ctx, volume, where)
    generator = gendisks.Generator(ctx.vmi, ctx.run_dir, gendisks.Sources(ctx.store.objects, ctx.store.pod_config, ctx.store.service_account_dir))
    plans = {"configMap": generator.config, "secret": generator.config,
             "serviceAccount": generator.service_account, "downwardAPI": generator.downward_api}
    if volume.kind not in plans:
        raise DiskkitError(where, f"a {volume.kind} volume cannot be shared as a filesystem")
    plan = plans[volume.kind](volume, where)
    target = ctx.run_dir / SHARES_DIR / volume.name
    if ctx.create:
        write_tree(target, plan.files, plan.modes)
    # The kubelet mounts these read-only; the guest must not change them either.
    return Share(target, read_only=True)


def _claim_dir(ctx: Context, volume: Volume, where: str) -> Path:
    source = volume.source
    name = source.claim_name if volume.kind == "persistentVolumeClaim" else source.name
    store = ctx.store
    local = store.pvcs.get(name)
    if store.objects is not None and local is None:
        claim = resolve_claim(store.objects, ctx.vmi.namespace, name, where)
        if network_disk(store.objects, claim, where) is not None:
            raise DiskkitError(where, f"claim {name} is a network (iSCSI/RBD) volume, a block device: it cannot be shared as a filesystem")
        local = pv_path(claim)
    path = local.path if local is not None else store.pod_disks / volume.name
    if is_block(path):
        raise DiskkitError(where, f"claim {name}: {path} is a block device; a filesystem shares a directory")
    if not path.is_dir():
        raise DiskkitError(where, f"claim {name}: {path} is not a directory (give --pvc {name}=DIR, --manifests with a bound claim,"
                                  f" or mount it at {store.pod_disks / volume.name})")
    return path


def _claim_share(ctx: Context, volume: Volume, where: str) -> Share:
    # A readOnly claim is shared read-only, as the kubelet mounts it.
    return Share(_claim_dir(ctx, volume, where), read_only=bool(getattr(volume.source, "read_only", False)))


SHARE_MODE = 0o700


def give_share(path: Path, owner: tuple[int, int], where: str) -> None:
    """A writable share's directory as virtiofsd's user gets it: theirs (a root launcher gives it a
    directory of root's, as KubeVirt's fsGroup does a claim), mode SHARE_MODE. Another user's
    directory is refused: virtiofsd, which sees the guest's memory, runs as the qemu user only."""
    try:
        fd = os.open(path, DIR_NOFOLLOW)
    except OSError as exc:
        raise DiskkitError(where, f"shared directory {path} cannot be opened ({exc.strerror}; a symbolic link is not followed)") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != owner[0]:
            if st.st_uid != 0 or os.geteuid() != 0:
                raise DiskkitError(where, f"shared directory {path} belongs to uid {st.st_uid}; virtiofsd serves it as uid {owner[0]}"
                                          " (the qemu user), so it must belong to that user" + (" or to root" if os.geteuid() == 0 else ""))
        give(fd, owner if st.st_uid != owner[0] else None, SHARE_MODE if stat.S_IMODE(st.st_mode) != SHARE_MODE else None)
    except OSError as exc:
        raise DiskkitError(where, f"shared directory {path} cannot be given to uid {owner[0]} ({exc.strerror})") from None
    finally:
        os.close(fd)


def write_tree(target: Path, files: dict[str, bytes], modes: dict[str, int]) -> None:
    """`files` (relative paths) as a directory at `target`, appearing complete or not at all."""
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for rel, data in sorted(files.items()):
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
                os.fsync(f.fileno())
            os.chmod(path, modes.get(rel, 0o644))
        tmp.mkdir(parents=True, exist_ok=True)  # an empty (optional, missing) object is an empty directory
        # Written while the run directory is root's alone; launcher.runtime.rundir gives the tree to the
        # qemu user (the pod's fsGroup) afterwards, as virtiofsd runs as that user.
        shutil.rmtree(target, ignore_errors=True)
        os.rename(tmp, target)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise DiskkitError(target, f"cannot be written ({exc.strerror})") from None

"""Make a VMI's volumes real: the files and devices libvirt opens, created the way KubeVirt does.

containerDisks are pulled once per node and each VM gets its own qcow2 overlay (N VMs cost one
read-only base plus N small overlays). Claims are found from `--pvc CLAIM=PATH`, from PV/PVC
manifests (iSCSI and RBD PVs become network disks), or at virt-launcher's mount paths in a pod.
Cloud-init, config and metrics disks are generated (launcher.gendisks).
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from diskkit.disk import qemuimg
from diskkit.errors import DiskkitError
from diskkit.oci.image import Platform
from diskkit.registry.options import RegistryOptions

from launcher.volumes import gendisks, storage
from launcher.node.cache import Cache
from launcher.render.domain import ResolvedDisk
from launcher.spec.k8s import Claim, NetworkSource, Objects, network_disk, resolve_claim
from launcher.node.pull import Pulled, default_policy, pull
from launcher.spec.vmi import VMI, Volume

POD_DISKS = Path("/var/run/kubevirt-private/vmi-disks")  # virt-launcher's mounts, by volume name
QEMU_ID = 107


@dataclass(frozen=True)
class LocalClaim:
    """`--pvc CLAIM=PATH[:SIZE]`: a directory (filesystem mode) or a block device for a claim."""

    path: Path
    size: int | None = None


@dataclass
class Storage:
    pvcs: dict[str, LocalClaim] = field(default_factory=dict)
    objects: Objects | None = None
    tolerance: int = storage.TOLERANCE
    pod_disks: Path = POD_DISKS
    pod_config: Path = gendisks.POD_CONFIG  # config volumes as mounted in virt-launcher's pod
    service_account_dir: Path = gendisks.Sources.service_account_dir


@dataclass
class Prepared:
    disks: dict[str, ResolvedDisk] = field(default_factory=dict)
    kernel: str | None = None
    initrd: str | None = None
    pulled: list[Pulled] = field(default_factory=list)
    secrets: list[tuple[NetworkSource, bytes]] = field(default_factory=list)
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


def _is_block(path: Path) -> bool:
    try:
        return stat.S_ISBLK(path.stat().st_mode)
    except OSError:
        return False


def _own(path: Path) -> None:
    # As root (virt-handler's role) new images go to the qemu user; unprivileged, they are ours already.
    if os.geteuid() == 0:
        os.chown(path, QEMU_ID, QEMU_ID)


def _create_sparse(path: Path, size: int) -> None:
    """A raw image of `size` bytes holding nothing yet, appearing complete or not at all."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.truncate(size)
            os.fsync(f.fileno())
        _own(tmp)
        os.rename(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise DiskkitError(path, f"cannot be created ({exc.strerror})") from None


def _free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class _Preparer:
    def __init__(self, vmi: VMI, cache: Cache, run_dir: Path, registry, platform, create: bool, store: Storage, lazy: str = "off"):
        self.vmi, self.cache, self.run_dir = vmi, cache, run_dir
        self.registry, self.platform, self.create, self.store = registry, platform, create, store
        self.lazy = lazy if create else "off"  # a dry run starts no disk server
        self.out = Prepared()

    def resolve(self, volume: Volume, where: str) -> ResolvedDisk:
        handler = getattr(self, f"_{volume.kind}", None)
        if handler is None:
            raise DiskkitError(f"{where}.{volume.kind}", "this volume type is not supported by the launcher yet")
        return handler(volume, f"{where}.{volume.kind}")

    def _file_disk(self, path: Path, fmt: str, **kw) -> ResolvedDisk:
        block = _is_block(path)
        direct = direct_io_supported(path) if path.exists() else True
        preallocated = not block and path.exists() and path.stat().st_blocks * 512 >= path.stat().st_size
        return ResolvedDisk(str(path), fmt, type="block" if block else "file", direct_io=direct, preallocated=preallocated, **kw)

    def _overlay(self, volume: Volume, base: Path, base_format: str) -> ResolvedDisk:
        overlay = self.run_dir / volume.name / "disk.qcow2"
        if self.create:
            overlay.parent.mkdir(parents=True, exist_ok=True)
            qemuimg.create_overlay(base, base_format, overlay)
        probe = overlay if self.create else base
        direct = direct_io_supported(probe) and direct_io_supported(base)
        backing_type = "block" if _is_block(base) else "file"
        return ResolvedDisk(str(overlay), "qcow2", backing=(str(base), base_format), direct_io=direct, backing_type=backing_type)

    # --- one method per volume kind (KubeVirt's key) ----------------------------------------

    def _nbd_overlay(self, volume: Volume, attached) -> ResolvedDisk:
        """The overlay over a disk the node's disk server exports (a lazy containerDisk)."""
        overlay = self.run_dir / volume.name / "disk.qcow2"
        overlay.parent.mkdir(parents=True, exist_ok=True)
        qemuimg.create_overlay(attached.url, attached.format, overlay, size=attached.virtual_size)
        export = NetworkSource("nbd", attached.export, (), socket=attached.socket)
        return ResolvedDisk(str(overlay), "qcow2", backing=(attached.url, attached.format), direct_io=direct_io_supported(overlay),
                            backing_type="network", backing_network=export)

    def _containerDisk(self, volume: Volume, where: str) -> ResolvedDisk:
        source = volume.source
        if self.lazy != "off":
            from launcher.diskserver.server import attach

            policy = source.image_pull_policy or default_policy(source.image)
            attached = attach(self.cache, source.image, source.path, self.platform, self.registry, self.lazy, policy, self.out.notes)
            if attached is not None:
                self.out.pulled.append(attached.pulled)
                return self._nbd_overlay(volume, attached)
        base = pull(self.cache, source.image, source.path, self.platform, self.registry, source.image_pull_policy, notes=self.out.notes)
        self.out.pulled.append(base)
        return self._overlay(volume, base.path, base.format)

    def _persistentVolumeClaim(self, volume: Volume, where: str) -> ResolvedDisk:
        return self._claim(volume, volume.source.claim_name, volume.source.read_only, where)

    def _dataVolume(self, volume: Volume, where: str) -> ResolvedDisk:
        # A DataVolume is used through the claim of the same name (imports come with the DataVolume issue).
        return self._claim(volume, volume.source.name, False, where)

    def _ephemeral(self, volume: Volume, where: str) -> ResolvedDisk:
        # The claim is the read-only base; writes land in an overlay that goes with the VM.
        base = self._claim(volume, volume.source.claim_name, True, where, overlay=True)
        if base.type == "network":
            raise DiskkitError(where, "an ephemeral volume over a network (iSCSI/RBD) claim is not supported")
        return self._overlay(volume, Path(base.path), "raw")

    def _emptyDisk(self, volume: Volume, where: str) -> ResolvedDisk:
        size = storage.empty_disk_size(volume.source.capacity, volume.name)
        path = self.run_dir / "empty-disks" / f"{volume.name}.qcow2"
        if self.create:
            path.parent.mkdir(parents=True, exist_ok=True)
            qemuimg.create_image(path, "qcow2", size)
        return self._file_disk(path, "qcow2")

    def _hostDisk(self, volume: Volume, where: str) -> ResolvedDisk:
        source = volume.source
        path = Path(source.path)
        if not path.exists():
            if source.type != "DiskOrCreate":
                raise DiskkitError(f"{where}.path", f"hostDisk {source.path} does not exist (type {source.type})")
            if not source.capacity:
                raise DiskkitError(f"{where}.capacity", "required for type DiskOrCreate")
            if not path.parent.is_dir():
                raise DiskkitError(f"{where}.path", f"directory {path.parent} does not exist")
            if self.create:
                fitted = storage.fit(source.capacity, _free_bytes(path.parent), source.path, self.store.tolerance)
                self._note(fitted.note)
                _create_sparse(path, fitted.size)
        elif not (path.is_file() or _is_block(path)):
            raise DiskkitError(f"{where}.path", f"hostDisk {source.path} is not a regular file")
        return self._file_disk(path, "raw")

    # --- generated disks: cloud-init, config ISOs, downwardMetrics (launcher.gendisks) --------

    def _generated(self, plan: gendisks.Planned) -> ResolvedDisk:
        if self.create:
            gendisks.make(plan, _own)
        return self._file_disk(plan.path, "raw")

    @property
    def _generator(self) -> gendisks.Generator:
        sources = gendisks.Sources(self.store.objects, self.store.pod_config, self.store.service_account_dir)
        return gendisks.Generator(self.vmi, self.run_dir, sources)

    def _cloudInitNoCloud(self, volume: Volume, where: str) -> ResolvedDisk:
        return self._generated(self._generator.cloud_init(volume, where))

    _cloudInitConfigDrive = _cloudInitNoCloud

    def _configMap(self, volume: Volume, where: str) -> ResolvedDisk:
        return self._generated(self._generator.config(volume, where))

    _secret = _configMap

    def _serviceAccount(self, volume: Volume, where: str) -> ResolvedDisk:
        return self._generated(self._generator.service_account(volume, where))

    def _downwardAPI(self, volume: Volume, where: str) -> ResolvedDisk:
        return self._generated(self._generator.downward_api(volume, where))

    def _downwardMetrics(self, volume: Volume, where: str) -> ResolvedDisk:
        return self._generated(self._generator.downward_metrics(volume, where))

    # --- claims -------------------------------------------------------------------------------

    def _claim(self, volume: Volume, claim_name: str, read_only: bool, where: str, overlay: bool = False) -> ResolvedDisk:
        local = self.store.pvcs.get(claim_name)
        claim: Claim | None = None
        if self.store.objects is not None and local is None:
            claim = resolve_claim(self.store.objects, self.vmi.namespace, claim_name, where)
            remote = network_disk(self.store.objects, claim, where)
            if remote is not None:
                if overlay:
                    raise DiskkitError(where, f"claim {claim_name} is an {remote.source.protocol} volume; use it as a persistentVolumeClaim")
                if remote.secret_value is not None:
                    self.out.secrets.append((remote.source, remote.secret_value))
                return ResolvedDisk(remote.source.name, "raw", type="network", network=remote.source, read_only=read_only or remote.read_only)
            local = _pv_path(claim)
            read_only = read_only or claim.read_only  # a ReadOnlyMany claim is never written
        if local is None:
            mounted = self.store.pod_disks / volume.name
            device = Path("/dev") / volume.name
            if mounted.is_dir():
                local = LocalClaim(mounted)
            elif _is_block(device):
                local = LocalClaim(device)
            else:
                raise DiskkitError(where, f"claim {claim_name}: give --pvc {claim_name}=DIR|DEVICE, --manifests with a bound claim, or mount it at {mounted}")
        if _is_block(local.path):
            return self._file_disk(local.path, "raw", read_only=read_only)
        if not local.path.is_dir():
            raise DiskkitError(where, f"claim {claim_name}: {local.path} is neither a directory nor a block device")
        image = local.path / "disk.img"
        if not image.exists() and not overlay:
            size = local.size or storage.image_size(claim.request if claim else None, claim.capacity if claim else None)
            if size is None:
                raise DiskkitError(where, f"claim {claim_name}: {image} does not exist and no size is known (--pvc {claim_name}=DIR:SIZE)")
            if self.create:
                fitted = storage.fit(size, _free_bytes(local.path), volume.name, self.store.tolerance)
                self._note(fitted.note)
                _create_sparse(image, fitted.size)
        elif not image.exists():
            raise DiskkitError(where, f"claim {claim_name}: {image} does not exist; an ephemeral volume needs a filled claim")
        return self._file_disk(image, "raw", read_only=read_only)

    def _note(self, text: str | None) -> None:
        if text:
            self.out.notes.append(text)


def _pv_path(claim: Claim) -> LocalClaim | None:
    """hostPath and local PVs name a directory on this node: the claim's disk.img lives there."""
    spec = (claim.pv or {}).get("spec") or {}
    for key in ("hostPath", "local"):
        path = (spec.get(key) or {}).get("path")
        if path:
            return LocalClaim(Path(path))
    return None


def prepare(
    vmi: VMI,
    cache: Cache,
    run_dir: Path,
    registry: RegistryOptions | None = None,
    platform: Platform | None = None,
    create: bool = True,
    store: Storage | None = None,
    lazy: str = "off",
) -> Prepared:
    """Resolve every volume; with `create`, make the overlays and images under `run_dir` and in claims.

    Without `create` (the dry run of `launcher domain`) paths are planned, not made.
    """
    worker = _Preparer(vmi, cache, run_dir, registry, platform, create, store or Storage(), lazy)
    for volume in vmi.volumes:
        worker.out.disks[volume.name] = worker.resolve(volume, f"spec.volumes[{volume.index}]")
    boot = vmi.domain.firmware.kernel_boot if vmi.domain.firmware is not None else None
    if boot is not None and boot.container is not None:
        container = boot.container
        for attr, file_path in (("kernel", container.kernel_path), ("initrd", container.initrd_path)):
            if file_path:
                pulled = pull(cache, container.image, file_path, platform, registry, container.image_pull_policy, disk=False)
                worker.out.pulled.append(pulled)
                setattr(worker.out, attr, str(pulled.path))
    return worker.out

"""Make a VMI's volumes real: the files and devices libvirt opens, created the way KubeVirt does.

One function per volume kind (KubeVirt's key), each in the module of its kind: containerDisks
(launcher.volumes.containerdisk), claims (claims), emptyDisk and hostDisk (localdisks), and the
generated cloud-init, config and metrics disks (gendisks). A volume a filesystem uses is a directory
instead (filesystems).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from diskkit.errors import DiskkitError
from diskkit.oci.image import Platform
from diskkit.registry.options import RegistryOptions
from launcher.node.cache import Cache
from launcher.render.domain import ResolvedDisk
from launcher.spec import hooks
from launcher.spec.gates import admit_downward_metrics, admit_host_disks, admit_persistent_reservation
from launcher.spec.vmi import VMI, Volume
from launcher.volumes import claims, filesystems, gendisks, localdisks, vmstate
from launcher.volumes.containerdisk import container_disk, kernel_boot
from launcher.volumes.context import Context, Prepared
from launcher.volumes.files import KUBEVIRT_QEMU, file_disk, give_to_qemu
from launcher.volumes.guestplatform import check_requested
from launcher.volumes.storage import Storage

Handler = Callable[[Context, Volume, str], ResolvedDisk]


def _generated(plan_of: Callable[[gendisks.Generator, Volume, str], gendisks.Planned]) -> Handler:
    def handler(ctx: Context, volume: Volume, where: str) -> ResolvedDisk:
        sources = gendisks.Sources(ctx.store.objects, ctx.store.pod_config, ctx.store.service_account_dir)
        plan = plan_of(gendisks.Generator(ctx.vmi, ctx.run_dir, sources), volume, where)
        if ctx.create:
            gendisks.make(plan, ctx.run_dir, give_to_qemu)
        return file_disk(plan.path, "raw")
    return handler


HANDLERS: dict[str, Handler] = {
    "containerDisk": container_disk,
    "persistentVolumeClaim": claims.persistent_volume_claim,
    "dataVolume": claims.data_volume,
    "ephemeral": claims.ephemeral,
    "emptyDisk": localdisks.empty_disk,
    "hostDisk": localdisks.host_disk,
    "cloudInitNoCloud": _generated(gendisks.Generator.cloud_init),
    "cloudInitConfigDrive": _generated(gendisks.Generator.cloud_init),
    "configMap": _generated(gendisks.Generator.config),
    "secret": _generated(gendisks.Generator.config),
    "serviceAccount": _generated(gendisks.Generator.service_account),
    "downwardAPI": _generated(gendisks.Generator.downward_api),
    "downwardMetrics": _generated(gendisks.Generator.downward_metrics),
    "sysprep": _generated(gendisks.Generator.sysprep),
}


def admit(vmi: VMI, store: Storage) -> None:
    """What the node's admin must allow before any volume is touched (KubeVirt's admission with its gates)."""
    admit_host_disks(vmi.volumes, store.gates)
    admit_downward_metrics(vmi, store.gates)
    admit_persistent_reservation(vmi, store.gates)
    hooks.sidecars(vmi.annotations, store.gates, vmi.from_vm)


def prepare(
    vmi: VMI,
    cache: Cache,
    run_dir: Path,
    registry: RegistryOptions | None = None,
    platform: Platform | None = None,
    create: bool = True,
    store: Storage | None = None,
    lazy: str = "off",
    qemu_uid: int | None = None,
    qemu: tuple[int, int] = KUBEVIRT_QEMU,
    pins: dict | None = None,
    update: bool = False,
    image_volumes: Path | None = None,
    kernel_boot_dir: Path | None = None,
    pull_policy: str | None = None,
    trace: str | None = None,
) -> Prepared:
    """Resolve every volume; with `create`, make the overlays and images under `run_dir` and in claims.

    Without `create` (the dry run of `launcher domain`) paths are planned, not made; images are
    pulled, or opened on the node's disk server when lazy, so the domain shows what a run would use.
    `pins` (a VirtualMachine's, launcher.node.pins) are booted unless `update`; `image_volumes` and
    `kernel_boot_dir` are where the pod mounts the containerDisks' and the kernelBoot container's
    images (launcher.volumes.imagevolume); `pull_policy` replaces every image's imagePullPolicy;
    `trace`: the token under which the node's disk server records each lazy containerDisk's reads.
    """
    check_requested(platform)
    ctx = Context(vmi, cache, run_dir, registry, platform, create, store or Storage(), lazy, qemu_uid, qemu, pins=pins, update=update,
                  image_volumes=image_volumes, kernel_boot_dir=kernel_boot_dir, pull_policy=pull_policy, trace=trace)
    admit(vmi, ctx.store)
    shared = {fs.name for fs in vmi.domain.devices.filesystems}
    for volume in vmi.volumes:
        where = f"spec.volumes[{volume.index}].{volume.kind}"
        if volume.name in shared:
            ctx.out.shares[volume.name] = filesystems.share(ctx, volume, where)
            continue
        handler = HANDLERS.get(volume.kind)
        if handler is None:
            raise DiskkitError(where, "this volume type is not supported by the launcher yet")
        ctx.out.disks[volume.name] = handler(ctx, volume, where)
    kernel_boot(ctx)
    vmstate.prepare(ctx)
    return ctx.out

"""containerDisk volumes and kernelBoot artifacts: pulled once per node, or served lazily by the node's
disk server, and given to each VM through its own qcow2 overlay (N VMs cost one base plus N overlays)."""

from __future__ import annotations

from diskkit.disk import qemuimg
from launcher.diskserver.client import Attached, attach, files
from launcher.node.cache import within
from launcher.node.pull import default_policy, pull
from launcher.render.domain import ResolvedDisk
from launcher.spec.k8s import NetworkSource
from launcher.spec.vmi import Volume
from launcher.volumes.context import Context
from launcher.volumes.files import block_io, direct_io_supported, overlay


def container_disk(ctx: Context, volume: Volume, where: str) -> ResolvedDisk:
    source = volume.source
    if ctx.lazy != "off":
        policy = source.image_pull_policy or default_policy(source.image)
        attached = attach(ctx.cache, source.image, source.path, ctx.platform, ctx.registry, ctx.lazy, policy, ctx.out.notes,
                          vm=ctx.create, qemu_uid=ctx.qemu_uid)
        if attached is not None:
            ctx.out.pulled.append(attached.pulled)
            return _nbd_overlay(ctx, volume, attached)
    base = pull(ctx.cache, source.image, source.path, ctx.platform, ctx.registry, source.image_pull_policy)
    ctx.out.pulled.append(base)
    return overlay(within(ctx.run_dir, volume.name, "disk.qcow2"), base.path, base.format, ctx.create)


def _nbd_overlay(ctx: Context, volume: Volume, attached: Attached) -> ResolvedDisk:
    """The overlay over a disk the node's disk server exports (a lazy containerDisk); planned only
    without `create` (the dry run shows the export and socket the VM would use)."""
    path = within(ctx.run_dir, volume.name, "disk.qcow2")
    probe = path
    if ctx.create:
        path.parent.mkdir(parents=True, exist_ok=True)
        qemuimg.create_overlay(attached.url, attached.format, path, size=attached.virtual_size)
    else:
        while not probe.exists():
            probe = probe.parent  # where the overlay would be made: the same filesystem
    export = NetworkSource("nbd", attached.export, (), socket=attached.socket)
    return ResolvedDisk(str(path), "qcow2", backing=(attached.url, attached.format), direct_io=direct_io_supported(probe),
                        backing_type="network", backing_network=export, block_io=block_io(path))


def kernel_boot(ctx: Context) -> None:
    """firmware.kernelBoot.container: the kernel and initrd pulled from their image into the cache, or
    from a lazy image taken out of it by the node's disk server, its disk's chunks left where they are."""
    boot = ctx.vmi.domain.firmware.kernel_boot if ctx.vmi.domain.firmware is not None else None
    if boot is None or boot.container is None:
        return
    container = boot.container
    wanted = [(attr, path) for attr, path in (("kernel", container.kernel_path), ("initrd", container.initrd_path)) if path]
    fetched = None
    if ctx.lazy != "off":
        policy = container.image_pull_policy or default_policy(container.image)
        fetched = files(ctx.cache, container.image, [path for _, path in wanted], ctx.platform, ctx.registry, ctx.lazy, policy, ctx.out.notes)
    for attr, file_path in wanted:
        pulled = fetched[file_path] if fetched else pull(ctx.cache, container.image, file_path, ctx.platform, ctx.registry,
                                                         container.image_pull_policy, disk=False)
        ctx.out.pulled.append(pulled)
        setattr(ctx.out, attr, str(pulled.path))

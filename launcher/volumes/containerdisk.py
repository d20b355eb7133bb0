"""containerDisk volumes and kernelBoot artifacts: pulled once per node, or served lazily by the node's
disk server, and given to each VM through its own qcow2 overlay (N VMs cost one base plus N overlays)."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Iterator

from diskkit.disk import qemuimg
from diskkit.errors import AuthError, DiskkitError
from diskkit.oci.image import Platform
from diskkit.oci.reference import parse_ref
from diskkit.progress import NoteReporter
from diskkit.registry.authfile import in_config
from diskkit.registry.options import RegistryOptions
from launcher.diskserver.client import Attached, attach, files
from launcher.node.cache import within
from launcher.node.pins import Pin, pinnable, resolved
from launcher.node.pull import default_policy, pull
from launcher.render.domain import ResolvedDisk
from launcher.spec.k8s import NetworkSource, pull_secret_config
from launcher.spec.vmi import Volume
from launcher.volumes import imagevolume
from launcher.volumes.context import Context
from launcher.volumes.files import block_io, direct_io_supported, overlay
from launcher.volumes.guestplatform import check_config, check_image


# The kernelBoot container's image is pinned under KubeVirt's name for its volume (KernelBootVolumeName
# in pkg/container-disk/container-disk.go, which keys it beside the containerDisks' volumes too).
KERNEL_BOOT_PIN = "kernel-boot-volume"


def container_disk(ctx: Context, volume: Volume, where: str) -> ResolvedDisk:
    source = volume.source
    if ctx.image_volumes is not None:
        return image_volume_overlay(ctx, volume, where)
    registry, why_not = pull_options(ctx, source.image, source.image_pull_secret, f"{where}.imagePullSecret")
    # Every error about the image, its reference's own included, names the VMI field it came from.
    with image_field(f"{where}.image", why_not):
        policy = _policy(ctx, source.image, source.image_pull_policy)
        ref, pin = _pinned(ctx, volume.name, source.image)
        with _pin_hint(pin):
            if ctx.lazy != "off":
                attached = attach(ctx.cache, ref, source.path, ctx.platform, registry, ctx.lazy, policy, ctx.out.notes,
                                  vm=ctx.create, qemu_uid=ctx.qemu_uid, trace=ctx.trace if ctx.create else None)
                if attached is not None:
                    check_image(ctx.cache, attached.pulled)
                    ctx.out.pulled.append(attached.pulled)
                    _record_pin(ctx, volume.name, source.image, attached.pulled.digest, pin)
                    return _nbd_overlay(ctx, volume, attached)
            base = pull(ctx.cache, ref, source.path, ctx.platform, registry, policy,
                        accept=check_config(str(parse_ref(source.image))), reporter=NoteReporter(ctx.note))
            check_image(ctx.cache, base)  # a disk the cache already held
    ctx.out.pulled.append(base)
    _record_pin(ctx, volume.name, source.image, base.digest, pin)
    return overlay(within(ctx.run_dir, volume.name, "disk.qcow2"), base.path, base.format, ctx.create)


def _policy(ctx: Context, image: str, given: str | None) -> str:
    """--pull-policy, else the pull policy of the image as written, also for its pinned digest (KubeVirt
    defaults it from the tag before a migration target's pod gets the digest). KubeVirt hands it to the
    kubelet as the policy of the pod's image (pkg/container-disk/container-disk.go and
    pkg/virt-controller/services/rendervolumes.go; defaults in pkg/defaults/defaults.go)."""
    policy = ctx.pull_policy or given or default_policy(image)
    if ctx.update and ctx.pins is not None and pinnable(image) and policy != "Never":
        return "Always"  # --update asks the registry where the tag is now, not the node's memory of it
    return policy


def _platform_text(ctx: Context) -> str:
    return str(ctx.platform or Platform.host())


def _pinned(ctx: Context, volume: str, image: str) -> tuple[str, Pin | None]:
    """What to pull for a VirtualMachine's volume: the digest its tag was pinned to by an earlier run,
    while the spec names the same image for the same platform and no --update asks for the tag."""
    if ctx.pins is None or not pinnable(image):
        return image, None
    pin = ctx.pins.get(volume)
    if pin is None or ctx.update or (pin.image, pin.platform) != (image, _platform_text(ctx)):
        return image, None
    # Said every time: whoever moved the tag expects the new image, and this is why it does not boot.
    ctx.note(f"{image} boots {pin.digest}, the digest it named at this VirtualMachine's first run; launcher run --update resolves the tag again")
    return pin.pinned, pin


def _record_pin(ctx: Context, volume: str, image: str, digest: str, old: Pin | None) -> None:
    if ctx.pins is not None and pinnable(image):
        ctx.out.pins[volume] = resolved(old or ctx.pins.get(volume), image, digest, _platform_text(ctx))


@contextlib.contextmanager
def _pin_hint(pin: Pin | None) -> Iterator[None]:
    """A pinned digest that cannot be had any more (deleted from the registry) says how to move on."""
    try:
        yield
    except DiskkitError as exc:
        if pin is not None:
            exc.rule = f"{exc.rule}; {pin.image} was pinned to {pin.digest} by this VirtualMachine's first run: launcher run --update resolves the tag again"
            exc.args = (exc.line(),)
        raise


def image_volume_overlay(ctx: Context, volume: Volume, where: str) -> ResolvedDisk:
    """The disk of the image the pod mounted for this volume, as KubeVirt 1.9's virt-launcher finds it,
    under the VM's own overlay: nothing is pulled."""
    found = imagevolume.find_disk(ctx.image_volumes, volume.index, volume.source.path, where)
    return overlay(within(ctx.run_dir, volume.name, "disk.qcow2"), found.path, found.format, ctx.create)


@contextlib.contextmanager
def image_field(at: str, why_not: str | None = None) -> Iterator[None]:
    """A pull's error names the VMI field of the image first (`spec.volumes[0].containerDisk.image: ...`),
    and a refused pull says why the pull secret gave no credentials."""
    try:
        yield
    except DiskkitError as exc:
        exc.subject = f"{at}: {exc.subject}" if exc.subject else at
        if why_not and isinstance(exc, AuthError):
            exc.rule = f"{exc.rule}; {why_not}"
        exc.args = (exc.line(),)
        raise


def pull_options(ctx: Context, image: str, secret: str | None, at: str) -> tuple[RegistryOptions | None, str | None]:
    """The registry options of one image's pulls: with an imagePullSecret that has an entry for the
    image's registry, that entry alone (the kubelet tries the pod's pull secrets before the node's
    credentials); without one, the node's. KubeVirt puts each volume's secret on its pod
    (pkg/virt-controller/services/rendervolumes.go); here it serves that volume's image only."""
    if not secret:
        return ctx.registry, None
    config, why_not = pull_secret_config(ctx.store.objects, ctx.vmi.namespace, secret, at)
    ctx.note(why_not)
    ref = parse_ref(image)
    if config is None or ref.transport != "docker" or ref.name is None:
        return ctx.registry, why_not
    creds = in_config(config, ref.name.registry, f"secret {ctx.vmi.namespace}/{secret}")
    if creds is None:
        return ctx.registry, f"{at}: secret {ctx.vmi.namespace}/{secret} has no entry for {ref.name.registry}"
    return replace(ctx.registry or RegistryOptions(), inline_credentials=((ref.name.registry, creds),)), None


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
    at = "spec.domain.firmware.kernelBoot.container"
    if ctx.kernel_boot_dir is not None:  # the pod mounted the image: nothing to pull or pin
        for attr, path in (("kernel", container.kernel_path), ("initrd", container.initrd_path)):
            if path:
                field = "kernelPath" if attr == "kernel" else "initrdPath"
                setattr(ctx.out, attr, str(imagevolume.find_file(ctx.kernel_boot_dir, path, f"{at}.{field}")))
        return
    registry, why_not = pull_options(ctx, container.image, container.image_pull_secret, f"{at}.imagePullSecret")
    ref, pin = _pinned(ctx, KERNEL_BOOT_PIN, container.image)
    with image_field(f"{at}.image", why_not), _pin_hint(pin):
        _kernel_boot_files(ctx, container, ref, _policy(ctx, container.image, container.image_pull_policy), registry)
    if ctx.out.kernel or ctx.out.initrd:
        _record_pin(ctx, KERNEL_BOOT_PIN, container.image, ctx.out.pulled[-1].digest, pin)


def _kernel_boot_files(ctx: Context, container, ref: str, policy: str, registry) -> None:
    wanted = [(attr, path) for attr, path in (("kernel", container.kernel_path), ("initrd", container.initrd_path)) if path]
    fetched = None
    if ctx.lazy != "off":
        fetched = files(ctx.cache, ref, [path for _, path in wanted], ctx.platform, registry, ctx.lazy, policy, ctx.out.notes)
    for attr, file_path in wanted:
        pulled = fetched[file_path] if fetched else pull(ctx.cache, ref, file_path, ctx.platform, registry, policy, disk=False,
                                                         reporter=NoteReporter(ctx.note))
        ctx.out.pulled.append(pulled)
        setattr(ctx.out, attr, str(pulled.path))

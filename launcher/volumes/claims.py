"""persistentVolumeClaim, dataVolume and ephemeral volumes: a claim found on this node and made a disk.

A claim is a directory holding `disk.img` (created sparse by KubeVirt's sizing rules when missing), a
block device, or, with manifests, a bound iSCSI or RBD PersistentVolume that qemu reaches over the network.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from diskkit.errors import DiskkitError
from launcher.node.cache import within
from launcher.render.domain import ResolvedDisk
from launcher.spec.k8s import Claim, claim_sizes, network_disk, resolve_claim
from launcher.spec.vmi import Volume
from launcher.volumes import sizing
from launcher.volumes.context import Context
from launcher.volumes.files import (
    claim_image,
    create_sparse,
    file_disk,
    free_bytes,
    give_claim_image,
    is_block,
    overlay,
)
from launcher.volumes.storage import LocalClaim, pv_path


def persistent_volume_claim(ctx: Context, volume: Volume, where: str) -> ResolvedDisk:
    # The claim's readOnly is how the pod mounts it; the guest's <readonly/> comes from the disk's own
    # readOnly alone (storage/disk.go), so a read-only claim on the default sata bus is fine.
    return claim_disk(ctx, volume, volume.source.claim_name, where)


def data_volume(ctx: Context, volume: Volume, where: str) -> ResolvedDisk:
    # A DataVolume is used through the claim of the same name, once filled (launcher.datavolumes).
    return claim_disk(ctx, volume, volume.source.name, where)


def ephemeral(ctx: Context, volume: Volume, where: str) -> ResolvedDisk:
    # The claim is the read-only base; writes land in an overlay that goes with the VM.
    base = claim_disk(ctx, volume, volume.source.claim_name, where, as_base=True)
    if base.type == "network":
        raise DiskkitError(where, "an ephemeral volume over a network (iSCSI/RBD) claim is not supported")
    disk = overlay(within(ctx.run_dir, volume.name, "disk.qcow2"), Path(base.path), "raw", ctx.create)
    return replace(disk, backing_relabel=base.relabel)


def claim_disk(ctx: Context, volume: Volume, claim_name: str, where: str, as_base: bool = False) -> ResolvedDisk:
    store = ctx.store
    local = store.pvcs.get(claim_name)
    claim: Claim | None = None
    if store.objects is not None and local is None:
        claim = resolve_claim(store.objects, ctx.vmi.namespace, claim_name, where)
        remote = network_disk(store.objects, claim, where)
        if remote is not None:
            if as_base:
                raise DiskkitError(where, f"claim {claim_name} is an {remote.source.protocol} volume; use it as a persistentVolumeClaim")
            if remote.secret_value is not None:
                ctx.out.secrets.append((remote.source, remote.secret_value))
            return ResolvedDisk(remote.source.name, "raw", type="network", network=remote.source, read_only=remote.read_only)
        local = pv_path(claim)
    if local is None:
        mounted = store.pod_disks / volume.name
        device = Path("/dev") / volume.name
        if mounted.is_dir():
            local = LocalClaim(mounted)
        elif is_block(device):
            local = LocalClaim(device)
        else:
            raise DiskkitError(where, f"claim {claim_name}: give --pvc {claim_name}=DIR|DEVICE, --manifests with a bound claim, or mount it at {mounted}")
    if is_block(local.path):
        return file_disk(local.path, "raw")
    if not local.path.is_dir():
        raise DiskkitError(where, f"claim {claim_name}: {local.path} is neither a directory nor a block device")
    image = local.path / "disk.img"
    found = claim_image(image)
    if not found and not as_base:
        # --pvc's SIZE is the claim's request; else the claim object says (bound, or found in --manifests
        # beside a --pvc directory or a mount in the pod).
        if local.size:
            request, capacity = local.size, None
        else:
            request, capacity = (claim.request, claim.capacity) if claim else (None, None)
        if not request and not capacity and store.objects is not None:
            request, capacity = claim_sizes(store.objects, ctx.vmi.namespace, claim_name, where) or (None, None)
        if not request and not capacity:
            raise DiskkitError(where, f"claim {claim_name}: {image} does not exist and no size is known (--pvc {claim_name}=DIR:SIZE, or the claim in --manifests)")
        size = sizing.claim_image_size(request, capacity, volume.name)
        if ctx.create:
            fitted = sizing.fit(size, free_bytes(local.path), volume.name, store.tolerance, path=str(image))
            ctx.note(fitted.note)
            create_sparse(image, fitted.size)
    elif not found:
        raise DiskkitError(where, f"claim {claim_name}: {image} does not exist; an ephemeral volume needs a filled claim")
    if ctx.create:
        give_claim_image(image, ctx.qemu)
    return file_disk(image, "raw", relabel=False)

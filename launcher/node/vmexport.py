"""A KubeVirt VM export (diskkit.oci.vmexport) made runnable on this node: its VirtualMachine and one
claim-like directory per disk, each layer streamed from the source, zstd-decompressed and written
sparse as the bytes arrive, its digest checked before the directory is renamed into place.

    <cache>/exports/<manifest hex>/vm.json              the export's config, as it came
    <cache>/exports/<manifest hex>/claims/<disk>/disk.img  one claim per disk layer

Keyed by the manifest's digest, which pins every byte: a second run of the same export finds its
claims there and, as a claim does, keeps what the VM wrote to them (hack/oci-import.sh uploads each
disk into a new claim once, too). `launcher gc` removes an export as it removes a disk: when no
running VM's record names it and no launcher is between making it and recording its VM (the
`export-use-<hex>` lock, held shared from before the export is looked at until the process ends).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from diskkit import limits
from diskkit.errors import DiskkitError
from diskkit.oci import vmexport as layout
from diskkit.oci.image import Descriptor, Platform, check_digest, parse_json
from diskkit.registry.options import RegistryOptions
from diskkit.streams.compression import decompressing_reader
from diskkit.streams.fsutil import fsync_dir, fsync_tree
from diskkit.streams.sparse import SparseWriter
from launcher.node.admission import admitted
from launcher.node.cache import Cache, tree_size

# The use locks this process holds (see the docstring): released when it exits, with the VM recorded by then.
_IN_USE = contextlib.ExitStack()
CHUNK = 1 << 20
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")  # a DNS-1123 subdomain, as metadata.name
_SUFFIXES = {"": 1, "k": 1000, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}


@dataclass(frozen=True)
class Materialized:
    vm_file: Path
    claims: dict[str, Path]  # claim name -> its directory (disk.img inside)
    digest: str


def quantity_bytes(text: str) -> int | None:
    """io.kubevirt.disk.size as KubeVirt writes it (diskkit.oci.vmexport.binary_quantity); None otherwise."""
    number = text.rstrip("kKiMGTPE")
    suffix = text[len(number):]
    if not number.isdigit() or suffix not in _SUFFIXES:
        return None
    return int(number) * _SUFFIXES[suffix]


def stated_size(disk: layout.ExportDisk, where: str) -> int:
    """The disk's size as its io.kubevirt.disk.size annotation states it: what its claim is made with
    (hack/oci-import.sh passes it to the upload as --size) and so all its layer may inflate to."""
    said = (disk.layer.get("annotations") or {}).get(layout.ANNOTATION_DISK_SIZE, "")
    size = quantity_bytes(said) if isinstance(said, str) else None
    if size is None:
        raise DiskkitError(where, f"its {layout.ANNOTATION_DISK_SIZE} annotation {said!r} is not a size: "
                                  "nothing would bound what its layer inflates to; refused")
    return size


def _write_disk(source, disk: layout.ExportDisk, target: Path, where: str, expected: int) -> int:
    desc = Descriptor.from_json(disk.layer, where)
    written = 0
    with source.blob(desc) as blob, open(target, "xb") as out:
        # Inflated no further than the annotation says and a byte: a small layer cannot fill the cache.
        plain = limits.AtMost(decompressing_reader(blob, "zstd", where), expected, where,
                              f"inflates to more than the {expected} bytes its {layout.ANNOTATION_DISK_SIZE} annotation says; refused")
        sink = SparseWriter(out)
        while chunk := plain.read(CHUNK):
            sink.write(chunk)
            written += len(chunk)
        # read to its end, where the digest is checked: bytes after the last frame are the blob's too
        while blob.read(CHUNK):
            pass
        out.truncate(written)
        out.flush()
        os.fsync(out.fileno())
    return written


def materialize(cache: Cache, ref: str, registry: RegistryOptions | None, platform: Platform | None, own_spec: bool = False) -> Materialized:
    """The export at `ref` on this node; refused in one line when it is not one or cannot be mapped,
    or, unless the user runs its disks under a spec of their own (`own_spec`), when its VirtualMachine
    names anything beyond the export's own disks (diskkit.oci.vmexport.check_own_only)."""
    with admitted(ref, registry, platform, cache) as source:  # the policy first: before any layer is read
        image = source.image(platform)
        manifest = parse_json(image.manifest_bytes, ref)
        if not layout.is_vm_export(manifest):
            raise DiskkitError(ref, f"is not a KubeVirt VM export (artifactType {manifest.get('artifactType')!r}, "
                                    f"not {layout.ARTIFACT_TYPE_VM}): give it as a containerDisk in a VM instead")
        disks = layout.export_disks(manifest, ref)
        vm = parse_json(image.config_bytes, f"{ref}: config")
        claims = layout.map_claims(vm, disks, ref)
        if not own_spec:
            layout.check_own_only(vm, ref)
        sizes = {d.name: stated_size(d, f"{ref}: disk {d.name}") for d in claims.values()}  # before any layer is read
        hexpart = check_digest(image.digest, ref)
        final = cache.root / "exports" / hexpart
        used = {d.name for d in claims.values()}
        result = Materialized(final / "vm.json", {claim: final / "claims" / d.name for claim, d in claims.items()}, image.digest)
        _IN_USE.enter_context(cache.lock(f"export-use-{hexpart}", shared=True))
        with cache.lock(f"export-{hexpart}"):
            if final.is_dir():
                os.utime(final / "vm.json")  # its last use, for gc --max-size
                return result
            with cache.staging() as staging:
                top = staging / hexpart
                top.mkdir(mode=0o711)
                (top / "claims").mkdir(mode=0o711)
                for disk in disks:
                    if disk.name not in used:
                        continue  # as hack/oci-import.sh, a disk no volume names is not a claim of this VM
                    where = f"{ref}: disk {disk.name}"
                    claim_dir = top / "claims" / disk.name
                    claim_dir.mkdir(mode=0o711)
                    size = _write_disk(source, disk, claim_dir / "disk.img", where, sizes[disk.name])
                    if size != sizes[disk.name]:
                        said = disk.layer["annotations"][layout.ANNOTATION_DISK_SIZE]
                        raise DiskkitError(where, f"is {size} bytes; its {layout.ANNOTATION_DISK_SIZE} annotation says {said}")
                with open(top / "vm.json", "xb") as f:
                    f.write(image.config_bytes)
                fsync_tree(top)
                os.rename(top, final)
                fsync_dir(final.parent)
        return result


def listing(cache: Cache, vms: list[dict]) -> list[dict]:
    """Each VM export on this node for `launcher ls`: its manifest, its VirtualMachine's name, the
    space its claims take and the recorded VMs (`vms`, with their entries) that use it."""
    found = []
    for export in cache.exports():
        try:
            name = (json.loads((export / "vm.json").read_bytes()).get("metadata") or {}).get("name")
            claims = sorted(p.name for p in (export / "claims").iterdir())
        except (OSError, ValueError, AttributeError):
            continue  # removed by a gc meanwhile, or not one materialize made
        # the name as the export states it, not yet validated: printed only when it is one a VM may have
        shown = name if isinstance(name, str) and _NAME.fullmatch(name) else None
        found.append({"path": str(export), "manifest": f"sha256:{export.name}", "vm": shown, "claims": claims,
                      "size": tree_size(export), "usedBy": [vm["domain"] for vm in vms if str(export) in vm.get("entries", [])]})
    return found

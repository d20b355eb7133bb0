"""`diskkit export`: a VirtualMachine and its claims' disks as KubeVirt's OCI VM export
(diskkit.oci.vmexport), each disk read once: hashed, zstd-compressed and written in one pass.

An OCI layout (oci:, oci-archive:) gets KubeVirt's index.json itself, as `virtctl vmexport download
--format=oci` saves it; a registry gets that index pushed as the tag's index over the manifest, so
`launcher run docker://...` and `skopeo copy --multi-arch=all` see what the tar holds.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from diskkit.errors import DiskkitError
from diskkit.layers.rawblob import write_blob
from diskkit.oci import mediatypes as mt
from diskkit.oci import vmexport as layout
from diskkit.oci.image import rfc3339, sha256_digest
from diskkit.oci.reference import parse_ref
from diskkit.progress import Reporter
from diskkit.registry.options import RegistryOptions
from diskkit.transports import open_destination
from diskkit.transports.base import with_restarts

MAX_VM_FILE = 3 << 20


@dataclass(frozen=True)
class Exported:
    digest: str  # the manifest's
    index_digest: str
    disks: list[dict]

    def to_json(self) -> dict:
        return {"manifest": self.digest, "index": self.index_digest, "disks": self.disks}


def read_vm(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_VM_FILE + 1)
    except OSError as exc:
        raise DiskkitError(path, f"cannot be read ({exc.strerror})") from None
    if len(data) > MAX_VM_FILE:
        raise DiskkitError(path, "is larger than 3 MiB")
    try:
        # the config is written out expanded: an alias would multiply it (a "billion laughs" file)
        if any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(data)):
            raise DiskkitError(path, "uses a YAML alias (*name): write the VirtualMachine out in full")
        docs = [d for d in yaml.safe_load_all(data) if d is not None]
    except yaml.YAMLError as exc:
        raise DiskkitError(path, f"is not YAML ({str(exc).splitlines()[0]})") from None
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise DiskkitError(path, "must hold one VirtualMachine object")
    return docs[0]


def disk_file(claim: str, where: Path, kind: str) -> Path:
    """A claim's disk: a directory's disk.img (collectDiskInfo), or a file or block device itself."""
    path = where / "disk.img" if kind == "pvc" and where.is_dir() else where
    try:
        # whoever writes the claim may have put a link there: its target is not the claim's disk
        mode = (os.lstat if path.name == "disk.img" and kind == "pvc" else os.stat)(path).st_mode
    except OSError as exc:
        raise DiskkitError(f"--{kind} {claim}={where}", f"{path} cannot be read ({exc.strerror})") from None
    if stat.S_ISBLK(mode):
        raise DiskkitError(f"--{kind} {claim}={where}", "block devices are not exported yet: give a file")
    if not stat.S_ISREG(mode):
        raise DiskkitError(f"--{kind} {claim}={where}", f"{path} is not a regular file")
    return path


def export(vm_path: Path, disks: dict[str, tuple[Path, str]], dest: str, registry: RegistryOptions | None,
           reporter: Reporter, created: int | None = None) -> Exported:
    """`disks`: claim name -> (path, "pvc" or "disk"). Every claim the VM's volumes name must be given."""
    vm = read_vm(vm_path)
    config_obj = layout.vm_config(vm, str(vm_path))
    wanted = layout.claim_names(config_obj)
    for claim in wanted:
        if claim not in disks:
            raise DiskkitError(str(vm_path), f"volume claim {claim!r} has no disk: give --pvc {claim}=DIR or --disk {claim}=FILE")
    for claim in disks:
        if claim not in wanted:
            raise DiskkitError(f"--{disks[claim][1]} {claim}", f"no volume of {vm_path} uses claim {claim!r}")
    names = {claim: layout.disk_name(claim, f"--{disks[claim][1]} {claim}") for claim in wanted}
    if len(set(names.values())) != len(names):
        raise DiskkitError(str(vm_path), "two claims differ only in dots and dashes: their export disks would share a name")
    files = {claim: disk_file(claim, *disks[claim]) for claim in wanted}
    ref = parse_ref(dest)
    if ref.transport not in ("docker", "oci", "oci-archive"):
        raise DiskkitError(dest, "a VM export is written to docker://, oci: or oci-archive:")
    if ref.transport == "oci" and Path(ref.path).exists():
        raise DiskkitError(dest, "exists: a VM export is a layout of its own (index.json is KubeVirt's)")
    when = rfc3339(int(time.time()) if created is None else created)
    arch = layout.architecture(vm)

    layers: list[dict] = []
    shown: list[dict] = []
    with open_destination(ref, opts=registry) as target:
        for claim in wanted:
            name, path = names[claim], files[claim]
            size = path.stat().st_size

            def send(path=path, name=name, size=size):
                with target.blob_writer(layout.MEDIA_TYPE_DISK_RAW_ZSTD) as pending, reporter.task(f"{name}.raw.zst", size) as task:
                    result = write_blob(path, pending, "zstd", None, task.advance)
                    pending.commit(result.digest, result.size)
                return result

            blob = with_restarts(send, reporter, f"disk {name}")
            reporter.event({"event": "blob", "digest": blob.digest, "size": blob.size, "status": "uploaded"})
            layers.append(layout.disk_descriptor(name, blob.digest, blob.size, size))
            shown.append({"claim": claim, "name": name, "digest": blob.digest, "size": blob.size, "diskSize": size})
        config_data = layout.go_json(config_obj)
        config = target.put_blob(config_data, layout.MEDIA_TYPE_VM_CONFIG)
        manifest = layout.manifest(layout.descriptor(config.media_type, config.digest, config.size), layers)
        if ref.transport == "docker":
            target.put_manifest(manifest, mt.OCI_MANIFEST, child=True)
            index = layout.index(sha256_digest(manifest), len(manifest), arch, when)
            target.put_manifest(index, mt.OCI_INDEX)
        else:
            target.put_blob(manifest, mt.OCI_MANIFEST)
            index = layout.index(sha256_digest(manifest), len(manifest), arch, when, ref.tag)
            target.layout_index = index
    return Exported(sha256_digest(manifest), sha256_digest(index), shown)

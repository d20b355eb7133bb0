"""KubeVirt's VM exports as OCI images (pure rules): the layout `virtctl vmexport download --format=oci`
gives, and how an export's disks map back to the VM's volumes.

The layout follows kubevirt pkg/storage/oci/oci.go (Builder): an OCI layout whose index.json lists one
image manifest (artifactType application/vnd.kubevirt.virtualmachine.v1, platform linux/<arch>, the
index annotated with its creation time); the manifest's config is the VM's JSON as
pkg/storage/export/virt-exportserver/oci.go prepareVMConfig makes it (no namespace, no
dataVolumeTemplates, each dataVolume volume turned into the claim of its name) and each layer one
claim's disk, zstd-compressed, named by annotations. The JSON is Go's encoding/json of the image-spec
structs: fields in struct order, no spaces, map keys sorted, <, > and & escaped, which `go_json` repeats
so the manifest and index are byte for byte what KubeVirt writes for the same inputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from diskkit.errors import DiskkitError
from diskkit.oci import mediatypes as mt

ARTIFACT_TYPE_VM = "application/vnd.kubevirt.virtualmachine.v1"
MEDIA_TYPE_VM_CONFIG = "application/vnd.kubevirt.virtualmachine.config.v1+json"
MEDIA_TYPE_DISK_RAW_ZSTD = "application/vnd.kubevirt.disk.raw+zstd"
ANNOTATION_DISK_NAME = "io.kubevirt.disk.name"
ANNOTATION_DISK_SIZE = "io.kubevirt.disk.size"
ANNOTATION_TITLE = "org.opencontainers.image.title"
ANNOTATION_CREATED = "org.opencontainers.image.created"
# DNS1035LabelMaxLength: longer claim names are hashed by the export pod (export.go,
# getExportPodVolumeNameFromStr), a name nobody can map back without the cluster.
NAME_MAX = 63


def go_json(obj: object) -> bytes:
    """Go encoding/json's bytes for `obj` (dicts keep their order; callers sort maps Go would sort)."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escaped)
    return text.encode()


def binary_quantity(size: int) -> str:
    """resource.NewQuantity(size, BinarySI).String(): Ki..Ei when a power of 1024 divides it exactly."""
    if size == 0:
        return "0"
    if size < 1024:
        # CanonicalizeBytes shows these as DecimalSI: 1000 is "1k", 512 stays "512"
        number, exp = size, 0
        while number % 1000 == 0 and number:
            number //= 1000
            exp += 1
        return f"{number}{['', 'k'][exp]}"
    number, exp = size, 0
    while number % 1024 == 0 and exp < 6:
        number //= 1024
        exp += 1
    return f"{number}{['', 'Ki', 'Mi', 'Gi', 'Ti', 'Pi', 'Ei'][exp]}"


def disk_name(claim_name: str, where: str) -> str:
    """The layer name a claim gets: its name with dots as dashes (export.go getExportPodVolumeNameFromStr)."""
    name = claim_name.replace(".", "-")
    if len(name) > NAME_MAX:
        raise DiskkitError(where, f"claim name {claim_name!r} is longer than {NAME_MAX} characters: KubeVirt's export names it by a hash")
    return name


def vm_config(vm: dict, where: str) -> dict:
    """prepareVMConfig: the VirtualMachine as the export's config."""
    if vm.get("kind") != "VirtualMachine":
        raise DiskkitError(where, f"kind {vm.get('kind')!r}: an export holds a VirtualMachine")
    out = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine"}
    out.update({k: v for k, v in vm.items() if k not in ("apiVersion", "kind")})
    out["metadata"] = {k: v for k, v in (vm.get("metadata") or {}).items() if k != "namespace"}
    spec = dict(vm.get("spec") or {})
    spec.pop("dataVolumeTemplates", None)
    template = spec.get("template")
    if isinstance(template, dict):
        tspec = dict(template.get("spec") or {})
        volumes = []
        for volume in tspec.get("volumes") or []:
            if isinstance(volume, dict) and isinstance(volume.get("dataVolume"), dict):
                volume = {"name": volume.get("name"), "persistentVolumeClaim": {"claimName": volume["dataVolume"].get("name")}}
            volumes.append(volume)
        if "volumes" in tspec:
            tspec["volumes"] = volumes
        spec["template"] = {**template, "spec": tspec}
    out["spec"] = spec
    return out


def architecture(vm: dict) -> str:
    """spec.template.spec.architecture, else amd64 (oci.go newBuilder's default)."""
    return ((((vm.get("spec") or {}).get("template") or {}).get("spec") or {}).get("architecture")) or "amd64"


def claim_names(vm: dict) -> list[str]:
    """The claims the exported VM's volumes use, in volume order (after vm_config)."""
    volumes = ((((vm.get("spec") or {}).get("template") or {}).get("spec") or {}).get("volumes")) or []
    return [v["persistentVolumeClaim"].get("claimName") for v in volumes
            if isinstance(v, dict) and isinstance(v.get("persistentVolumeClaim"), dict)]


def descriptor(media_type: str, digest: str, size: int, annotations: dict[str, str] | None = None) -> dict:
    """ocispec.Descriptor in Go's field order; annotations sorted as Go sorts map keys."""
    out: dict = {"mediaType": media_type, "digest": digest, "size": size}
    if annotations:
        out["annotations"] = dict(sorted(annotations.items()))
    return out


def disk_descriptor(name: str, digest: str, size: int, disk_size: int) -> dict:
    return descriptor(MEDIA_TYPE_DISK_RAW_ZSTD, digest, size, {
        ANNOTATION_DISK_NAME: name,
        ANNOTATION_DISK_SIZE: binary_quantity(disk_size),
        ANNOTATION_TITLE: f"{name}.raw.zst",
    })


def manifest(config: dict, layers: list[dict]) -> bytes:
    return go_json({"schemaVersion": 2, "mediaType": mt.OCI_MANIFEST, "artifactType": ARTIFACT_TYPE_VM,
                    "config": config, "layers": layers})


def index(manifest_digest: str, manifest_size: int, arch: str, created: str, ref_name: str | None = None) -> bytes:
    """index.json; `ref_name` (oci:DIR:TAG) is the one thing KubeVirt's has not."""
    entry = descriptor(mt.OCI_MANIFEST, manifest_digest, manifest_size, {"org.opencontainers.image.ref.name": ref_name} if ref_name else None)
    entry["platform"] = {"architecture": arch, "os": "linux"}
    return go_json({"schemaVersion": 2, "mediaType": mt.OCI_INDEX, "artifactType": ARTIFACT_TYPE_VM,
                    "manifests": [entry], "annotations": {ANNOTATION_CREATED: created}})


# --- reading ---------------------------------------------------------------------------------------

# What an export's own VirtualMachine may use when it is run as it came: its claims (each one of the
# export's disk layers, map_claims) and volumes whose contents the spec itself holds. Anything that
# names something else (another image, the node's Secrets and ConfigMaps, host paths, DataVolume
# sources) would be fetched with the credentials, or read from the objects, of the user who runs it:
# the export's author is not that user.
OWN_VOLUMES = ("persistentVolumeClaim", "emptyDisk", "cloudInitNoCloud", "cloudInitConfigDrive")
_SECRET_REFS = ("secretRef", "networkDataSecretRef")
# Annotations of the template the launcher acts on that name the user's objects: a hook sidecar is a
# script from one of the user's ConfigMaps, which the node runs and whose answer becomes the domain
# (launcher.spec.hooks), with the Sidecar gate on.
_NAMING_ANNOTATIONS = ("hooks.kubevirt.io/hookSidecars",)
# State the node keeps for a VM outlives the run and is found by the VM's identity, which an export
# states itself: a persistent EFI variable store or TPM state by its namespace and name
# (launcher.volumes.vmstate), and the state libvirt keeps for any TPM it runs by the domain's UUID
# (firmware.uuid, else derived from the name): a TPM of libvirt's runs on the state it finds there and
# removes it when the domain goes, unless it is persistent. An export under the name or UUID of one of
# the user's VMs would get that VM's state, or plant state for it.
NODE_STATE = "an export's spec may not keep state on this node; give a spec of your own with --spec"
NODE_TPM = ("an export's spec may not have a TPM on this node, whose state is found by the VM's UUID (firmware.uuid,"
            " else its name's) that the export states; give a spec of your own with --spec")
OWN_ONLY = ("a VM export's VirtualMachine may use only the export's own disks and data it holds itself "
            "(persistentVolumeClaim of its disk layers, emptyDisk, inline cloud-init); refused: "
            "give a VM or VMI file of your own with --spec to run its disks otherwise")


@dataclass(frozen=True)
class ExportDisk:
    name: str  # io.kubevirt.disk.name
    layer: dict  # its descriptor


def is_vm_export(manifest_obj: dict) -> bool:
    return manifest_obj.get("artifactType") == ARTIFACT_TYPE_VM


def export_disks(manifest_obj: dict, where: str) -> list[ExportDisk]:
    """The disks of an export's manifest; refused in one line where hack/oci-import.sh would fail."""
    config_type = (manifest_obj.get("config") or {}).get("mediaType")
    if config_type != MEDIA_TYPE_VM_CONFIG:
        raise DiskkitError(where, f"unexpected config media type for VM artifact: {config_type or '<none>'}")
    disks: list[ExportDisk] = []
    for i, layer in enumerate(manifest_obj.get("layers") or []):
        if not isinstance(layer, dict) or layer.get("mediaType") != MEDIA_TYPE_DISK_RAW_ZSTD:
            raise DiskkitError(f"{where}: layer {i}", f"media type {layer.get('mediaType') if isinstance(layer, dict) else None!r} is not {MEDIA_TYPE_DISK_RAW_ZSTD}")
        name = (layer.get("annotations") or {}).get(ANNOTATION_DISK_NAME) or ""
        if not name or "/" in name or name in (".", "..") or len(name) > NAME_MAX:
            raise DiskkitError(f"{where}: layer {i}", f"annotation {ANNOTATION_DISK_NAME} {name!r} is not a claim's volume name")
        if any(d.name == name for d in disks):
            raise DiskkitError(f"{where}: layer {i}", f"two layers are disk {name!r}")
        disks.append(ExportDisk(name, layer))
    return disks


def map_claims(vm: dict, disks: list[ExportDisk], where: str) -> dict[str, ExportDisk]:
    """Each claim the VM's volumes name -> its disk, matched as hack/oci-import.sh does (the claim's name
    with dots as dashes equals the disk's name). A claim without a disk is refused; a disk no volume
    uses is left out."""
    if vm.get("kind") != "VirtualMachine":
        raise DiskkitError(f"{where}: config", f"kind {vm.get('kind')!r} is not VirtualMachine")
    by_name = {d.name: d for d in disks}
    out: dict[str, ExportDisk] = {}
    for claim in claim_names(vm):
        disk = by_name.get(str(claim).replace(".", "-"))
        if disk is None:
            raise DiskkitError(f"{where}: config", f"volume claim {claim!r} has no disk layer in the export "
                                                    f"(it has: {', '.join(sorted(by_name)) or 'none'})")
        out[claim] = disk
    return out


def check_own_only(vm: dict, where: str) -> None:
    """Refuse, in one line naming the field, an export's VirtualMachine that names anything beyond
    its own disks (OWN_VOLUMES) or asks for state the node keeps by the identity it states (NODE_STATE):
    the export is data, not a spec the node acts on for its author."""
    spec = vm.get("spec") or {}
    if spec.get("dataVolumeTemplates"):  # prepareVMConfig drops them: an export never holds one
        raise DiskkitError(f"{where}: config: spec.dataVolumeTemplates", OWN_ONLY)
    # The export server writes the VM expanded (getExpandedVM): a reference is to the user's objects,
    # whose preference may give the VM kept state (preferredEfi, preferredTPM) past the checks below.
    for key in ("instancetype", "preference"):
        if spec.get(key) is not None:
            raise DiskkitError(f"{where}: config: spec.{key}", OWN_ONLY)
    template = spec.get("template") or {}
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    for key in _NAMING_ANNOTATIONS:
        if isinstance(annotations, dict) and key in annotations:
            raise DiskkitError(f"{where}: config: spec.template.metadata.annotations[{key}]", OWN_ONLY)
    tspec = template.get("spec") or {}
    for i, volume in enumerate(tspec.get("volumes") or []):
        kinds = [key for key in (volume if isinstance(volume, dict) else {}) if key != "name"]
        field = f"{where}: config: spec.template.spec.volumes[{i}]"
        for kind in kinds:
            if kind not in OWN_VOLUMES:
                raise DiskkitError(f"{field}.{kind}", OWN_ONLY)
            named = [ref for ref in _SECRET_REFS if isinstance(volume[kind], dict) and volume[kind].get(ref)]
            if named:
                raise DiskkitError(f"{field}.{kind}.{named[0]}", OWN_ONLY)
    if tspec.get("accessCredentials"):
        raise DiskkitError(f"{where}: config: spec.template.spec.accessCredentials", OWN_ONLY)
    domain = tspec.get("domain") or {}
    firmware = domain.get("firmware") or {}
    kernel_boot = firmware.get("kernelBoot") or {}
    if kernel_boot.get("container"):
        raise DiskkitError(f"{where}: config: spec.template.spec.domain.firmware.kernelBoot.container", OWN_ONLY)
    efi = (firmware.get("bootloader") or {}).get("efi")
    if isinstance(efi, dict) and efi.get("persistent") not in (None, False):
        raise DiskkitError(f"{where}: config: spec.template.spec.domain.firmware.bootloader.efi.persistent", NODE_STATE)
    tpm = (domain.get("devices") or {}).get("tpm")
    if tpm is not None and not (isinstance(tpm, dict) and tpm.get("enabled") is False):  # pkg/tpm: `enabled: false` is none
        if isinstance(tpm, dict) and tpm.get("persistent") not in (None, False):
            raise DiskkitError(f"{where}: config: spec.template.spec.domain.devices.tpm.persistent", NODE_STATE)
        raise DiskkitError(f"{where}: config: spec.template.spec.domain.devices.tpm", NODE_TPM)

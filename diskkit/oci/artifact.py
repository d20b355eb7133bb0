"""OCI 1.1 artifacts as containerDisks (pure rules): which manifests are artifacts, which of their
layers are files and where, and the media types `diskkit build --artifact` writes.

KubeVirt boots an artifact containerDisk through a Kubernetes image volume: CRI-O pulls it and mounts
each layer's blob, byte for byte and whatever its media type, as a file at the path its
`org.opencontainers.image.title` names in the volume, else its `org.cncf.model.filepath` (cri-o
internal/ociartifact/store.go, BlobMountPaths and artifactName; a layer with neither is "not
mountable" and left out). So `oras push REG/x:v1 disk.qcow2`, whose layer says
`application/vnd.oci.image.layer.v1.tar` over the bare file, is a disk named disk.qcow2, not a tar.
virt-launcher takes the volume's only entry as the disk when containerDisk.path is unset (kubevirt
pkg/virt-launcher/virtwrap/manager.go, findDiskFileInImageVolume). CRI-O tells images and artifacts
apart the same way `is_artifact` does (store.go, PullManifest).
"""

from __future__ import annotations

from dataclasses import dataclass

from diskkit.oci import mediatypes as mt

# OCI image-spec 1.1 manifest.md: the empty descriptor, for an artifact that needs no config.
EMPTY_CONFIG = "application/vnd.oci.empty.v1+json"
EMPTY_CONFIG_DATA = b"{}"
ANNOTATION_TITLE = "org.opencontainers.image.title"
# CRI-O's second choice of a layer's file name (modelpack model-spec's AnnotationFilepath).
ANNOTATION_MODEL_FILEPATH = "org.cncf.model.filepath"
# A VMI annotation in KubeVirt (staging/src/kubevirt.io/api/core/v1/types.go,
# ImageVolumeSkipDigestResolutionAnnotation): "Required for OCI artifacts (e.g. raw disk images pushed
# with ORAS) that are not valid container images". Put on the manifest too, so the image says what a
# VMI booting it needs.
ANNOTATION_SKIP_DIGEST_RESOLUTION = "kubevirt.io/image-volume-skip-digest-resolution"
# KubeVirt names no artifactType for containerDisks; this follows the `application/vnd.kubevirt.<kind>.v1`
# names of its OCI exports (pkg/storage/oci/oci.go: application/vnd.kubevirt.virtualmachine.v1).
ARTIFACT_TYPE = "application/vnd.kubevirt.containerdisk.v1"
# The disk layer's type, after the export's raw disk layer (application/vnd.kubevirt.disk.raw+zstd).
DISK_MEDIA_PREFIX = "application/vnd.kubevirt.disk."

_IMAGE_CONFIGS = ("", mt.OCI_CONFIG, mt.DOCKER_CONFIG)


def disk_media_type(disk_format: str, compression: str) -> str:
    """`application/vnd.kubevirt.disk.raw`, `...disk.qcow2+zstd`, ..."""
    return DISK_MEDIA_PREFIX + disk_format + ("" if compression == "none" else f"+{compression}")


def is_artifact(manifest: dict, config_media_type: str) -> bool:
    """CRI-O's test (internal/ociartifact/store.go, PullManifest): an image manifest whose config is an
    image config (or has no type) and which sets no artifactType is an image; anything else an artifact."""
    return bool(manifest.get("artifactType")) or config_media_type not in _IMAGE_CONFIGS


def blob_compression(media_type: str) -> str:
    """How a file layer's bytes are compressed, by its media type's structured suffix (RFC 6839 style,
    as image-spec's +gzip/+zstd): 'gzip', 'zstd' or 'none'."""
    for kind in ("gzip", "zstd"):
        if media_type.endswith(f"+{kind}"):
            return kind
    return "none"


@dataclass(frozen=True)
class FileLayer:
    title: str  # as the annotation says; the caller cleans it as it cleans tar member names
    compression: str


def file_layer(manifest: dict, config_media_type: str, media_type: str, annotations: dict | None) -> FileLayer | None:
    """The file an artifact's layer is (its name and how its bytes are compressed), whatever its media
    type, or None when the manifest is an image's. A layer CRI-O finds no name for has `title` ""."""
    if not is_artifact(manifest, config_media_type):
        return None
    annotations = annotations or {}
    name = next((annotations[k] for k in (ANNOTATION_TITLE, ANNOTATION_MODEL_FILEPATH) if k in annotations), "")
    return FileLayer(name, blob_compression(media_type))


def make_manifest(config: dict, layers: list[dict], annotations: dict[str, str], artifact_type: str = ARTIFACT_TYPE) -> dict:
    out: dict = {"schemaVersion": 2, "mediaType": mt.OCI_MANIFEST, "artifactType": artifact_type, "config": config, "layers": layers}
    if annotations:
        out["annotations"] = dict(annotations)
    return out

"""`diskkit build --artifact`: the disk as an OCI 1.1 artifact, one file layer named by its title, as
ORAS pushes a file and as KubeVirt boots through an image volume (diskkit.oci.artifact)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from diskkit.disk.containerdisk import ANNOTATION_FORMAT, ANNOTATION_PATH, ANNOTATION_VIRTUAL_SIZE
from diskkit.layers.layer import LayerResult
from diskkit.layers.rawblob import write_blob
from diskkit.oci import artifact
from diskkit.oci.image import Descriptor, canonical_json, rfc3339
from diskkit.oci.mediatypes import OCI_MANIFEST
from diskkit.progress import Reporter
from diskkit.transports.base import with_restarts


@dataclass
class Made:
    digest: str
    size: int
    layer: LayerResult


def compressed_note(compression: str) -> str | None:
    """What a compressed artifact means for KubeVirt, or None for an uncompressed one."""
    if compression == "none":
        return None
    return (f"--artifact --compression {compression}: CRI-O puts an artifact's blob in the image volume as it is, "
            "so KubeVirt would boot the compressed bytes; launcher and diskkit decompress it (--compression none for KubeVirt)")


def write(dest, title: str, disk_format: str, virtual_size: int, prepared: Callable[[], Path], compression: str, level: int | None,
          created: int, annotations: dict[str, str], reporter: Reporter) -> Made:
    """Disk blob, empty config and manifest into `dest`; `prepared()` gives the disk file in its final format."""
    media = artifact.disk_media_type(disk_format, compression)
    disk = prepared()

    def send() -> LayerResult:
        with dest.blob_writer(media) as pending, reporter.task(f"/{title}", disk.stat().st_size) as task:
            result = write_blob(disk, pending, compression, level, task.advance)
            pending.commit(result.digest, result.size)
        return result

    layer = with_restarts(send, reporter, f"blob {title}")
    reporter.event({"event": "blob", "digest": layer.digest, "size": layer.size, "status": "uploaded"})
    config = dest.put_blob(artifact.EMPTY_CONFIG_DATA, artifact.EMPTY_CONFIG)
    notes = {
        "org.opencontainers.image.created": rfc3339(created),
        ANNOTATION_PATH: f"/{title}",
        ANNOTATION_FORMAT: disk_format,
        ANNOTATION_VIRTUAL_SIZE: str(virtual_size),
        artifact.ANNOTATION_SKIP_DIGEST_RESOLUTION: "true",
        **annotations,
    }
    layer_desc = Descriptor(media, layer.digest, layer.size, {artifact.ANNOTATION_TITLE: title})
    manifest = artifact.make_manifest(config.to_json(), [layer_desc.to_json()], notes)
    desc = dest.put_manifest(canonical_json(manifest), OCI_MANIFEST)
    return Made(desc.digest, desc.size, layer)

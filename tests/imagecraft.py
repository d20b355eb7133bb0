"""Hand-made OCI layouts with arbitrary (also hostile) tar members, for testing readers.

Deliberately independent of diskkit's writer: plain tarfile, gzip and json, as another tool would make them.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Member:
    name: str
    data: bytes = b""
    kind: bytes = tarfile.REGTYPE
    mode: int = 0o440
    uid: int = 107
    gid: int = 107
    link: str = ""


def dir_(name: str, mode: int = 0o555, uid: int = 107, gid: int = 107) -> Member:
    return Member(name, kind=tarfile.DIRTYPE, mode=mode, uid=uid, gid=gid)


def layer_tar(members: list[Member]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for m in members:
            info = tarfile.TarInfo(m.name)
            info.type, info.mode, info.uid, info.gid, info.linkname = m.kind, m.mode, m.uid, m.gid, m.link
            info.size = len(m.data) if m.kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(m.data) if m.kind == tarfile.REGTYPE else None)
    return buf.getvalue()


def put_blob(blobs: Path, data: bytes) -> str:
    """`data` stored under its sha256 in a layout's blobs directory; its digest."""
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return "sha256:" + digest


def write_layout(root: Path, layers: list[list[Member] | bytes], tag: str = "t", docker_types: bool = False, gzipped: bool = True) -> Path:
    """An OCI layout; a layer is a list of members, or a whole tar another tool wrote; `gzipped=False`
    stores layers as plain tar (seekable, as the disk server reads them)."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    descs, diff_ids = [], []
    for members in layers:
        raw = members if isinstance(members, bytes) else layer_tar(members)
        diff_ids.append("sha256:" + hashlib.sha256(raw).hexdigest())
        blob = gzip.compress(raw, mtime=0) if gzipped else raw
        media = "application/vnd.docker.image.rootfs.diff.tar" if docker_types else "application/vnd.oci.image.layer.v1.tar"
        media += "+gzip" if gzipped and not docker_types else ".gzip" if gzipped else ""
        descs.append({"mediaType": media, "digest": put_blob(blobs, blob), "size": len(blob)})
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    config_media = "application/vnd.docker.container.image.v1+json" if docker_types else "application/vnd.oci.image.config.v1+json"
    manifest_media = "application/vnd.docker.distribution.manifest.v2+json" if docker_types else "application/vnd.oci.image.manifest.v1+json"
    manifest = json.dumps(
        {"schemaVersion": 2, "mediaType": manifest_media, "config": {"mediaType": config_media, "digest": put_blob(blobs, config), "size": len(config)}, "layers": descs}
    ).encode()
    index = {
        "schemaVersion": 2,
        "manifests": [
            {"mediaType": manifest_media, "digest": put_blob(blobs, manifest), "size": len(manifest), "annotations": {"org.opencontainers.image.ref.name": tag}}
        ],
    }
    (root / "index.json").write_text(json.dumps(index))
    (root / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    return root


def layer_blob_paths(root: Path) -> list[Path]:
    index = json.loads((root / "index.json").read_text())
    manifest = json.loads((root / "blobs/sha256" / index["manifests"][0]["digest"][7:]).read_text())
    return [root / "blobs/sha256" / layer["digest"][7:] for layer in manifest["layers"]]


def add_layer(root: Path, tag: str, new_tag: str, members: list[Member], keep_annotations: bool = True) -> Path:
    """A layer (gzip, as another tool adds one) on top of image `tag` of a layout, tagged `new_tag`;
    the lower layers and their annotations are kept as they are, the manifest's unless told not to."""
    blobs = root / "blobs" / "sha256"
    index = json.loads((root / "index.json").read_text())
    (entry,) = [m for m in index["manifests"] if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name") == tag]
    manifest = json.loads((blobs / entry["digest"][7:]).read_text())
    config = json.loads((blobs / manifest["config"]["digest"][7:]).read_text())
    raw = layer_tar(members)
    config["rootfs"]["diff_ids"].append("sha256:" + hashlib.sha256(raw).hexdigest())
    blob = gzip.compress(raw, mtime=0)
    manifest["layers"].append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": put_blob(blobs, blob), "size": len(blob)})
    config_bytes = json.dumps(config).encode()
    manifest["config"] = {**manifest["config"], "digest": put_blob(blobs, config_bytes), "size": len(config_bytes)}
    if not keep_annotations:
        manifest.pop("annotations", None)
    manifest_bytes = json.dumps(manifest).encode()
    index["manifests"].append({"mediaType": manifest["mediaType"], "digest": put_blob(blobs, manifest_bytes), "size": len(manifest_bytes),
                               "annotations": {"org.opencontainers.image.ref.name": new_tag}})
    (root / "index.json").write_text(json.dumps(index))
    return root

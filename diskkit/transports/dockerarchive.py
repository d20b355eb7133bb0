"""`docker-archive:FILE[:NAME:TAG]`: the `docker save` format that `docker load` and `podman load` read.

Layers are stored as plain tars named by their diffID, with manifest.json listing config and
layers; there is no registry manifest, so reading synthesises a Docker schema2 one.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import BinaryIO, Iterator

from diskkit.errors import DiskkitError
from diskkit.oci import mediatypes as mt
from diskkit.oci.image import (
    Descriptor,
    canonical_json,
    check_digest,
    parse_json,
    sha256_digest,
)
from diskkit.oci.reference import ImageRef, parse_docker_name
from diskkit.streams.compression import sniff
from diskkit.transports.base import Source
from diskkit.transports.ociarchive import ArchiveWriter
from diskkit.transports.tarstore import TarStore

_BLOB_NAME = re.compile(r"^(?:blobs/sha256/|)([0-9a-f]{64})(?:\.tar|\.json|/layer\.tar|)$")


class DockerArchiveSource(Source):
    manifest_synthesized = True
    def __init__(self, ref: ImageRef):
        self.where = str(ref)
        self.store = TarStore(Path(ref.path))
        try:
            entries = json.loads(self.store.read("manifest.json"))
            assert isinstance(entries, list)
        except (ValueError, AssertionError):
            raise DiskkitError(ref.path, "manifest.json is not a docker-archive manifest list") from None
        if ref.tag:
            index = int(ref.tag[1:])
            if index >= len(entries):
                raise DiskkitError(self.where, f"Invalid source index @{index}, only {len(entries)} manifest items available")
            entries = [entries[index]]
        elif ref.name:
            # docker writes `x:1`, podman and buildah `localhost/x:1` or `docker.io/library/x:1`:
            # tags are compared as the names they normalise to.
            entries = [e for e in entries if any(_same_name(t, ref.name) for t in e.get("RepoTags") or [])]
            if not entries:
                raise DiskkitError(self.where, f'Tag "{ref.name}" not found')
        elif len(entries) != 1:
            raise DiskkitError(self.where, f"the archive holds {len(entries)} images; name one with :NAME:TAG")
        self.entry = entries[0]
        self.paths: dict[str, str] = {}

    def _descriptor(self, path: str, media_type: str, digest: str | None) -> Descriptor:
        member = self.store.member(path)
        if member is None:
            raise DiskkitError(self.where, f"archive has no member {path}")
        if digest is None:
            with self.store.open(path) as f:
                digest = _hash_stream(f)
        self.paths[digest] = path
        return Descriptor(media_type, digest, member.size)

    def top_manifest(self):
        config_path = self.entry.get("Config") or ""
        match = _BLOB_NAME.match(config_path)
        config_desc = self._descriptor(config_path, mt.DOCKER_CONFIG, f"sha256:{match.group(1)}" if match else None)
        config = parse_json(self.read_small(config_desc), f"{self.where}: config")
        diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
        layer_paths = self.entry.get("Layers") or []
        if len(layer_paths) != len(diff_ids):
            raise DiskkitError(self.where, f"manifest.json lists {len(layer_paths)} layers but the config has {len(diff_ids)} diff_ids")
        layers = []
        for path, diff_id in zip(layer_paths, diff_ids):
            with self.store.open(path) as f:
                kind = sniff(f.read(4))
            if kind == "none":
                # An uncompressed layer's digest is its diffID; reading it verifies both.
                layers.append(self._descriptor(path, mt.DOCKER_LAYER, diff_id))
            else:
                match = _BLOB_NAME.match(path)
                digest = f"sha256:{match.group(1)}" if match and path.startswith("blobs/") else None
                layers.append(self._descriptor(path, mt.docker_layer(kind), digest))
        manifest = {
            "schemaVersion": 2,
            "mediaType": mt.DOCKER_MANIFEST,
            "config": config_desc.to_json(),
            "layers": [layer.to_json() for layer in layers],
        }
        return canonical_json(manifest), mt.DOCKER_MANIFEST, None

    def open_blob(self, desc: Descriptor) -> BinaryIO:
        path = self.paths.get(desc.digest)
        if path is None:
            raise DiskkitError(self.where, f"archive has no blob {desc.digest}")
        return self.store.open(path)


def _same_name(tag: str, name) -> bool:
    try:
        return parse_docker_name(tag) == name
    except DiskkitError:
        return False


def _hash_stream(f: BinaryIO) -> str:
    import hashlib

    return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


class _Pending:
    def __init__(self, dest: "DockerArchiveDestination", suffix: str):
        self.dest = dest
        self.suffix = suffix
        self.done = False

    def write(self, data) -> None:
        self.dest.tar.write(data)

    def commit(self, digest: str, size: int) -> None:
        name = check_digest(digest, "blob") + self.suffix
        if name in self.dest.names:
            self.dest.tar.cancel()
        elif self.dest.tar.end(name) != size:
            raise DiskkitError(name, "blob size changed while writing")
        self.dest.names.add(name)
        self.done = True


class DockerArchiveDestination(ArchiveWriter):
    layer_compression = "none"
    docker_manifest = True

    def __init__(self, ref: ImageRef, created: int = 0):
        if ref.tag:
            raise DiskkitError(str(ref), "an image index @N only selects a source image; name the destination's image NAME:TAG")
        super().__init__(ref, created)
        self.manifest: dict | None = None

    @contextlib.contextmanager
    def blob_writer(self, media_type: str) -> Iterator[_Pending]:
        if media_type in (mt.DOCKER_MANIFEST, mt.OCI_MANIFEST):
            raise DiskkitError(self.ref.path, "docker-archive stores no registry manifests")
        self.tar.begin()
        pending = _Pending(self, ".json" if media_type in (mt.DOCKER_CONFIG, mt.OCI_CONFIG) else ".tar")
        try:
            yield pending
        finally:
            if not pending.done:
                self.tar.cancel()

    def put_manifest(self, data: bytes, media_type: str, platform: dict | None = None, child: bool = False) -> Descriptor:
        if self.manifest is not None or child:
            raise DiskkitError(self.ref.path, "docker-archive destinations take one image")
        self.manifest = parse_json(data, "manifest")
        return Descriptor(media_type, sha256_digest(data), len(data))

    def repo_tag(self) -> str:
        """The RepoTags entry: the short form `docker save` writes."""
        return self.ref.name.familiar()

    def commit(self) -> None:
        manifest = self.manifest or {}
        config_hex = check_digest(manifest["config"]["digest"], "config")
        layers = [check_digest(layer["digest"], "layer") + ".tar" for layer in manifest["layers"]]
        tags = [self.repo_tag()] if self.ref.name else []
        entry = {"Config": f"{config_hex}.json", "RepoTags": tags, "Layers": layers}
        self.tar.add_bytes("manifest.json", canonical_json([entry]))
        if self.ref.name:
            name, _, tag = self.ref.name.familiar().rpartition(":")
            self.tar.add_bytes("repositories", canonical_json({name: {tag: layers[-1][:-4]}}))
        self.finish()

"""Copy an image between any two transports, as `skopeo copy` does: every blob verified in passing.

Manifest bytes travel unchanged (so digests stay the same), except into docker-archive, whose
format holds uncompressed layers only: there layers are decompressed and the manifest rewritten;
and from sources that store no manifest (archives, engines), whose plain layers are gzipped on
their way to a registry or an OCI layout, as skopeo does.
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from diskkit.errors import DiskkitError
from diskkit.layers import lazytoc
from diskkit.oci import artifact
from diskkit.oci import mediatypes as mt
from diskkit.oci.image import (
    Descriptor,
    Platform,
    canonical_json,
    docker_to_oci,
    manifest_media_type,
    oci_to_docker,
    parse_json,
    select_platform,
    sha256_digest,
)
from diskkit.oci.reference import ImageRef, parse_ref
from diskkit.progress import Reporter
from diskkit.registry.options import RegistryOptions
from diskkit.streams.compression import compressor, decompressing_reader
from diskkit.streams.digestio import HashingReader
from diskkit.transports import open_destination, open_source
from diskkit.transports.base import Destination, Source, with_restarts

COPY_CHUNK = 1 << 20
PARALLEL_BLOBS = 3


@dataclass
class CopyResult:
    reference: str
    digest: str
    media_type: str
    blobs: dict[str, str]  # digest -> uploaded | skipped | mounted

    def to_json(self) -> dict:
        return {"reference": self.reference, "digest": self.digest, "mediaType": self.media_type, "blobs": self.blobs}


def copy_image(
    src: str | ImageRef,
    dest: str | ImageRef,
    opts: RegistryOptions,
    reporter: Reporter,
    platform: Platform | None = None,
    multi_arch: str = "system",
    dest_opts: RegistryOptions | None = None,
    preserve_digests: bool | str = False,
    manifest_format: str | None = None,
    compress_format: str | None = None,
    compress_level: int | None = None,
    dest_compress: bool = False,
    before_manifest=None,
) -> CopyResult:
    """`opts` reach the source registry, `dest_opts` (default: the same) the destination's, as
    skopeo's --src-*/--dest-* flags do. `multi_arch` says what becomes of an index, as skopeo's
    --multi-arch: "system" copies the instance `platform` selects, "all" every instance and the
    index, "index-only" the index alone (a single image is copied whatever it says). With
    `preserve_digests` a copy that would have to rewrite a manifest is refused instead (skopeo
    copy --preserve-digests); `manifest_format` ("oci" or "v2s2") restates manifests in that format
    (skopeo copy --format); `compress_format`/`compress_level` re-encode every layer that is not
    already in that format (skopeo's --dest-compress-format), for destinations that compress, or any
    with `dest_compress` (--dest-compress)."""
    src_ref = parse_ref(src) if isinstance(src, str) else src
    dest_ref = parse_ref(dest) if isinstance(dest, str) else dest
    statuses: dict[str, str] = {}
    with open_source(src_ref, opts) as source:
        data, media, _ = source.manifest_descriptors()
        with open_destination(dest_ref, 0, dest_opts or opts) as destination:
            destination.before_manifest = before_manifest  # a signer: signs each manifest before it is stored
            copier = _Copier(source, destination, src_ref, dest_ref, reporter, statuses, preserve_digests, manifest_format, compress_format, compress_level, dest_compress)
            if media in mt.INDEXES and multi_arch != "system":
                if destination.docker_manifest:
                    flag = "--all" if multi_arch == "all" else f"--multi-arch {multi_arch}"
                    raise DiskkitError(str(dest_ref), f"docker-archive holds a single image; choose one with --platform instead of {flag}")
                index = parse_json(data, source.where)
                children = []
                for child in index.get("manifests") or []:
                    if multi_arch == "index-only":
                        # containers/image copy/multiple.go: CopySpecificImages with no instances keeps
                        # every descriptor as it is and copies none of them.
                        children.append(child)
                        continue
                    desc = Descriptor.from_json(child, source.where)
                    copied = copier.image(_child_manifest(source, desc), desc.media_type, desc.platform, child=True)
                    children.append({**child, "mediaType": copied.media_type, "digest": copied.digest, "size": copied.size})
                if (destination.oci_only or manifest_format == "oci") and media == mt.DOCKER_LIST:
                    copier.rewriting("a Docker manifest list becomes an OCI index")
                    data, media = canonical_json(_typed_as(docker_to_oci({**index, "manifests": children}), children, multi_arch)), mt.OCI_INDEX
                elif manifest_format == "v2s2" and media == mt.OCI_INDEX:
                    copier.rewriting("an OCI index becomes a Docker manifest list")
                    data, media = canonical_json(_typed_as(oci_to_docker({**index, "manifests": children}, source.where), children, multi_arch)), mt.DOCKER_LIST
                elif children != index.get("manifests"):
                    data = canonical_json({**index, "manifests": children})
                top = destination.put_manifest(data, media)
            elif media in mt.INDEXES:
                desc = select_platform(parse_json(data, source.where), platform or Platform.host(), source.where)
                child = _child_manifest(source, desc)
                top = copier.image(child, manifest_media_type(parse_json(child, source.where), desc.media_type), desc.platform)
            else:
                top = copier.image(data, media, None)
    return CopyResult(str(dest_ref), top.digest, top.media_type, statuses)


def copy_instance(source: Source, destination: Destination, src_ref: ImageRef, dest_ref: ImageRef, reporter: Reporter, statuses: dict,
                  data: bytes, media: str, platform: dict | None) -> Descriptor:
    """One image manifest, its bytes kept, and its blobs into `destination` as an index's instance
    (blobs the destination holds are skipped, those in another repository of its registry mounted)."""
    copier = _Copier(source, destination, src_ref, dest_ref, reporter, statuses, "an index lists the source's manifest by digest")
    return copier.image(data, media, platform, child=True)


def read_instance(source: Source, desc: Descriptor) -> bytes:
    """An index entry's manifest, checked against its digest."""
    return _child_manifest(source, desc)


def _typed_as(converted: dict, children: list[dict], multi_arch: str) -> dict:
    """A converted list whose descriptors keep the types of instances left uncopied: a list
    conversion changes the list's own type only (containers/image manifest/docker_schema2_list.go:
    ToOCI1Index, oci_index.go: ToSchema2List); --all has converted the instances themselves."""
    if multi_arch != "index-only":
        return converted
    return {**converted, "manifests": [{**new, "mediaType": old["mediaType"]} for new, old in zip(converted["manifests"], children)]}


def _child_manifest(source: Source, desc: Descriptor) -> bytes:
    data = source.read_manifest(desc)
    if sha256_digest(data) != desc.digest:
        raise DiskkitError(source.where, f"manifest {desc.digest} does not match its digest")
    return data


class _Copier:
    def __init__(self, source: Source, dest: Destination, src_ref: ImageRef, dest_ref: ImageRef, reporter: Reporter, statuses: dict, preserve_digests: bool = False, manifest_format: str | None = None, compress_format: str | None = None, compress_level: int | None = None, dest_compress: bool = False):
        self.source, self.dest, self.reporter, self.statuses = source, dest, reporter, statuses
        self.preserve_digests = preserve_digests
        self.manifest_format = manifest_format
        self.compress_format, self.compress_level, self.dest_compress = compress_format, compress_level, dest_compress
        if manifest_format == "v2s2" and dest.oci_only:
            raise DiskkitError(str(dest_ref), "--format v2s2: OCI layouts index OCI manifests only")
        self.dest_ref = dest_ref
        same_registry = (
            src_ref.transport == dest_ref.transport == "docker"
            and src_ref.name.registry == dest_ref.name.registry
            and src_ref.name.repository != dest_ref.name.repository
        )
        self.mount_from = src_ref.name.repository if same_registry else None

    def image(self, data: bytes, media: str, platform: dict | None, child: bool = False) -> Descriptor:
        manifest = parse_json(data, self.source.where)
        config_media = manifest["config"].get("mediaType", "") if isinstance(manifest.get("config"), dict) else ""
        if artifact.is_artifact(manifest, config_media) and (self.dest.layer_compression == "none" or self.manifest_format == "v2s2"):
            # An artifact has no Docker schema2 form; containers/image's words (internal/manifest/errors.go, NonImageArtifactError).
            raise DiskkitError(self.source.where, f'creating an updated image manifest: unsupported image-specific operation on artifact with type "{config_media}"')
        if (self.dest.oci_only or self.manifest_format == "oci") and media == mt.DOCKER_MANIFEST:
            self.rewriting("a Docker schema2 manifest becomes an OCI manifest")
            manifest = docker_to_oci(manifest)
            data, media = canonical_json(manifest), mt.OCI_MANIFEST
        elif self.manifest_format == "v2s2" and media == mt.OCI_MANIFEST:
            self.rewriting("an OCI manifest becomes a Docker schema2 manifest")
            manifest = oci_to_docker(manifest, self.source.where)
            data, media = canonical_json(manifest), mt.DOCKER_MANIFEST
        try:
            config = Descriptor.from_json(manifest["config"], self.source.where)
            layers = [Descriptor.from_json(layer, self.source.where) for layer in manifest.get("layers") or []]
        except (KeyError, TypeError, AttributeError):
            raise DiskkitError(self.source.where, "manifest has no config descriptor") from None
        if self.dest.layer_compression == "none" and any(mt.layer_compression(l.media_type) != "none" for l in layers):
            self.rewriting("its layers must be stored uncompressed")
            return self._into_plain_layers(config, layers, platform)
        # As skopeo: destinations that compress (registries, OCI layouts) take the format as given;
        # the others (dir:) only with --dest-compress.
        if self.compress_format and (self.dest.compresses_plain_layers or self.dest_compress):
            if self.dest.layer_compression == "none":
                raise DiskkitError(str(self.dest_ref), "--dest-compress-format: this destination stores plain layers only")
            if any(mt.layer_compression(l.media_type) not in (self.compress_format, None) for l in layers):
                self.rewriting(f"layers are recompressed as {self.compress_format}")
                return self._recompressed(manifest, media, config, layers, platform, child, self.compress_format)
        elif self.source.manifest_synthesized and self.dest.compresses_plain_layers and any(mt.layer_compression(l.media_type) == "none" for l in layers):
            # skopeo compresses an archive's or an engine's plain layers on their way to a registry
            # or an OCI layout; the manifest was made up by the source anyway, so no digest is lost.
            self.rewriting("plain layers are compressed for this destination")
            return self._recompressed(manifest, media, config, layers, platform, child, "gzip", only_plain=True)
        blobs = [config, *layers]
        if self.dest.concurrent_blobs and len(blobs) > 1:
            with ThreadPoolExecutor(PARALLEL_BLOBS) as pool:
                list(pool.map(self.blob, blobs))
        else:
            for desc in blobs:
                self.blob(desc)
        return self.dest.put_manifest(data, media, platform, child=child)

    def rewriting(self, why: str) -> None:
        if self.preserve_digests:
            # A string says why digests must stay (skopeo's words when signatures would be lost).
            flag = self.preserve_digests if isinstance(self.preserve_digests, str) else "--preserve-digests"
            raise DiskkitError(str(self.dest_ref), f"{flag}: the manifest would change digest ({why} here)")

    def blob(self, desc: Descriptor) -> None:
        if self.dest.has_blob(desc):
            self._status(desc, "skipped")
            return
        if self.mount_from and self.dest.mount(desc, self.mount_from):
            self._status(desc, "mounted")
            return

        def send() -> None:
            if hasattr(self.dest, "put_blob_stream"):
                with self.source.blob(desc) as reader, self.reporter.task(f"blob {desc.digest[7:19]}", desc.size) as task:
                    self.dest.put_blob_stream(desc, reader, task.advance)
                    reader.drain()
                return
            with self.source.blob(desc) as reader, self.dest.blob_writer(desc.media_type) as writer:
                with self.reporter.task(f"blob {desc.digest[7:19]}", desc.size) as task:
                    while chunk := reader.read(COPY_CHUNK):
                        writer.write(chunk)
                        task.advance(len(chunk))
                    reader.drain()  # raises unless size and digest match
                writer.commit(desc.digest, desc.size)

        with_restarts(send, self.reporter, f"blob {desc.digest[:19]}")
        self._status(desc, "uploaded")

    def _status(self, desc: Descriptor, status: str) -> None:
        self.statuses[desc.digest] = status
        self.reporter.event({"event": "blob", "digest": desc.digest, "size": desc.size, "status": status})

    def _recompressed(self, manifest: dict, media: str, config: Descriptor, layers: list[Descriptor], platform: dict | None, child: bool, kind: str, only_plain: bool = False) -> Descriptor:
        """Layers re-encoded as `kind` in one streaming pass each (decompress, compress, hash, send)."""
        if kind == "zstd" and media == mt.DOCKER_MANIFEST:
            raise DiskkitError(str(self.dest_ref), f'"{mt.DOCKER_LAYER_ZSTD}": zstd compression is not supported for docker images; add --format oci')
        self.blob(config)
        out = []
        for desc in layers:
            have = mt.layer_compression(desc.media_type)
            if have is None or have == kind or (only_plain and have != "none"):
                self.blob(desc)
                out.append(desc.to_json())
                continue
            target = (mt.docker_layer if media == mt.DOCKER_MANIFEST else mt.oci_layer)(kind)
            packer = compressor(kind, self.compress_level)
            digest = hashlib.sha256()
            size = 0
            with self.source.blob(desc) as reader, self.dest.blob_writer(target) as writer:
                plain = decompressing_reader(reader, have, f"{self.source.where}: layer {desc.digest[:19]}")
                with self.reporter.task(f"layer {desc.digest[7:19]}", desc.size) as task:
                    while True:
                        chunk = plain.read(COPY_CHUNK)
                        packed = packer.compress(chunk) if chunk else packer.flush()
                        writer.write(packed)
                        digest.update(packed)
                        size += len(packed)
                        if not chunk:
                            break
                        task.advance(len(chunk))
                reader.drain()
                writer.commit(f"sha256:{digest.hexdigest()}", size)
            # A lazy TOC's offsets are offsets in the old blob: the re-encoded layer is an ordinary one.
            renamed = {**desc.to_json(), "mediaType": target, "digest": f"sha256:{digest.hexdigest()}", "size": size}
            notes = lazytoc.without_toc(desc.annotations or {})
            renamed.pop("annotations", None)
            out.append({**renamed, **({"annotations": notes} if notes else {})})
            self._status(desc, "uploaded")
        data = canonical_json({**manifest, "layers": out})
        return self.dest.put_manifest(data, media, platform, child=child)

    def _into_plain_layers(self, config: Descriptor, layers: list[Descriptor], platform: dict | None) -> Descriptor:
        config_bytes = self.source.read_small(config)
        diff_ids = (json.loads(config_bytes).get("rootfs") or {}).get("diff_ids") or []
        if len(diff_ids) != len(layers):
            raise DiskkitError(self.source.where, "config diff_ids do not match the layers")
        new_config = self.dest.put_blob(config_bytes, mt.DOCKER_CONFIG)
        plain = []
        for desc, diff_id in zip(layers, diff_ids):
            with self.source.blob(desc) as reader, self.dest.blob_writer(mt.DOCKER_LAYER) as writer:
                unpacked = HashingReader(decompressing_reader(reader, mt.layer_compression(desc.media_type) or "none", f"{self.source.where}: layer {desc.digest[:19]}"))
                with self.reporter.task(f"layer {desc.digest[7:19]}", desc.size) as task:
                    while chunk := unpacked.read(COPY_CHUNK):
                        writer.write(chunk)
                        task.advance(len(chunk))
                reader.drain()
                if unpacked.digest != diff_id:
                    raise DiskkitError(self.source.where, f"layer {desc.digest} does not match its diffID {diff_id}")
                writer.commit(diff_id, unpacked.count)
            plain.append(Descriptor(mt.DOCKER_LAYER, diff_id, unpacked.count))
            self._status(desc, "uploaded")
        manifest = {
            "schemaVersion": 2,
            "mediaType": mt.DOCKER_MANIFEST,
            "config": new_config.to_json(),
            "layers": [p.to_json() for p in plain],
        }
        return self.dest.put_manifest(canonical_json(manifest), mt.DOCKER_MANIFEST, platform)

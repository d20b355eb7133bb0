"""`diskkit index create/append`: one OCI index from images built and pushed in separate jobs (one per
architecture, as kubevirt/containerdisks builds them), as `docker buildx imagetools create` and
`buildah manifest add` assemble one.

Each source's manifest is listed by its digest, its bytes unchanged; its blobs are copied into the
destination's repository (mounted within a registry, skipped where already there). An image's
platform is its config's os/architecture/variant; an index given as a source gives its entries as
they are. Two entries for one platform are refused (append --replace swaps the old one out).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from diskkit.errors import DiskkitError
from diskkit.oci import mediatypes as mt
from diskkit.oci.image import Descriptor, Platform, canonical_json, make_index, parse_json, sha256_digest
from diskkit.oci.reference import parse_ref
from diskkit.ops.copy import copy_instance, read_instance
from diskkit.progress import Reporter
from diskkit.registry.options import RegistryOptions
from diskkit.transports import open_destination, open_source


@dataclass
class Entry:
    source: str
    descriptor: Descriptor
    existing: bool = False  # an entry the destination's index had before append

    def to_json(self) -> dict:
        return {"source": self.source, "digest": self.descriptor.digest, "mediaType": self.descriptor.media_type,
                "platform": self.descriptor.platform}


@dataclass
class IndexResult:
    reference: str
    digest: str
    size: int
    entries: list[Entry] = field(default_factory=list)
    blobs: dict[str, str] = field(default_factory=dict)
    replaced: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        out = {"reference": self.reference, "digest": self.digest, "mediaType": mt.OCI_INDEX, "size": self.size,
               "manifests": [e.to_json() for e in self.entries], "blobs": self.blobs}
        if self.replaced:
            out["replaced"] = self.replaced
        return out


def platform_text(platform: dict | None) -> str:
    if not platform:
        return "no platform"
    return "/".join(str(platform[k]) for k in ("os", "architecture", "variant") if platform.get(k))


def _key(platform: dict | None) -> tuple:
    platform = platform or {}
    return platform.get("os"), platform.get("architecture"), platform.get("variant") or None


def _platform_of(image_config: dict, where: str) -> dict:
    if not image_config.get("os") or not image_config.get("architecture"):
        raise DiskkitError(where, "the image's config names no os and architecture; an index entry needs its platform")
    return Platform(str(image_config["os"]), str(image_config["architecture"]), image_config.get("variant") or None).to_json()


def assemble(dest: str, sources: list[str], registry: RegistryOptions, reporter: Reporter, append: bool = False,
             replace: bool = False, annotations: dict[str, str] | None = None) -> IndexResult:
    """Write the index at `dest`: the sources' images (and, with `append`, the entries it had)."""
    dest_ref = parse_ref(dest)
    if dest_ref.transport == "docker-archive":
        raise DiskkitError(dest, "docker-archive holds a single image, not an index")
    entries: list[Entry] = []
    kept_annotations: dict[str, str] = {}
    if append:
        entries, kept_annotations = _existing(dest, registry)
    result = IndexResult(str(dest_ref), "", 0)
    # Every source is read and every clash refused before anything is written.
    planned = [(src, *_instances(src, registry)) for src in sources]
    for src, _, instances in planned:
        for data, media, platform in instances:
            clash = [e for e in entries if _key(e.descriptor.platform) == _key(platform)]
            if clash:
                old = clash[0]
                if not (replace and old.existing):
                    hint = "; --replace puts this one in its place" if old.existing else ""
                    raise DiskkitError(src, f"platform {platform_text(platform)} is already in the index (from {old.source}){hint}")
                entries.remove(old)
                result.replaced.append(old.descriptor.digest)
            entries.append(Entry(src, Descriptor(media, sha256_digest(data), len(data), platform=platform)))
    with open_destination(dest_ref, 0, registry) as destination:
        for src, src_ref, instances in planned:
            with open_source(src_ref, registry) as source:
                for data, media, platform in instances:
                    desc = copy_instance(source, destination, src_ref, dest_ref, reporter, result.blobs, data, media, platform)
                    reporter.note(f"{src}: {platform_text(platform)} {desc.digest}")
        index = make_index([e.descriptor for e in entries], {**kept_annotations, **(annotations or {})})
        top = destination.put_manifest(canonical_json(index), mt.OCI_INDEX)
    result.digest, result.size, result.entries = top.digest, top.size, entries
    return result


def _existing(dest: str, registry: RegistryOptions) -> tuple[list[Entry], dict[str, str]]:
    with open_source(dest, registry) as source:
        data, media, _ = source.top_manifest()
        obj = parse_json(data, source.where)
        media = media or obj.get("mediaType")
        if media not in mt.INDEXES and "manifests" not in obj:
            raise DiskkitError(dest, "is an image, not an index; `diskkit index create` makes one from it and the others")
        entries = [Entry(dest, Descriptor.from_json(m, source.where), existing=True) for m in obj.get("manifests") or []]
        return entries, dict(obj.get("annotations") or {})


def _instances(src: str, registry: RegistryOptions):
    """(ref, [(manifest bytes, media type, platform)]) of one source: its image, or an index's entries."""
    src_ref = parse_ref(src)
    with open_source(src_ref, registry) as source:
        data, media, _ = source.top_manifest()
        obj = parse_json(data, source.where)
        media = media or obj.get("mediaType") or (mt.OCI_INDEX if "manifests" in obj else mt.OCI_MANIFEST)
        if media in mt.INDEXES:
            out = []
            for child in obj.get("manifests") or []:
                desc = Descriptor.from_json(child, source.where)
                if desc.media_type not in mt.MANIFESTS:
                    raise DiskkitError(src, f"entry {desc.digest} is a {desc.media_type}, not an image manifest")
                if not desc.platform:
                    raise DiskkitError(src, f"entry {desc.digest} names no platform")
                out.append((read_instance(source, desc), desc.media_type, desc.platform))
            return src_ref, out
        image = source.image(None)
        return src_ref, [(image.manifest_bytes, image.media_type, _platform_of(image.config, src))]

"""The OCI image model shared by every transport: descriptors, platforms, configs and manifests."""

from __future__ import annotations

import hashlib
import json
import platform as _platform
from dataclasses import dataclass, field
from datetime import datetime, timezone

from diskkit.errors import DiskkitError
from diskkit.oci import mediatypes as mt


def canonical_json(obj: object) -> bytes:
    """Compact JSON with sorted keys: the same content always gives the same digest."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True, ensure_ascii=False).encode()


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def check_digest(digest: str, where: str) -> str:
    algo, _, hexpart = digest.partition(":")
    if algo != "sha256" or len(hexpart) != 64 or not all(c in "0123456789abcdef" for c in hexpart):
        raise DiskkitError(where, f"unsupported or malformed digest {digest!r} (sha256:<64 hex> expected)")
    return hexpart


@dataclass(frozen=True)
class Platform:
    os: str
    architecture: str
    variant: str | None = None

    @classmethod
    def parse(cls, text: str) -> "Platform":
        parts = text.split("/")
        if len(parts) not in (2, 3) or not all(parts):
            raise DiskkitError(text, "platform must be OS/ARCH[/VARIANT], for example linux/amd64")
        return cls(parts[0], parts[1], parts[2] if len(parts) == 3 else None)

    @classmethod
    def host(cls) -> "Platform":
        machine = _platform.machine().lower()
        arch = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le", "s390x": "s390x"}
        return cls("linux", arch.get(machine, machine))

    def matches(self, spec: dict | None) -> bool:
        if not spec:
            return False
        if spec.get("os") != self.os or spec.get("architecture") != self.architecture:
            return False
        return self.variant is None or spec.get("variant") in (self.variant, None)

    def to_json(self) -> dict:
        out = {"architecture": self.architecture, "os": self.os}
        if self.variant:
            out["variant"] = self.variant
        return out

    def __str__(self) -> str:
        return "/".join(p for p in (self.os, self.architecture, self.variant) if p)


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    annotations: dict[str, str] = field(default_factory=dict)
    platform: dict | None = None

    def to_json(self) -> dict:
        out: dict = {"mediaType": self.media_type, "digest": self.digest, "size": self.size}
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        if self.platform:
            out["platform"] = self.platform
        return out

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "Descriptor":
        try:
            desc = cls(obj["mediaType"], obj["digest"], int(obj["size"]), dict(obj.get("annotations") or {}), obj.get("platform"))
        except (KeyError, TypeError, ValueError) as exc:
            raise DiskkitError(where, f"malformed descriptor ({exc})") from None
        check_digest(desc.digest, where)
        if desc.size < 0:
            raise DiskkitError(where, "descriptor size is negative")
        return desc


def rfc3339(epoch: int) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def make_config(
    plat: Platform,
    diff_ids: list[str],
    created: int,
    labels: dict[str, str],
    env: list[str],
    history: str,
) -> dict:
    config: dict = {}
    if labels:
        config["Labels"] = dict(labels)
    if env:
        config["Env"] = list(env)
    out = {
        **plat.to_json(),
        "created": rfc3339(created),
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": list(diff_ids)},
        "history": [{"created": rfc3339(created), "created_by": history}],
    }
    return out


def make_manifest(config: Descriptor, layers: list[Descriptor], annotations: dict[str, str], docker: bool) -> dict:
    out: dict = {
        "schemaVersion": 2,
        "mediaType": mt.DOCKER_MANIFEST if docker else mt.OCI_MANIFEST,
        "config": config.to_json(),
        "layers": [layer.to_json() for layer in layers],
    }
    if annotations and not docker:  # schema2 has no annotations field
        out["annotations"] = dict(annotations)
    return out


def make_index(manifests: list[Descriptor], annotations: dict[str, str] | None = None) -> dict:
    out: dict = {"schemaVersion": 2, "mediaType": mt.OCI_INDEX, "manifests": [m.to_json() for m in manifests]}
    if annotations:
        out["annotations"] = dict(annotations)
    return out


@dataclass
class Image:
    """A single-platform image as read from a source: manifest and config verified against their digests."""

    where: str
    manifest_bytes: bytes
    media_type: str
    digest: str
    config_bytes: bytes
    config_descriptor: Descriptor
    layers: list[Descriptor]

    @property
    def manifest(self) -> dict:
        return json.loads(self.manifest_bytes)

    @property
    def config(self) -> dict:
        return json.loads(self.config_bytes)

    @property
    def diff_ids(self) -> list[str]:
        return list((self.config.get("rootfs") or {}).get("diff_ids") or [])


def parse_json(data: bytes, where: str) -> dict:
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise DiskkitError(where, f"not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise DiskkitError(where, "JSON document is not an object")
    return obj


def manifest_media_type(obj: dict, fallback: str | None) -> str:
    media = obj.get("mediaType") or fallback
    if not media:
        media = mt.OCI_INDEX if "manifests" in obj else mt.OCI_MANIFEST
    return media


def select_platform(index: dict, plat: Platform, where: str) -> Descriptor:
    """Pick the manifest for `plat` from an index or manifest list, as containers/image does."""
    entries = [Descriptor.from_json(m, where) for m in index.get("manifests") or []]
    for desc in entries:
        if desc.media_type in mt.MANIFESTS and plat.matches(desc.platform):
            return desc
    offered = ", ".join(
        "/".join(str(d.platform.get(k)) for k in ("os", "architecture", "variant") if d.platform.get(k))
        for d in entries
        if d.platform
    )
    raise DiskkitError(where, f"no image for platform {plat} (the index offers: {offered or 'none'})")


_TO_OCI = {
    mt.DOCKER_MANIFEST: mt.OCI_MANIFEST,
    mt.DOCKER_LIST: mt.OCI_INDEX,
    mt.DOCKER_CONFIG: mt.OCI_CONFIG,
    mt.DOCKER_LAYER: mt.OCI_LAYER,
    mt.DOCKER_LAYER_GZIP: mt.OCI_LAYER_GZIP,
    mt.DOCKER_LAYER_ZSTD: mt.OCI_LAYER_ZSTD,
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip": mt.OCI_LAYER_NONDIST_GZIP,
}


def to_oci_media(media_type: str) -> str:
    return _TO_OCI.get(media_type, media_type)


_TO_DOCKER = {oci: docker for docker, oci in _TO_OCI.items() if docker != mt.DOCKER_LAYER_ZSTD}


def oci_to_docker(manifest: dict, where: str) -> dict:
    """An OCI manifest or index restated as Docker schema2, blobs unchanged, as `skopeo copy --format
    v2s2` does: schema2 has no annotations, so they go; zstd layers have no schema2 type and are
    refused in containers/image's words (manifest/docker_schema2.go)."""
    out = {k: v for k, v in manifest.items() if k != "annotations"}

    def convert(item: dict) -> dict:
        media = item.get("mediaType", "")
        if media in _TO_OCI:  # already a Docker type
            return {k: v for k, v in item.items() if k != "annotations"}
        if media == mt.OCI_LAYER_ZSTD:
            raise DiskkitError(where, f'"{media}": zstd compression is not supported for docker images')
        if media not in _TO_DOCKER:
            raise DiskkitError(where, f"{media!r} has no Docker schema2 equivalent")
        return {k: v for k, v in {**item, "mediaType": _TO_DOCKER[media]}.items() if k != "annotations"}

    out["mediaType"] = mt.DOCKER_LIST if "manifests" in manifest else mt.DOCKER_MANIFEST
    if "config" in out:
        out["config"] = convert(out["config"])
    for key in ("layers", "manifests"):
        if key in out:
            out[key] = [convert(item) for item in out[key]]
    return out


def docker_to_oci(manifest: dict) -> dict:
    """A schema2 manifest or manifest list restated with OCI media types, blobs unchanged.

    OCI layouts may only index OCI types (skopeo and umoci ignore the rest), so images copied
    into them are converted as containers/image does; the digest changes, the content does not.
    """
    out = dict(manifest)
    out["mediaType"] = to_oci_media(manifest.get("mediaType", ""))
    for key in ("config",):
        if key in out:
            out[key] = {**out[key], "mediaType": to_oci_media(out[key]["mediaType"])}
    for key in ("layers", "manifests"):
        if key in out:
            out[key] = [{**item, "mediaType": to_oci_media(item["mediaType"])} for item in out[key]]
    return out

"""Sigstore attachments: signatures kept in the image's own repository as an OCI manifest tagged
`sha256-<hex>.sig`, one layer per signature (containers/image docker/docker_image_dest.go
putSignaturesToSigstoreAttachments, docker/docker_client.go sigstoreAttachmentTag)."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

from diskkit.errors import DiskkitError, RegistryError
from diskkit.limits import check_signature_count
from diskkit.oci import mediatypes as mt
from diskkit.oci.image import Descriptor, sha256_digest
from diskkit.oci.reference import DockerName, ImageRef
from diskkit.registry.client import MAX_SIGNATURE_BYTES, check_status, get_blob, read_body, scope
from diskkit.registry.options import RegistryOptions
from diskkit.signing import keys
from diskkit.signing.payload import MIME_TYPE, SIGNATURE_ANNOTATION, make_payload
from diskkit.transports.remote import RemoteDestination, registry_for


@dataclass(frozen=True)
class Attached:
    """One layer of an attachment manifest, untrusted until a policy accepts it."""

    media_type: str
    payload: bytes
    annotations: dict


def attachment_tag(digest: str) -> str:
    algorithm, _, hexpart = digest.partition(":")
    if algorithm != "sha256" or len(hexpart) != 64:
        raise DiskkitError(digest, "sigstore attachments are only defined for sha256 digests")
    return f"{algorithm}-{hexpart}.sig"


def _attachment_manifest(name: DockerName, digest: str, opts: RegistryOptions, actions: str) -> dict | None:
    registry = registry_for(name.registry, opts)
    tag = attachment_tag(digest)
    response = registry.request(
        "GET", f"/v2/{name.repository}/manifests/{tag}", scope(name.repository, actions),
        headers={"Accept": mt.OCI_MANIFEST}, stream=True, what="GET sigstore attachment",
    )
    if response.status_code == 404:
        response.close()
        return None
    check_status(response, (200,), registry.host, f"GET manifest {tag}")
    data = read_body(response, MAX_SIGNATURE_BYTES, f"{name.registry}/{name.repository}:{tag}", "attachment manifest")
    try:
        manifest = json.loads(data)
    except ValueError:
        raise RegistryError(f"{name.registry}/{name.repository}:{tag}", "attachment manifest is not JSON") from None
    if manifest.get("mediaType", mt.OCI_MANIFEST) != mt.OCI_MANIFEST or not isinstance(manifest.get("layers", []), list):
        raise RegistryError(f"{name.registry}/{name.repository}:{tag}", "unexpected sigstore attachment manifest, not an OCI image manifest")
    return manifest


def _small_blob(name: DockerName, desc: Descriptor, opts: RegistryOptions) -> bytes:
    where = f"{name.registry}/{name.repository}@{desc.digest}"
    if desc.size > MAX_SIGNATURE_BYTES:
        raise RegistryError(where, "signature larger than 4 MiB refused")
    response = get_blob(registry_for(name.registry, opts), name.repository, desc.digest)
    data = read_body(response, MAX_SIGNATURE_BYTES, where, "signature")
    if len(data) != desc.size or sha256_digest(data) != desc.digest:
        raise RegistryError(where, "signature blob does not match its digest")
    return data


def read_signatures(name: DockerName, digest: str, opts: RegistryOptions) -> list[Attached]:
    """Every layer of the attachment for `digest`, payload verified against its layer digest; [] when none."""
    manifest = _attachment_manifest(name, digest, opts, "pull")
    if manifest is None:
        return []
    layers = manifest.get("layers") or []
    # Each is a request and a verification: as many as a lookaside may hold (containers/image has no bound here).
    check_signature_count(len(layers), f"{name.registry}/{name.repository}:{attachment_tag(digest)}")
    found = []
    for i, layer in enumerate(layers):
        desc = Descriptor.from_json(layer, f"{name.repository}:{attachment_tag(digest)} layer {i}")
        found.append(Attached(desc.media_type, _small_blob(name, desc, opts), dict(layer.get("annotations") or {})))
    return found


def signature_layer(private_key, docker_reference: str, digest: str) -> Attached:
    payload = make_payload(docker_reference, digest)
    sig = base64.b64encode(keys.sign(private_key, payload)).decode()
    return Attached(MIME_TYPE, payload, {SIGNATURE_ANNOTATION: sig})


def put_signature(name: DockerName, digest: str, signature: Attached, opts: RegistryOptions) -> str:
    """Add one signature to the attachment for `digest` (kept layers first, a twin not added twice); the tag."""
    tag = attachment_tag(digest)
    dest = RemoteDestination(ImageRef("docker", name=DockerName(name.registry, name.repository, tag=tag)), opts)
    manifest = _attachment_manifest(name, digest, opts, "pull,push")
    layers = list((manifest or {}).get("layers") or [])
    diff_ids: list[str] = []
    if manifest is not None:
        config_desc = Descriptor.from_json(manifest["config"], tag)
        diff_ids = list((json.loads(_small_blob(name, config_desc, opts)).get("rootfs") or {}).get("diff_ids") or [])
    blob = Descriptor(signature.media_type, sha256_digest(signature.payload), len(signature.payload))
    twin = any(
        l.get("mediaType") == blob.media_type and l.get("digest") == blob.digest and (l.get("annotations") or {}) == signature.annotations
        for l in layers
    )
    if not twin:
        dest.put_blob(signature.payload, signature.media_type)
        layers.append({**blob.to_json(), "annotations": signature.annotations})
        diff_ids.append(blob.digest)
    # The config's fields are the ones Go's encoding of an empty OCI image config leaves in.
    config = json.dumps({"architecture": "", "os": "", "config": {}, "rootfs": {"type": "layers", "diff_ids": diff_ids}}, separators=(",", ":")).encode()
    config_desc = dest.put_blob(config, mt.OCI_CONFIG)
    body = {"schemaVersion": 2, "mediaType": mt.OCI_MANIFEST, "config": config_desc.to_json(), "layers": layers}
    dest.put_manifest(json.dumps(body, separators=(",", ":")).encode(), mt.OCI_MANIFEST)
    return tag

"""OCI 1.1 referrers: an artifact manifest whose `subject` is an image, pushed and listed through
the registry's referrers API, or the referrers tag schema where the registry has none
(distribution-spec spec.md "Pushing Manifests with Subject" and "Referrers Tag Schema"): an index
tagged `sha256-<hex>` listing the referrers, kept up to date by the client, as oras and cosign do.

The distribution registry 2.8 Debian ships has no referrers API (GET /v2/<name>/referrers/<digest>
is 404 and a manifest PUT answers no OCI-Subject header), so the tests exercise the fallback.
"""

from __future__ import annotations

import json

from diskkit.errors import RegistryError
from diskkit.oci import mediatypes as mt
from diskkit.oci.artifact import EMPTY_CONFIG, EMPTY_CONFIG_DATA
from diskkit.oci.image import Descriptor, sha256_digest
from diskkit.oci.reference import DockerName, ImageRef
from diskkit.registry.client import MAX_MANIFEST_BYTES, MAX_SIGNATURE_BYTES, check_status, get_blob, read_body, scope
from diskkit.registry.options import RegistryOptions
from diskkit.signing.attestation import PREDICATE_ANNOTATION
from diskkit.transports.remote import RemoteDestination, registry_for


def fallback_tag(digest: str) -> str:
    algorithm, _, hexpart = digest.partition(":")
    return f"{algorithm}-{hexpart}"


def _index(name: DockerName, digest: str, opts: RegistryOptions, actions: str) -> tuple[dict, bool]:
    """(the referrers index of `digest`, whether it came from the referrers API)."""
    registry = registry_for(name.registry, opts)
    where = f"{name.registry}/{name.repository}"
    response = registry.request("GET", f"/v2/{name.repository}/referrers/{digest}", scope(name.repository, actions),
                                headers={"Accept": mt.OCI_INDEX}, stream=True, what="GET referrers")
    api = response.status_code == 200
    if not api:
        # 404 (or 400/405 from a registry that routes no such path): the tag schema instead.
        response.close()
        tag = fallback_tag(digest)
        response = registry.request("GET", f"/v2/{name.repository}/manifests/{tag}", scope(name.repository, actions),
                                    headers={"Accept": mt.OCI_INDEX}, stream=True, what="GET referrers tag")
        if response.status_code == 404:
            response.close()
            return {"schemaVersion": 2, "mediaType": mt.OCI_INDEX, "manifests": []}, False
        check_status(response, (200,), registry.host, f"GET manifest {tag}")
    data = read_body(response, MAX_MANIFEST_BYTES, where, "referrers index")
    try:
        index = json.loads(data)
    except ValueError:
        raise RegistryError(where, f"the referrers index of {digest} is not JSON") from None
    if not isinstance(index, dict) or index.get("mediaType", mt.OCI_INDEX) != mt.OCI_INDEX or not isinstance(index.get("manifests", []), list):
        raise RegistryError(where, f"the referrers index of {digest} is not an OCI image index")
    return index, api


def list_referrers(name: DockerName, digest: str, opts: RegistryOptions, artifact_types: tuple[str, ...],
                   predicate_type: str | None = None) -> list[Descriptor]:
    """The descriptors of `digest`'s referrers of these artifact types, in the index's order
    (untrusted: each manifest is read by digest and checked by the caller). With `predicate_type`,
    entries whose predicate annotation names another are left out (one without the annotation stays)."""
    index, _ = _index(name, digest, opts, "pull")
    out = []
    for i, entry in enumerate(index.get("manifests") or []):
        if not isinstance(entry, dict) or entry.get("artifactType") not in artifact_types:
            continue
        notes = entry.get("annotations") if isinstance(entry.get("annotations"), dict) else {}
        if predicate_type is not None and notes.get(PREDICATE_ANNOTATION, predicate_type) != predicate_type:
            continue
        out.append(Descriptor.from_json(entry, f"referrers of {digest} [{i}]"))
    return out


def read_artifact(name: DockerName, desc: Descriptor, subject: str, opts: RegistryOptions,
                  limit: int = MAX_SIGNATURE_BYTES) -> tuple[dict, bytes]:
    """(the referrer's manifest, its one layer's bytes): the manifest must hash to its digest and
    name `subject`; a layer over `limit` bytes is refused unread, and what is read is checked
    against its digest."""
    registry = registry_for(name.registry, opts)
    where = f"{name.registry}/{name.repository}@{desc.digest}"
    response = registry.request("GET", f"/v2/{name.repository}/manifests/{desc.digest}", scope(name.repository, "pull"),
                                headers={"Accept": mt.OCI_MANIFEST}, stream=True, what="GET referrer")
    check_status(response, (200,), registry.host, f"GET manifest {desc.digest[:19]}")
    data = read_body(response, MAX_MANIFEST_BYTES, where, "referrer manifest")
    if sha256_digest(data) != desc.digest:
        raise RegistryError(where, "the referrer manifest does not match its digest")
    try:
        manifest = json.loads(data)
        layers = manifest["layers"]
        found_subject = manifest["subject"]["digest"]
    except (ValueError, KeyError, TypeError):
        raise RegistryError(where, "not an OCI 1.1 artifact manifest with a subject") from None
    if found_subject != subject:
        raise RegistryError(where, f"the referrer's subject is {found_subject}, not {subject}")
    if not isinstance(layers, list) or len(layers) != 1:
        raise RegistryError(where, "an attestation referrer has exactly one layer")
    layer = Descriptor.from_json(layers[0], f"{where} layer")
    if layer.size > limit:
        raise RegistryError(where, f"attestation of {layer.size} bytes, larger than {limit}, refused")
    blob = read_body(get_blob(registry, name.repository, layer.digest), limit, where, "attestation")
    if len(blob) != layer.size or sha256_digest(blob) != layer.digest:
        raise RegistryError(where, "the attestation blob does not match its digest")
    return manifest, blob


def push_referrer(name: DockerName, subject: Descriptor, artifact_type: str, blob: bytes, annotations: dict,
                  opts: RegistryOptions) -> tuple[Descriptor, str]:
    """Push `blob` as the one layer of an artifact manifest referring to `subject`; (its descriptor,
    "api" or the fallback tag it was listed under). Adding to the tag's index is read-modify-write:
    two pushes at once can lose one entry, as with every client of the tag schema."""
    dest = RemoteDestination(ImageRef("docker", name=DockerName(name.registry, name.repository)), opts)
    config = dest.put_blob(EMPTY_CONFIG_DATA, EMPTY_CONFIG)
    layer = dest.put_blob(blob, artifact_type)
    body = {"schemaVersion": 2, "mediaType": mt.OCI_MANIFEST, "artifactType": artifact_type,
            "config": config.to_json(), "layers": [layer.to_json()],
            "subject": {"mediaType": subject.media_type, "digest": subject.digest, "size": subject.size},
            "annotations": annotations}
    data = json.dumps(body, separators=(",", ":")).encode()
    digest = sha256_digest(data)
    registry = dest.registry
    response = registry.request("PUT", f"/v2/{name.repository}/manifests/{digest}", dest.push_scope,
                                headers={"Content-Type": mt.OCI_MANIFEST}, body=data, what="PUT referrer")
    check_status(response, (201, 200, 202), registry.host, f"PUT manifest {digest[:19]}")
    desc = Descriptor(mt.OCI_MANIFEST, digest, len(data))
    if response.headers.get("OCI-Subject") == subject.digest:
        return desc, "api"  # the registry lists it itself
    index, _ = _index(name, subject.digest, opts, "pull,push")
    entry = {**desc.to_json(), "artifactType": artifact_type, "annotations": annotations}
    manifests = [m for m in index.get("manifests") or [] if not (isinstance(m, dict) and m.get("digest") == digest)]
    index = {"schemaVersion": 2, "mediaType": mt.OCI_INDEX, "manifests": [*manifests, entry]}
    tag = fallback_tag(subject.digest)
    response = registry.request("PUT", f"/v2/{name.repository}/manifests/{tag}", dest.push_scope,
                                headers={"Content-Type": mt.OCI_INDEX}, body=json.dumps(index, separators=(",", ":")).encode(),
                                what="PUT referrers tag")
    check_status(response, (201, 200, 202), registry.host, f"PUT manifest {tag}")
    return desc, tag

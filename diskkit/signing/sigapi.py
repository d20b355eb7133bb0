"""GPG simple signatures kept by the registry itself, through the signature API extension that
OpenShift's integrated registry offers and advertises with `X-Registry-Supports-Signatures: 1` on
/v2/ (containers/image docker/docker_client.go getExtensionsSignatures, docker_image_src.go
appendSignaturesFromAPIExtension, docker_image_dest.go putSignaturesToAPIExtension).

As containers/image does, a registry that advertises the API is read and written through it
whatever lookaside registries.d names (GetSignaturesWithFormat and PutSignaturesWithFormat try
`supportsSignatures` before `signatureBase`); a registry that does not is never asked the path.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import secrets

from diskkit.errors import DiskkitError
from diskkit.limits import MAX_SIGNATURE_LIST_BYTES, check_signature_count
from diskkit.registry.client import Registry, check_status, read_body, scope

PATH = "/extensions/v2/{repository}/signatures/{digest}"  # extensionsSignaturePath
SCHEMA_VERSION = 2  # extensionSignatureSchemaVersion
TYPE_ATOMIC = "atomic"  # extensionSignatureTypeAtomic
_DIGEST = re.compile(r"^(sha256|sha512):[0-9a-f]+$")


def supported(registry: Registry) -> bool:
    registry.base()  # pings /v2/ once, where the header is read
    return registry.supports_signatures


def parse_list(body: bytes, where: str) -> list[dict]:
    """The `signatures` of an extensionSignatureList, each with its content decoded (Go's []byte is
    standard base64 in JSON); anything else refused as json.Unmarshal refuses it."""
    try:
        doc = json.loads(body)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
        listed = doc.get("signatures")
        listed = [] if listed is None else listed
        if not isinstance(listed, list):
            raise ValueError("signatures is not a list")
        parsed = []
        for sig in listed:
            if not isinstance(sig, dict):
                raise ValueError("a signature is not an object")
            content = sig.get("content")
            if content is not None and not isinstance(content, str):
                raise ValueError("content is not a string")
            parsed.append({"schemaVersion": sig.get("schemaVersion"), "name": sig.get("name"), "type": sig.get("type"),
                           "content": base64.b64decode(content or "", validate=True)})
        return parsed
    except (ValueError, binascii.Error) as exc:
        raise DiskkitError(where, f"decoding signature list: {exc}") from None


def atomic_contents(listed: list[dict]) -> list[bytes]:
    """The contents of the atomic signatures of the current schema; others are passed over as
    appendSignaturesFromAPIExtension does."""
    return [sig["content"] for sig in listed if sig["schemaVersion"] == SCHEMA_VERSION and sig["type"] == TYPE_ATOMIC]


def _path(repository: str, digest: str) -> str:
    if not _DIGEST.match(digest):
        raise DiskkitError(digest, "invalid manifest digest for a signature location")
    return PATH.format(repository=repository, digest=digest)


def _list(registry: Registry, repository: str, digest: str) -> list[dict]:
    path = _path(repository, digest)
    response = registry.request("GET", path, scope(repository, "pull"), stream=True, what="GET signatures")
    check_status(response, (200,), registry.host, f"downloading signatures for {digest} in {registry.host}/{repository}")
    return parse_list(read_body(response, MAX_SIGNATURE_LIST_BYTES, registry.host, "the signature list"), f"{registry.host}{path}")


def read(registry: Registry, repository: str, digest: str) -> list[bytes]:
    """The OpenPGP messages (untrusted) the registry keeps for `digest`, refused beyond
    diskkit.limits.MAX_SIGNATURES before any is verified: containers/image bounds only the list's
    bytes here, and its 4 MiB hold some 60,000 entries, each a gpg process."""
    contents = atomic_contents(_list(registry, repository, digest))
    check_signature_count(len(contents), f"{registry.host}{_path(repository, digest)}")
    return contents


def new_entry(digest: str, blob: bytes, taken: set[str]) -> dict:
    """An extensionSignature for `blob` under a name `<digest>@<32 random hex>` not in `taken`
    (the API expects the client to invent a unique name)."""
    while True:
        name = f"{digest}@{secrets.token_hex(16)}"
        if name not in taken:
            return {"schemaVersion": SCHEMA_VERSION, "name": name, "type": TYPE_ATOMIC, "content": base64.b64encode(blob).decode()}


def append(registry: Registry, repository: str, digest: str, signatures: list[bytes]) -> int:
    """PUT each signature the registry does not already hold for `digest` (the API only adds);
    the number added."""
    if not signatures:
        return 0
    existing = _list(registry, repository, digest)
    taken = {sig["name"] for sig in existing}
    have = set(atomic_contents(existing))
    path = _path(repository, digest)
    added = 0
    for blob in signatures:
        if blob in have:
            continue
        entry = new_entry(digest, blob, taken)
        taken.add(entry["name"])
        have.add(blob)
        response = registry.request("PUT", path, scope(repository, "pull,push"), headers={"Content-Type": "application/json"},
                                    body=json.dumps(entry).encode(), what="PUT signature")
        check_status(response, (201,), registry.host, f"uploading signature to {path} in {registry.host}")
        added += 1
    return added

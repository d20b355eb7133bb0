"""The simple-signing payload both signature formats cover: a sigstore signature's (containers/image
signature/internal/sigstore_payload.go, type "cosign container image signature") and a GPG one's
(signature/simple.go, the "atomic container signature"): what it says and how strictly it is read back."""

from __future__ import annotations

import json
import re
import time

from diskkit import __version__

SIGNATURE_TYPE = "cosign container image signature"
ATOMIC_TYPE = "atomic container signature"
MIME_TYPE = "application/vnd.dev.cosign.simplesigning.v1+json"
SIGNATURE_ANNOTATION = "dev.cosignproject.cosign/signature"
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$|^sha512:[0-9a-f]{128}$")


class InvalidPayload(ValueError):
    pass


def make_payload(docker_reference: str, manifest_digest: str, timestamp: int | None = None, kind: str = SIGNATURE_TYPE) -> bytes:
    """Bytes as Go's json.Marshal writes them (sorted keys, no spaces): cosign and skopeo verify these."""
    body = {
        "critical": {
            "identity": {"docker-reference": docker_reference},
            "image": {"docker-manifest-digest": manifest_digest},
            "type": kind,
        },
        "optional": {"creator": f"diskkit {__version__}", "timestamp": int(time.time()) if timestamp is None else timestamp},
    }
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _exact(obj, fields: set[str], what: str) -> dict:
    if not isinstance(obj, dict):
        raise InvalidPayload(f"{what} is not a JSON object")
    if set(obj) != fields:
        extra, missing = sorted(set(obj) - fields), sorted(fields - set(obj))
        raise InvalidPayload(f"{what}: unexpected field {extra[0]}" if extra else f"{what}: missing field {missing[0]}")
    return obj


def parse_payload(data: bytes, kind: str = SIGNATURE_TYPE) -> tuple[str, str]:
    """(docker-reference, docker-manifest-digest); exactly the fields the format has, as containers/image insists."""
    try:
        obj = json.loads(data)
    except ValueError as exc:
        raise InvalidPayload(f"payload is not JSON: {exc}") from None
    top = _exact(obj, {"critical", "optional"}, "payload")
    if top["optional"] is not None and not isinstance(top["optional"], dict):
        raise InvalidPayload("optional is not a JSON object")
    stamp = (top["optional"] or {}).get("timestamp")
    if stamp is not None and (not isinstance(stamp, (int, float)) or isinstance(stamp, bool) or int(stamp) != stamp):
        raise InvalidPayload("Field optional.timestamp is not an integer")
    critical = _exact(top["critical"], {"type", "image", "identity"}, "critical")
    if critical["type"] != kind:
        raise InvalidPayload(f"Unrecognized signature type {critical['type']}")
    digest = _exact(critical["image"], {"docker-manifest-digest"}, "critical.image")["docker-manifest-digest"]
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise InvalidPayload(f"invalid docker-manifest-digest value {digest!r}")
    reference = _exact(critical["identity"], {"docker-reference"}, "critical.identity")["docker-reference"]
    if not isinstance(reference, str):
        raise InvalidPayload("docker-reference is not a string")
    return reference, digest

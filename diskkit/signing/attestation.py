"""Boot-test attestations: an in-toto Statement v1 about one image digest, in a DSSE envelope.

Pure: the statement, DSSE's pre-authentication encoding (PAE), the two stored forms and reading
them back; signing and checking a signature are given as callables (sigstore keys through
diskkit.signing.keys, GPG through diskkit.signing.openpgp), and the registry I/O is
diskkit.signing.referrers'.

Two stored forms, one per key kind:
- a sigstore (cosign-format) key signs ECDSA over the PAE, as `cosign attest --key` does; the
  envelope goes in a Sigstore bundle v0.3 with the public key as its verification material,
  stored as cosign's specs/BUNDLE_SPEC.md lays bundles out in a registry (an OCI 1.1 referrer);
- a GPG key makes a detached OpenPGP signature over the PAE, the keyid being its fingerprint. DSSE
  leaves the algorithm open, so cosign and the in-toto tools parse this envelope but none of them
  checks an OpenPGP signature: only diskkit (or `gpg --verify` over the PAE) does. It is stored as
  the bare envelope (application/vnd.dsse.envelope.v1+json, the layer type cosign's `.att` uses),
  not as a Sigstore bundle, whose verification material has no place for an OpenPGP key.

The predicate type is ours; no peer knows what it means.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
PREDICATE_TYPE = "urn:diskkit:attestation:boot-test:v1"  # a URN: a URI of ours that claims no web domain
DSSE_MEDIA_TYPE = "application/vnd.dsse.envelope.v1+json"
BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
ARTIFACT_TYPES = (BUNDLE_MEDIA_TYPE, DSSE_MEDIA_TYPE)
# cosign's BUNDLE_SPEC.md annotations, on the referrer manifest and its entry in the referrers index.
CONTENT_ANNOTATION = "dev.sigstore.bundle.content"
PREDICATE_ANNOTATION = "dev.sigstore.bundle.predicateType"
CREATED_ANNOTATION = "org.opencontainers.image.created"
_SHA256 = re.compile(r"^sha256:([0-9a-f]{64})$")


class NotAccepted(Exception):
    """This attestation does not hold; the message says why in one line."""


def statement(repository: str, digest: str, predicate: dict, predicate_type: str = PREDICATE_TYPE) -> bytes:
    """The in-toto Statement v1: subject the image's repository (cosign's subject name, registry
    host included) and its manifest digest."""
    match = _SHA256.match(digest)
    if not match:
        raise ValueError(f"{digest}: an attestation subject needs a sha256 manifest digest")
    body = {"_type": STATEMENT_TYPE, "subject": [{"name": repository, "digest": {"sha256": match.group(1)}}],
            "predicateType": predicate_type, "predicate": predicate}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def boot_test_predicate(image: str, digest: str, command: str, boot_to_ssh: float | None, passed: bool,
                        exit_status: int | None, reason: str, launcher: str, timestamp: str) -> dict:
    return {"image": image, "imageDigest": digest, "command": command, "bootToSshSeconds": boot_to_ssh,
            "result": "pass" if passed else "fail", "exitStatus": exit_status, "reason": reason,
            "launcher": launcher, "timestamp": timestamp}


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1's pre-authentication encoding: what is signed, never the JSON around it."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(payload), payload)


def envelope(payload: bytes, keyid: str, signature: bytes) -> dict:
    return {"payloadType": PAYLOAD_TYPE, "payload": base64.b64encode(payload).decode(),
            "signatures": [{"keyid": keyid, "sig": base64.b64encode(signature).decode()}]}


def bundle(env: dict, key_hint: str) -> dict:
    """A Sigstore bundle v0.3 (protobuf-specs sigstore_bundle.proto, JSON form) around the envelope,
    verified by a public key the verifier already holds; no transparency log entry."""
    return {"mediaType": BUNDLE_MEDIA_TYPE, "verificationMaterial": {"publicKey": {"hint": key_hint}, "tlogEntries": []},
            "dsseEnvelope": env}


def stored(artifact_type: str, env: dict, key_hint: str) -> bytes:
    """The referrer's one layer, as bytes."""
    doc = bundle(env, key_hint) if artifact_type == BUNDLE_MEDIA_TYPE else env
    return json.dumps(doc, separators=(",", ":")).encode()


def read_envelope(artifact_type: str, data: bytes) -> dict:
    """The DSSE envelope of a stored layer, checked for shape; NotAccepted otherwise."""
    try:
        doc = json.loads(data)
    except ValueError:
        raise NotAccepted("the attestation is not JSON") from None
    if artifact_type == BUNDLE_MEDIA_TYPE:
        if not isinstance(doc, dict) or doc.get("mediaType") != BUNDLE_MEDIA_TYPE or "dsseEnvelope" not in doc:
            raise NotAccepted("the Sigstore bundle holds no DSSE envelope")
        doc = doc["dsseEnvelope"]
    if not isinstance(doc, dict) or not isinstance(doc.get("payload"), str) or not isinstance(doc.get("signatures"), list):
        raise NotAccepted("not a DSSE envelope")
    if doc.get("payloadType") != PAYLOAD_TYPE:
        raise NotAccepted(f"payloadType {doc.get('payloadType')!r} is not {PAYLOAD_TYPE}")
    return doc


def open_envelope(env: dict, verifies: Callable[[bytes, str, bytes], str | None]) -> tuple[dict, str]:
    """(the statement, who signed it) when one of the envelope's signatures verifies over the PAE.
    `verifies(pae, keyid, signature)` gives the signer's name, or None."""
    try:
        payload = base64.b64decode(env["payload"], validate=True)
    except ValueError:
        raise NotAccepted("the envelope's payload is not base64") from None
    signed = pae(env["payloadType"], payload)
    reasons = []
    for sig in env["signatures"]:
        try:
            raw = base64.b64decode(sig["sig"], validate=True)
        except (ValueError, KeyError, TypeError):
            reasons.append("a signature is not base64")
            continue
        keyid = sig.get("keyid", "") if isinstance(sig.get("keyid", ""), str) else ""
        try:
            who = verifies(signed, keyid, raw)
        except NotAccepted as exc:
            reasons.append(str(exc))
            continue
        if who is not None:
            try:
                return json.loads(payload), who
            except ValueError:
                raise NotAccepted("the signed statement is not JSON") from None
        reasons.append("the signature does not verify with the given keys")
    raise NotAccepted(reasons[0] if reasons else "the envelope has no signatures")


def statement_predicate(doc, digest: str, predicate_type: str) -> dict:
    """The predicate of a statement about `digest` of `predicate_type`; NotAccepted otherwise."""
    if not isinstance(doc, dict) or doc.get("_type") != STATEMENT_TYPE:
        raise NotAccepted(f"the statement's _type is not {STATEMENT_TYPE}")
    hexpart = digest.partition(":")[2]
    subjects = doc.get("subject") if isinstance(doc.get("subject"), list) else []
    if not any(isinstance(s, dict) and isinstance(s.get("digest"), dict) and s["digest"].get("sha256") == hexpart for s in subjects):
        raise NotAccepted(f"the statement's subject is not {digest}")
    if doc.get("predicateType") != predicate_type:
        raise NotAccepted(f"predicateType {doc.get('predicateType')!r} is not {predicate_type}")
    predicate = doc.get("predicate")
    if not isinstance(predicate, dict):
        raise NotAccepted("the predicate is not a JSON object")
    return predicate


def check_statement(doc, digest: str, require_pass: bool) -> dict:
    """The predicate of a boot-test statement about `digest`; NotAccepted otherwise."""
    predicate = statement_predicate(doc, digest, PREDICATE_TYPE)
    if predicate.get("imageDigest") != digest:
        raise NotAccepted(f"the predicate is not about {digest}")
    if require_pass and predicate.get("result") != "pass":
        raise NotAccepted(f"the boot test failed ({predicate.get('reason') or predicate.get('result')})")
    return predicate

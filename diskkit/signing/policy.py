"""containers-policy.json: which requirements apply to an image and whether its signatures meet them.

Pure but for gpg: loading reads the file and its keys; evaluation gets the signatures from a
callable, so the registry and lookaside I/O stays in diskkit.signing.trust; signedBy's signatures
are checked by gpg in a throw-away home (diskkit.signing.openpgp.Keyring). Rules and refusal words follow containers/image
signature/policy_config.go, policy_eval.go, policy_eval_simple.go, policy_eval_sigstore.go,
policy_eval_signedby.go, simple.go and policy_reference_match.go; scopes follow docker/policyconfiguration/naming.go.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from diskkit.errors import DiskkitError
from diskkit.oci.reference import DockerName, parse_docker_name
from diskkit.signing.payload import (
    ATOMIC_TYPE,
    MIME_TYPE,
    SIGNATURE_ANNOTATION,
    SIGNATURE_TYPE,
    InvalidPayload,
    parse_payload,
)

SYSTEM_POLICY = Path("/etc/containers/policy.json")
IDENTITY_TYPES = ("matchExact", "matchRepoDigestOrExact", "matchRepository", "exactReference", "exactRepository", "remapIdentity")
KEY_FIELDS = ("keyPath", "keyPaths", "keyData", "keyDatas")
UNSUPPORTED_SIGSTORE = ("fulcio", "pki", "rekorPublicKeyPath", "rekorPublicKeyPaths", "rekorPublicKeyData", "rekorPublicKeyDatas")


GPG_KEY_FIELDS = ("keyPath", "keyPaths", "keyData")
# policy_config.go accepts these keyType values; only GPGKeys is evaluated (policy_eval_signedby.go).
KEY_TYPES = ("GPGKeys", "signedByGPGKeys", "X509Certificates", "signedByX509CAs")


class Rejected(Exception):
    """A requirement said no; the message is containers/image's words."""


@dataclass
class Requirement:
    type: str
    keys: list = field(default_factory=list)  # sigstoreSigned: public keys; signedBy: keyring blobs
    identity: dict = field(default_factory=lambda: {"type": "matchRepoDigestOrExact"})


@dataclass
class Policy:
    source: str
    default: list[Requirement]
    transports: dict[str, dict[str, list[Requirement]]]


def default_path() -> Path | None:
    """$HOME/.config/containers/policy.json when it exists, else /etc/containers/policy.json, else None."""
    user = Path(os.environ.get("HOME", "/")) / ".config/containers/policy.json"
    if user.is_file():
        return user
    return SYSTEM_POLICY if SYSTEM_POLICY.is_file() else None


def load(path: Path) -> Policy:
    where = str(path)
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise DiskkitError(where, f"cannot read the signature policy: {exc.strerror}") from None
    except ValueError as exc:
        raise DiskkitError(where, f"invalid policy: {exc}") from None
    if not isinstance(doc, dict):
        raise DiskkitError(where, "invalid policy: not a JSON object")
    for name in doc:
        if name not in ("default", "transports"):
            raise DiskkitError(where, f'invalid policy: unknown key "{name}"')
    if "default" not in doc:
        raise DiskkitError(where, 'invalid policy: Policy.Default is missing')
    default = _requirements(doc["default"], f"{where}: default")
    transports: dict[str, dict[str, list[Requirement]]] = {}
    for transport, scopes in (doc.get("transports") or {}).items():
        if not isinstance(scopes, dict):
            raise DiskkitError(f"{where}: transports.{transport}", "must be an object of scopes")
        transports[transport] = {s: _requirements(r, f"{where}: transports.{transport}[{s!r}]") for s, r in scopes.items()}
    return Policy(where, default, transports)


def _requirements(items, where: str) -> list[Requirement]:
    if not isinstance(items, list) or not items:
        raise DiskkitError(where, "List of verification policy requirements must not be empty")
    return [_requirement(item, f"{where}[{i}]") for i, item in enumerate(items)]


def _requirement(obj, where: str) -> Requirement:
    if not isinstance(obj, dict) or "type" not in obj:
        raise DiskkitError(where, "a policy requirement needs a type")
    kind = obj["type"]
    if kind in ("insecureAcceptAnything", "reject"):
        if set(obj) != {"type"}:
            raise DiskkitError(where, f"{kind} takes no other fields")
        return Requirement(kind)
    if kind == "signedBaseLayer":
        raise DiskkitError(where, f"policy requirement {kind} is not implemented by diskkit (only signedBy, sigstoreSigned, insecureAcceptAnything, reject)")
    if kind == "signedBy":
        return _signed_by(obj, where)
    if kind != "sigstoreSigned":
        raise DiskkitError(where, f'Unknown policy requirement type "{kind}"')
    for name in obj:
        if name in UNSUPPORTED_SIGSTORE:
            raise DiskkitError(f"{where}.{name}", "Fulcio, PKI and Rekor verification are not implemented by diskkit; use public keys")
        if name not in ("type", "signedIdentity", *KEY_FIELDS):
            raise DiskkitError(where, f'invalid policy: unknown key "{name}"')
    given = [k for k in KEY_FIELDS if k in obj]
    if len(given) != 1:
        raise DiskkitError(where, 'exactly one of "keyPath", "keyPaths", "keyData" and "keyDatas" must be specified')
    pems = _key_sources(obj, given[0], where)
    from diskkit.signing import keys  # cryptography: only when a policy names keys
    public = [k for data, origin in pems for k in keys.load_public_keys(data, origin)]
    identity = obj.get("signedIdentity", {"type": "matchRepoDigestOrExact"})
    _check_identity(identity, f"{where}.signedIdentity")
    return Requirement(kind, public, identity)


def _key_sources(obj: dict, name: str, where: str) -> list[tuple[bytes, str]]:
    """(bytes, origin) of each key file or base64 keyData the field names."""
    pems: list[tuple[bytes, str]] = []
    values = obj[name] if name.endswith("s") else [obj[name]]
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        raise DiskkitError(f"{where}.{name}", "must be a string (or a non-empty list of strings)")
    for value in values:
        if name.startswith("keyPath"):
            path = Path(value)  # as containers/image reads it: a relative path is the working directory's
            try:
                pems.append((path.read_bytes(), str(path)))
            except OSError as exc:
                raise DiskkitError(f"{where}.{name}", f"cannot read {path}: {exc.strerror}") from None
        else:
            try:
                pems.append((base64.b64decode(value, validate=True), f"{where}.{name}"))
            except ValueError:
                raise DiskkitError(f"{where}.{name}", "is not base64") from None
    return pems


def _signed_by(obj: dict, where: str) -> Requirement:
    """signedBy (policy_config.go prSignedBy.UnmarshalJSON): a keyType, exactly one key source."""
    for name in obj:
        if name not in ("type", "keyType", "signedIdentity", *GPG_KEY_FIELDS):
            raise DiskkitError(where, f'invalid policy: unknown key "{name}"')
    if obj.get("keyType") not in KEY_TYPES:
        raise DiskkitError(f"{where}.keyType", f'invalid keyType {obj.get("keyType", "")!r}')
    if obj["keyType"] != "GPGKeys":
        raise DiskkitError(f"{where}.keyType", f'Unimplemented "keyType" value {obj["keyType"]!r}')
    given = [k for k in GPG_KEY_FIELDS if k in obj]
    if not given:
        raise DiskkitError(where, "Exactly one of keyPath, keyPaths and keyData must be specified, none of them present")
    if len(given) > 1:
        raise DiskkitError(where, "Exactly one of keyPath, keyPaths and keyData must be specified, more than one present")
    identity = obj.get("signedIdentity", {"type": "matchRepoDigestOrExact"})
    _check_identity(identity, f"{where}.signedIdentity")
    return Requirement("signedBy", [data for data, _ in _key_sources(obj, given[0], where)], identity)


def _check_identity(identity, where: str) -> None:
    if not isinstance(identity, dict) or identity.get("type") not in IDENTITY_TYPES:
        raise DiskkitError(where, f"unknown signedIdentity type {identity.get('type') if isinstance(identity, dict) else identity!r}")
    kind = identity["type"]
    wanted = {"exactReference": {"dockerReference"}, "exactRepository": {"dockerRepository"}, "remapIdentity": {"prefix", "signedPrefix"}}.get(kind, set())
    if set(identity) - {"type"} != wanted:
        raise DiskkitError(where, f"{kind} takes exactly the fields {sorted(wanted) or 'type only'}")


# --- scopes -----------------------------------------------------------------------------------


def identity_of(name: DockerName) -> str:
    """The policy identity: NAME:TAG or NAME@DIGEST (containers/image DockerReferenceIdentity)."""
    base = f"{name.registry}/{name.repository}"
    return f"{base}:{name.tag}" if name.tag else f"{base}@{name.digest}" if name.digest else f"{base}:latest"


def namespaces_of(name: DockerName) -> list[str]:
    """The repository, each parent path, then *.domain wildcards of the host (naming.go)."""
    out = []
    text = f"{name.registry}/{name.repository}"
    while True:
        out.append(text)
        if "/" not in text:
            break
        text = text.rsplit("/", 1)[0]
    host = text.split(":", 1)[0]
    while "." in host:
        host = host.split(".", 1)[1]
        out.append("*." + host)
    return out


def requirements_for(policy: Policy, transport: str, identity: str, namespaces: list[str]) -> tuple[str, list[Requirement]]:
    """The most specific scope of the transport (identity, namespaces, "") else the default; and its name."""
    scopes = policy.transports.get(transport)
    if scopes is not None:
        for scope in [identity, *namespaces, ""]:
            if scope in scopes:
                return f'transports.{transport}["{scope}"]', scopes[scope]
    return "default", policy.default


# --- evaluation ---------------------------------------------------------------------------------


def as_written(text: str, what: str) -> DockerName:
    """A reference as given: unlike an image to pull, a signed name without a tag stays without one
    (reference.ParseNormalizedNamed), so it never equals NAME:latest."""
    name = parse_docker_name(text, what)
    if name.tag and ":" not in text.rsplit("/", 1)[-1].split("@")[0]:
        name = replace(name, tag=None)
    return name


def _repo(name: DockerName) -> str:
    return f"{name.registry}/{name.repository}"


def _repo_digest_or_exact(intended: DockerName, signed: DockerName) -> bool:
    if intended.tag:
        return str(signed) == str(intended)
    if intended.digest:
        return _repo(signed) == _repo(intended)
    return False


def identity_matches(identity: dict, intended: DockerName | None, signed_text: str) -> bool:
    """Whether the signed reference is acceptable for the image. An image with no Docker reference
    (dir:) matches only exactReference and exactRepository: the other rules compare with the image's
    own name, and parseImageAndDockerReference fails for it (policy_reference_match.go)."""
    try:
        signed = as_written(signed_text, "signed docker-reference")
    except DiskkitError:
        return False
    kind = identity["type"]
    if intended is None and kind not in ("exactReference", "exactRepository"):
        return False
    if kind == "matchExact":
        return bool(intended.tag or intended.digest) and bool(signed.tag or signed.digest) and str(signed) == str(intended)
    if kind == "matchRepoDigestOrExact":
        return _repo_digest_or_exact(intended, signed)
    if kind == "matchRepository":
        return _repo(signed) == _repo(intended)
    if kind == "exactReference":
        try:
            wanted = as_written(identity["dockerReference"], "signedIdentity.dockerReference")
        except DiskkitError:
            return False
        return bool(wanted.tag or wanted.digest) and str(signed) == str(wanted)
    if kind == "exactRepository":
        try:
            wanted = parse_docker_name(identity["dockerRepository"], "signedIdentity.dockerRepository")
        except DiskkitError:
            return False
        return _repo(signed) == _repo(wanted)
    # remapIdentity: the prefix must end at a path boundary of the repository name.
    prefix, repo = identity["prefix"], _repo(intended)
    if repo == prefix or repo.startswith(prefix + "/"):
        try:
            intended = parse_docker_name(identity["signedPrefix"] + str(intended)[len(prefix) :], "remapped reference")
        except DiskkitError:
            return False
    return _repo_digest_or_exact(intended, signed)


def _claims_match(payload: bytes, kind: str, req: Requirement, intended: DockerName, digest: str) -> None:
    """What a cryptographically valid signature claims, in containers/image's order: the payload's
    form, then the manifest digest, then the identity under the requirement's signedIdentity."""
    try:
        signed_ref, signed_digest = parse_payload(payload, kind)
    except InvalidPayload as exc:
        raise Rejected(str(exc)) from None
    if signed_digest != digest:
        raise Rejected(f"Signature for digest {signed_digest} does not match")
    if not identity_matches(req.identity, intended, signed_ref):
        raise Rejected(f'Signature for identity "{signed_ref}" is not accepted')


def _accepts(req: Requirement, sig, intended: DockerName, digest: str) -> None:
    """Raise Rejected unless this one signature satisfies the requirement."""
    if sig.media_type != MIME_TYPE:
        raise Rejected(f"Unexpected MIME type for sigstore signature {sig.media_type!r}")
    encoded = sig.annotations.get(SIGNATURE_ANNOTATION)
    if encoded is None:
        raise Rejected(f"missing {SIGNATURE_ANNOTATION} annotation")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except ValueError:
        raise Rejected("base64 decoding: illegal base64 data") from None
    from diskkit.signing import keys
    if not any(keys.verifies(k, sig.payload, raw) for k in req.keys):
        raise Rejected("cryptographic signature verification failed: not signed by any of the policy's keys")
    _claims_match(sig.payload, SIGNATURE_TYPE, req, intended, digest)


def _accepts_gpg(keyring, req: Requirement, blob: bytes, intended: DockerName, digest: str) -> None:
    """One simple signature against a signedBy requirement, in verifyAndExtractSignature's order:
    the key, then the payload, then the digest, then the identity (signature/simple.go)."""
    from diskkit.signing.openpgp import InvalidSignature
    try:
        signed, _ = keyring.verify(blob)
    except InvalidSignature as exc:
        raise Rejected(str(exc)) from None
    _claims_match(signed, ATOMIC_TYPE, req, intended, digest)


def check(requirements: list[Requirement], image: str, intended: DockerName | None, digest: str, signatures: Callable[[str], list]) -> None:
    """Raise Rejected unless every requirement allows running the image (all must, as policy_eval.go).
    `signatures(kind)` gives the image's sigstore attachments ("sigstoreSigned") or simple
    signature blobs ("signedBy"); `intended` is None for an image with no Docker reference (dir:)."""
    for req in requirements:
        if req.type == "insecureAcceptAnything":
            continue
        if req.type == "reject":
            raise Rejected(f"Running image {image} is rejected by policy.")
        sigs = signatures(req.type)
        if not sigs:
            raise Rejected("A signature was required, but no signature exists")
        if req.type == "signedBy":
            _any_accepted(sigs, lambda blob, ring: _accepts_gpg(ring, req, blob, intended, digest), req.keys)
        else:
            _any_accepted(sigs, lambda sig, _: _accepts(req, sig, intended, digest), None)


def _any_accepted(sigs: list, accepts: Callable, gpg_keys: list[bytes] | None) -> None:
    ring = None
    if gpg_keys is not None:
        from diskkit.signing.openpgp import Keyring
        ring = Keyring(gpg_keys)
    try:
        if ring is not None and not ring.fingerprints:
            raise Rejected("No public keys imported")
        reasons = []
        for sig in sigs:
            try:
                accepts(sig, ring)
                return
            except Rejected as exc:
                reasons.append(str(exc))
        raise Rejected(reasons[0] if len(reasons) == 1 else "None of the signatures were accepted, reasons: " + "; ".join(reasons))
    finally:
        if ring is not None:
            ring.close()

"""Which boot-read trace of a manifest digest a node may follow: a referrer of that digest, signed by
a key the node trusts for that image, about that digest and that disk (diskkit.oci.readtrace).

The keys in force are those the node already trusts with the image: the boot-test keys it requires
(`--require-boot-test-key`, `--require-boot-test-gpg-key`) and the keys its signature policy asks
of the image's scope (`sigstoreSigned` and `signedBy` requirements). With none of them, no trace is
looked for: an unsigned trace, or one signed by a key the node does not know, is never followed.
A registry serves the referrers list, the manifests and the blobs, so it may lie about all of them:
it can offer another image's trace (its statement names another digest, or another disk), a trace
of any size (the layer is refused unread over diskkit.limits.MAX_TRACE_BYTES), any number of them
(the newest MAX_TRACE_CANDIDATES are tried), or ranges outside the disk (refused whole).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from diskkit.errors import DiskkitError, RegistryError
from diskkit.limits import MAX_TRACE_BYTES, MAX_TRACE_CANDIDATES
from diskkit.oci import readtrace
from diskkit.oci.reference import DockerName
from diskkit.registry.options import RegistryOptions
from diskkit.signing import attestation as at
from diskkit.signing.options import TrustOptions


@dataclass(frozen=True)
class Keys:
    sigstore: tuple[tuple[str, tuple], ...] = ()  # (where, public keys)
    gpg: tuple[bytes, ...] = ()  # keyring blobs

    def __bool__(self) -> bool:
        return bool(self.sigstore or self.gpg)


@dataclass(frozen=True)
class Accepted:
    trace: readtrace.ReadTrace
    referrer: str
    signer: str


class NoTrace(Exception):
    """No trace of this digest is to be followed; the message says why in one line."""


def keys_in_force(trust: TrustOptions, name: DockerName) -> Keys:
    """The keys that may sign a trace of `name`'s images: the boot-test keys, then the policy's for its scope."""
    from diskkit.signing import keys, policy
    from diskkit.signing.trust import load_policy

    sigstore = [(where, tuple(pubs)) for where, pubs in keys.load_public_key_files([Path(k) for k in trust.boot_test_keys])]
    gpg = []
    for path in trust.boot_test_gpg_keys:
        try:
            gpg.append(Path(path).read_bytes())
        except OSError as exc:
            raise DiskkitError(path, f"cannot read the GPG keyring: {exc.strerror}") from None
    loaded = load_policy(trust)
    if loaded is not None:
        entry, requirements = policy.requirements_for(loaded, "docker", policy.identity_of(name), policy.namespaces_of(name))
        for req in requirements:
            if req.type == "sigstoreSigned" and req.keys:
                sigstore.append((f"{loaded.source} {entry}", tuple(req.keys)))
            elif req.type == "signedBy":
                gpg.extend(req.keys)
    return Keys(tuple(sigstore), tuple(gpg))


def accepted(name: DockerName, digest: str, path: str, size: int, trusted: Keys, registry: RegistryOptions) -> Accepted:
    """The newest trace of `name`@`digest`'s disk at `path` that one of `trusted` signed; NoTrace if none."""
    from diskkit.signing import referrers
    from diskkit.signing.boottest import verifier

    if not trusted:
        raise NoTrace("no key in force to check a trace with")
    found = referrers.list_referrers(name, digest, registry, at.ARTIFACT_TYPES, readtrace.PREDICATE_TYPE)
    if not found:
        raise NoTrace(f"no trace refers to {digest[:19]}")
    newest = sorted(enumerate(found), key=lambda pair: (_created(pair[1]), pair[0]), reverse=True)[:MAX_TRACE_CANDIDATES]
    verifies, ring = verifier([(where, list(pubs)) for where, pubs in trusted.sigstore], list(trusted.gpg))
    reasons = []
    try:
        for _, each in newest:
            try:
                manifest, blob = referrers.read_artifact(name, each, digest, registry, MAX_TRACE_BYTES)
                env = at.read_envelope(manifest.get("artifactType", ""), blob)
                statement, signer = at.open_envelope(env, verifies)
                trace = readtrace.parse(at.statement_predicate(statement, digest, readtrace.PREDICATE_TYPE), digest, path, size)
            except (at.NotAccepted, readtrace.Refused, RegistryError) as exc:
                reasons.append(f"{each.digest[:19]}: {exc}")
                continue
            return Accepted(trace, f"{name.registry}/{name.repository}@{each.digest}", signer)
    finally:
        if ring is not None:
            ring.close()
    raise NoTrace("no trace accepted: " + "; ".join(reasons))


def _created(desc) -> str:
    notes = desc.annotations or {}
    value = notes.get(at.CREATED_ANNOTATION)
    return value if isinstance(value, str) else ""

"""Which boot-test attestation of a manifest digest is accepted: one referrer of our predicate type,
signed by one of the given keys, about that digest (and a passed test unless not required).

Read by `diskkit verify-attestation` and by every read under `--require-boot-test-key`
(diskkit.signing.trust), so both accept exactly the same attestations.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from diskkit.errors import DiskkitError, RegistryError, VerifyFailed
from diskkit.oci.reference import DockerName
from diskkit.registry.options import RegistryOptions
from diskkit.signing import attestation as at


@dataclass(frozen=True)
class Accepted:
    digest: str
    referrer: str
    signer: str
    predicate: dict


def verifier(loaded: list[tuple[str, list]], gpg_blobs: list[bytes], gpg_where: str = "the GPG keyring"):
    """verifies(pae, keyid, sig) -> the signer's name or None, over loaded sigstore public keys
    ((where, keys) pairs) and GPG keyring blobs; and the GnuPG keyring to close afterwards."""
    from diskkit.signing import keys

    ring = None
    if gpg_blobs:
        from diskkit.signing import openpgp

        ring = openpgp.Keyring(gpg_blobs)
        if not ring.fingerprints:
            ring.close()
            raise DiskkitError(gpg_where, "No public keys imported")

    def verifies(data: bytes, keyid: str, sig: bytes) -> str | None:
        for where, pubs in loaded:
            if any(keys.verifies(k, data, sig) for k in pubs):
                return where
        if ring is not None:
            from diskkit.signing.openpgp import InvalidSignature

            try:
                return "GPG key " + ring.verify_detached(sig, data)
            except InvalidSignature as exc:
                raise at.NotAccepted(str(exc)) from None
        return None

    return verifies, ring


def _verifier(key_paths: list[Path], gpg_keyrings: list[Path]):
    from diskkit.signing import keys

    blobs = []
    for path in gpg_keyrings:
        try:
            blobs.append(Path(path).read_bytes())
        except OSError as exc:
            raise DiskkitError(path, f"cannot read the GPG keyring: {exc.strerror}") from None
    return verifier(keys.load_public_key_files(key_paths), blobs, str(gpg_keyrings[0]) if gpg_keyrings else "")


def accepted(where: str, name: DockerName, digest: str, key_paths: list[Path], gpg_keyrings: list[Path],
             registry: RegistryOptions, require_pass: bool = True) -> Accepted:
    """The first attestation referring to `name`@`digest` the keys accept; VerifyFailed(where, why) if none."""
    from diskkit.signing import referrers

    found = referrers.list_referrers(name, digest, registry, at.ARTIFACT_TYPES, at.PREDICATE_TYPE)
    if not found:
        raise VerifyFailed(where, f"no attestation refers to {digest}")
    verifies, ring = _verifier(key_paths, gpg_keyrings)
    reasons = []
    try:
        for each in found:
            try:
                manifest, blob = referrers.read_artifact(name, each, digest, registry)
                env = at.read_envelope(manifest.get("artifactType", ""), blob)
                statement, signer = at.open_envelope(env, verifies)
                predicate = at.check_statement(statement, digest, require_pass)
            except (at.NotAccepted, RegistryError) as exc:
                reasons.append(f"{each.digest[:19]}: {exc}")
                continue
            return Accepted(digest, f"{name.registry}/{name.repository}@{each.digest}", signer, predicate)
    finally:
        if ring is not None:
            ring.close()
    raise VerifyFailed(where, f"no attestation of {digest} accepted: " + "; ".join(reasons))

"""Attach a signed boot-test attestation to an image as an OCI 1.1 referrer, and check one.

`launcher test --attest-*` attaches; `diskkit verify-attestation` checks. The statement and the
envelope are diskkit.signing.attestation's (pure); the registry side is diskkit.signing.referrers'.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from diskkit.errors import DiskkitError, RegistryError
from diskkit.oci import mediatypes as mt
from diskkit.oci.image import Descriptor, Platform, parse_json, select_platform, sha256_digest
from diskkit.oci.reference import DockerName, ImageRef, parse_ref
from diskkit.registry.options import RegistryOptions
from diskkit.signing import attestation as at
from diskkit.signing.boottest import Accepted, accepted
from diskkit.signing.options import SignOptions
from diskkit.transports import open_source


def registry_image(ref: str) -> ImageRef:
    """Attestations live beside the image in its registry; anything else is refused before work starts."""
    parsed = parse_ref(ref)
    if parsed.transport != "docker" or parsed.name is None:
        raise DiskkitError(ref, "attestations are stored in a registry as referrers: attest a docker:// image")
    return parsed


class Attester:
    """The signing key, opened (and its passphrase tried) before the VM boots."""

    def __init__(self, opts: SignOptions):
        self.opts = opts
        if opts.sign_by:
            from diskkit.signing import openpgp
            from diskkit.signing.simple import read_sign_passphrase

            self.passphrase = read_sign_passphrase(opts)
            openpgp.sign(b"probe", opts.sign_by, self.passphrase, detached=True)  # key, agent, passphrase: now, not after the boot
            self.artifact_type, self.keyid = at.DSSE_MEDIA_TYPE, opts.sign_by.upper()
            self.hint = self.keyid
        else:
            from cryptography.hazmat.primitives import serialization

            from diskkit.signing.trust import load_signer

            self.key = load_signer(opts)
            der = self.key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
            # cosign attest --key leaves keyid empty; the bundle's hint names the key by its SPKI hash.
            self.artifact_type, self.keyid, self.hint = at.BUNDLE_MEDIA_TYPE, "", hashlib.sha256(der).hexdigest()

    def sign(self, data: bytes) -> bytes:
        if self.opts.sign_by:
            from diskkit.signing import openpgp

            return openpgp.sign(data, self.opts.sign_by, self.passphrase, detached=True)
        from diskkit.signing import keys

        return keys.sign(self.key, data)

    def attach(self, image: str, digest: str, predicate: dict, registry: RegistryOptions,
               predicate_type: str = at.PREDICATE_TYPE) -> dict:
        """Sign the statement about `image`@`digest` and push it as a referrer; what was pushed.
        A boot-test result by default; a boot-read trace (diskkit.oci.readtrace) is signed and
        stored the same way under its own predicate type."""
        from diskkit.signing import referrers

        name = registry_image(image).name
        subject = _manifest_descriptor(name, digest, registry)
        payload = at.statement(f"{name.registry}/{name.repository}", digest, predicate, predicate_type)
        env = at.envelope(payload, self.keyid, self.sign(at.pae(at.PAYLOAD_TYPE, payload)))
        blob = at.stored(self.artifact_type, env, self.hint)
        annotations = {at.CONTENT_ANNOTATION: "dsse-envelope", at.PREDICATE_ANNOTATION: predicate_type,
                       at.CREATED_ANNOTATION: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        desc, listed = referrers.push_referrer(name, subject, self.artifact_type, blob, annotations, registry)
        return {"referrer": f"{name.registry}/{name.repository}@{desc.digest}", "artifactType": self.artifact_type,
                "listedBy": "referrers API" if listed == "api" else f"tag {listed}"}


def _manifest_descriptor(name: DockerName, digest: str, registry: RegistryOptions) -> Descriptor:
    """The subject: the manifest's media type and size as the registry holds it under `digest`."""
    with open_source(str(ImageRef("docker", name=DockerName(name.registry, name.repository, digest=digest))), registry) as source:
        data, media, _ = source.top_manifest()
    if sha256_digest(data) != digest:
        raise RegistryError(f"{name.registry}/{name.repository}@{digest}", "the manifest does not match its digest")
    return Descriptor(media or mt.OCI_MANIFEST, digest, len(data))


def verify(ref: str, key_paths: list[Path], gpg_keyrings: list[Path], registry: RegistryOptions,
           platform: Platform | None = None, require_pass: bool = True) -> Accepted:
    """The first attestation of `ref`'s manifest (an index: the platform's) signed by one of the
    keys, about that digest, of our predicate type (and a passed test unless not required)."""
    parsed = registry_image(ref)
    with open_source(ref, registry) as source:
        data, media, desc = source.top_manifest()
    digest = desc.digest if desc else sha256_digest(data)
    if media in mt.INDEXES:
        digest = select_platform(parse_json(data, ref), platform or Platform.host(), ref).digest
    return accepted(ref, parsed.name, digest, key_paths, gpg_keyrings, registry, require_pass)

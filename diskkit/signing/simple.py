"""GPG simple signing of what diskkit writes, as skopeo copy --sign-by does, but in the right order:
each manifest's signature is made and stored before the manifest itself is (so a tag never
points at an image left unsigned by a failed signing), and the key is tried on a probe first, so a
wrong passphrase or a missing key refuses before any byte moves."""

from __future__ import annotations

from pathlib import Path

from diskkit.errors import DiskkitError, Exit
from diskkit.oci.image import sha256_digest
from diskkit.oci.reference import ImageRef
from diskkit.signing import lookaside, openpgp, policy, registriesd, sigapi
from diskkit.signing.keys import read_passphrase
from diskkit.signing.options import SignOptions
from diskkit.signing.payload import ATOMIC_TYPE, InvalidPayload, make_payload, parse_payload


def sign_payload(opts: SignOptions, passphrase: bytes | None, docker_reference: str, digest: str) -> bytes:
    return openpgp.sign(make_payload(docker_reference, digest, kind=ATOMIC_TYPE), opts.sign_by, passphrase)


def read_sign_passphrase(opts: SignOptions) -> bytes | None:
    """The --sign-passphrase-file's first line; without the flag gpg-agent asks (or knows) it."""
    return read_passphrase(opts.passphrase_file, "") if opts.passphrase_file is not None else None


class SimpleSigner:
    """before_manifest for a destination: signs each manifest's digest as the destination's
    reference and stores the signature through the registry's signature API when it offers one,
    else in the lookaside (registries) or the image (dir:)."""

    def __init__(self, dest: ImageRef, opts: SignOptions, registry=None):
        """`registry`: the destination's RegistryOptions, to ask whether it keeps signatures itself."""
        if dest.transport != "docker":
            # copy/sign.go: the signed identity is the destination's Docker reference; others have none.
            raise DiskkitError(str(dest), "Cannot determine canonical Docker reference for destination (sign a docker:// destination, or use standalone-sign)")
        self.dest, self.opts = dest, opts
        self.reference = policy.identity_of(dest.name)
        identity, namespaces = policy.identity_of(dest.name), policy.namespaces_of(dest.name)
        config = registriesd.load(opts.registries_d)
        self.base = registriesd.lookaside_base(config, identity, namespaces, dest.name.repository, write=True)
        self.placed = DefaultPlace(dest, self.base, not registriesd.configured_lookaside(config, identity, namespaces, write=True))
        _check_writable(self.base, dest, registry)
        self.passphrase = read_sign_passphrase(opts)
        # The probe: the key exists, the passphrase opens it, the agent answers, before any byte moves.
        sign_payload(opts, self.passphrase, self.reference, "sha256:" + "0" * 64)
        self.signed: list[str] = []

    def signature(self, digest: str) -> bytes:
        return sign_payload(self.opts, self.passphrase, self.reference, digest)

    def __call__(self, destination, digest: str, child: bool) -> None:
        signature = self.signature(digest)
        if sigapi.supported(destination.registry):  # before the lookaside, as PutSignaturesWithFormat
            sigapi.append(destination.registry, destination.repository, digest, [signature])
        else:
            lookaside.append(self.base, digest, [signature])
            self.placed.used = True
        self.signed.append(digest)

    def default_place_note(self) -> str | None:
        return self.placed.note()


class DefaultPlace:
    """Signatures written to the built-in lookaside because no registries.d entry names one: said in
    one line, as a node never finds them there unless told where they are published."""

    def __init__(self, dest: ImageRef, base: str, unconfigured: bool):
        self.dest, self.base, self.unconfigured = dest, base, unconfigured
        self.used = False

    def note(self) -> str | None:
        if not (self.unconfigured and self.used):
            return None
        return (f"{self.dest}: signatures stored in the default lookaside {self.base}, as no registries.d entry names one"
                " for this repository; a node reads them only through a `lookaside:` entry naming where they are published"
                " (docs/signing.md)")


def _registry_of(ref: ImageRef, opts):
    """The client for the registry `ref` is read from and pushed to (its registries.conf `insecure` too)."""
    from diskkit.registry import registriesconf
    from diskkit.registry.options import RegistryOptions
    from diskkit.transports.remote import registry_for

    itself = registriesconf.load().push_target(ref.name)
    return registry_for(ref.name.registry, (opts or RegistryOptions()).for_endpoint(itself.insecure))


def _check_writable(base: str, dest: ImageRef, registry) -> None:
    """Refuse, before anything moves, a lookaside signatures cannot be written to (http(s)) unless
    the destination keeps them through its signature API, which wins over any lookaside
    (docker_image_dest.go PutSignaturesWithFormat and SupportsSignatures: supportsSignatures first,
    signatureBase only then), so its staging location is never written."""
    try:
        lookaside.writable_dir(base, "sha256:" + "0" * 64)
    except DiskkitError:
        if registry is None or not sigapi.supported(_registry_of(dest, registry)):
            raise


def standalone_sign(manifest: bytes, docker_reference: str, fingerprint: str, passphrase: bytes | None) -> bytes:
    """skopeo standalone-sign: a signature of the manifest's digest as `docker_reference` (as given)."""
    if passphrase is not None and b"\n" in passphrase:
        raise DiskkitError("--passphrase-file", "invalid passphrase: must not contain a line break")
    return openpgp.sign(make_payload(docker_reference, sha256_digest(manifest), kind=ATOMIC_TYPE), fingerprint, passphrase)


def standalone_verify(manifest: bytes, docker_reference: str, fingerprints: list[str], signature: bytes, public_keys: bytes | None) -> tuple[str, str]:
    """skopeo standalone-verify (signature/docker.go VerifyImageManifestSignatureUsingKeyIdentityList):
    (the accepting fingerprint, the signed digest), or InvalidSignature in containers/image's words.
    Fingerprints ["any"] with public keys: any key in them."""
    expected = policy.as_written(docker_reference, "DOCKER-REFERENCE")
    with openpgp.Keyring([public_keys] if public_keys is not None else None) as ring:
        accepted = ring.fingerprints if fingerprints == ["any"] else fingerprints
        signed, fingerprint = ring.verify(signature, accepted)
    try:
        signed_ref, signed_digest = parse_payload(signed, ATOMIC_TYPE)
    except InvalidPayload as exc:
        raise openpgp.InvalidSignature(str(exc)) from None
    if signed_digest != sha256_digest(manifest):
        raise openpgp.InvalidSignature(f'Signature for docker digest "{signed_digest}" does not match')
    try:
        matches = str(policy.as_written(signed_ref, "signed docker-reference")) == str(expected)
    except DiskkitError:
        raise openpgp.InvalidSignature(f'Invalid docker reference "{signed_ref}" in signature') from None
    if not matches:
        raise openpgp.InvalidSignature(f'Docker reference "{signed_ref}" does not match "{docker_reference}"')
    return fingerprint, signed_digest


class SignatureCopier:
    """before_manifest for a copy: the source's simple signatures of each manifest copied (from its
    lookaside, or a dir: image's signature-N files), then a new one when signing, stored where the
    destination keeps them, as containers/image copy does unless --remove-signatures."""

    def __init__(self, src: ImageRef, dest: ImageRef, registries_d, signer: SimpleSigner | None, src_registry=None, dest_registry=None):
        self.src, self.dest, self.signer, self.src_registry, self.dest_registry = src, dest, signer, src_registry, dest_registry
        config = registriesd.load(registries_d)
        self.src_base = None
        self.src_dir = Path(src.path) if src.transport == "dir" else None
        if src.transport == "docker":
            self.src_base = registriesd.lookaside_base(config, policy.identity_of(src.name), policy.namespaces_of(src.name), src.name.repository, write=False)
        self.dest_base = None
        self.placed = None
        if dest.transport == "docker":
            identity, namespaces = policy.identity_of(dest.name), policy.namespaces_of(dest.name)
            self.dest_base = registriesd.lookaside_base(config, identity, namespaces, dest.name.repository, write=True)
            self.placed = DefaultPlace(dest, self.dest_base, not registriesd.configured_lookaside(config, identity, namespaces, write=True))

    def of_source(self, digest: str, top: bool) -> list[bytes]:
        if self.src_base is not None:
            # The source registry itself, as the destination's is found.
            registry = _registry_of(self.src, self.src_registry)
            try:
                api = sigapi.supported(registry)
            except DiskkitError as err:
                if err.exit_code != Exit.UNAVAILABLE:
                    raise
                api = False  # reached only through a registries.conf mirror: its lookaside, as before the API was spoken
            if api:
                return sigapi.read(registry, self.src.name.repository, digest)
            # The source registry's TLS settings for an https lookaside, as trust.py reads it.
            return lookaside.read(self.src_base, digest, registry.session if self.src_base.startswith("https://") else None)
        if self.src_dir is not None and top:
            return lookaside.read_dir(self.src_dir, str(self.src))
        return []

    def check_destination(self, carried: list[bytes]) -> None:
        """Refuse before anything moves when the destination cannot keep the signatures (copy.go)."""
        if carried and self.dest.transport not in ("docker", "dir"):
            raise DiskkitError(str(self.dest), "Can not copy signatures: Pushing signatures to this destination is not supported (copy with --remove-signatures)")
        if carried and self.dest_base is not None:
            _check_writable(self.dest_base, self.dest, self.dest_registry)

    def __call__(self, destination, digest: str, child: bool) -> None:
        carried = self.of_source(digest, not child)
        if self.dest.transport == "docker" and sigapi.supported(destination.registry):
            # The API only adds, and skips what the registry already holds (putSignaturesToAPIExtension).
            fresh = [self.signer.signature(digest)] if self.signer is not None else []
            sigapi.append(destination.registry, destination.repository, digest, carried + fresh)
            if self.signer is not None:
                self.signer.signed.append(digest)
            return
        self.check_destination(carried)
        if self.dest.transport == "dir":
            if not child:
                # dir: keeps its manifest.json's signatures; a new one is made only for registries.
                destination.signatures = carried
            return
        have = set(lookaside.read(self.dest_base, digest)) if carried else set()
        new = [blob for blob in carried if blob not in have]  # a copy onto itself adds nothing twice
        if self.signer is not None:
            new.append(self.signer.signature(digest))
            self.signer.signed.append(digest)
        if new:
            lookaside.append(self.dest_base, digest, new)
            self.placed.used = True

    def default_place_note(self) -> str | None:
        return self.placed.note() if self.placed is not None else None

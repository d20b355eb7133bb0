"""Where signing and policy meet the registry: sign what was pushed, enforce policy.json before a pull.

The policy is checked on the manifest a reference resolves to and, for an index, on the instance
chosen too, as containers/image's copy does (copy/single.go checks each unparsed instance), so an
image is refused before any of its layers is read.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass, replace
from pathlib import Path

from diskkit.errors import DiskkitError, VerifyFailed
from diskkit.oci import mediatypes as mt
from diskkit.oci.image import Platform, parse_json, select_platform, sha256_digest
from diskkit.oci.reference import DockerName, ImageRef, parse_ref
from diskkit.registry.options import RegistryOptions

# keys (cryptography, nacl), sigstore and registriesd (yaml) are imported where they are used: a
# pull under a policy that accepts anything needs none of them, and it pays for every import.
from diskkit.signing import payload as payload_module
from diskkit.signing import policy
from diskkit.signing.kept import Kept
from diskkit.signing.options import SignOptions, TrustOptions
from diskkit.transports import open_source
from diskkit.transports.base import Source


def _scope_names(ref: ImageRef) -> tuple[str, list[str]]:
    """Policy identity and namespaces; local transports are scoped by their resolved path (oci/layout)."""
    if ref.transport == "docker":
        return policy.identity_of(ref.name), policy.namespaces_of(ref.name)
    path = os.path.abspath(ref.path or "")
    parents = [path]
    while os.path.dirname(parents[-1]) != parents[-1]:
        parents.append(os.path.dirname(parents[-1]))
    return (f"{path}:{ref.tag}" if ref.tag else path), parents


def load_policy(trust: TrustOptions) -> policy.Policy | None:
    path = trust.policy if trust.policy is not None else policy.default_path()
    return policy.load(path) if path is not None else None


def enforce_source(source: Source, trust: TrustOptions, registry: RegistryOptions | None, platform: Platform | None = None, instances: str = "selected",
                   kept: Kept | None = None) -> None:
    """Raise DiskkitError (image, policy entry, reason) unless the policy allows the source's top
    manifest and, for an index, the instance `platform` selects (`instances="every"`: all of them;
    "none": only the index, as a copy of the index alone checks it in containers/image copy/copy.go),
    then that each such manifest has a passed boot-test attestation when the options require one.

    The policy is read before the registry is asked anything, and an image whose scope accepts
    anything costs no request. With no policy file anywhere nothing is enforced (diskkit's
    behaviour before signatures existed; containers/image would refuse to run). `kept`: where the
    signatures an accepted image came with are kept, and (kept.first, a copy already held) offered
    before the registry's.
    """
    _enforce_policy(source, trust, registry, platform, instances, kept)
    if trust.boot_test_keys or trust.boot_test_gpg_keys:
        require_boot_test(source, trust, registry, platform, instances)


def _enforce_policy(source: Source, trust: TrustOptions, registry: RegistryOptions | None, platform: Platform | None, instances: str,
                    kept: Kept | None) -> None:
    loaded = load_policy(trust)
    if loaded is None:
        return
    if source.remote:
        if source.ref.short:
            source.top_manifest()  # a short name is the candidate that has the image: its scope, not docker.io's
        ref = replace(source.ref, name=source.requested, short=None)
    else:
        ref = parse_ref(source.where)
    identity, namespaces = _scope_names(ref)
    entry, requirements = policy.requirements_for(loaded, ref.transport, identity, namespaces)
    if all(req.type == "insecureAcceptAnything" for req in requirements):
        return
    data, media, desc = source.manifest_descriptors()
    digests = [desc.digest if desc else sha256_digest(data)]
    if media in mt.INDEXES:
        index = parse_json(data, source.where)
        if instances == "every":
            digests += [child["digest"] for child in index.get("manifests") or []]
        elif instances == "selected":
            digests.append(select_platform(index, platform or Platform.host(), source.where).digest)
    from diskkit.signing import registriesd
    intended = ref.name if ref.transport == "docker" else None
    config = registriesd.load(trust.registries_d) if intended is not None else None
    # The registry the image is read from (a mirror, say): where the signature API is asked, as
    # containers/image asks its physicalRef.
    physical = (source.registry, source.name.repository) if source.remote else None
    for digest in dict.fromkeys(digests):
        fetched: dict[str, list] = {}

        def signatures(kind, digest=digest):
            if ref.transport == "dir":
                return _dir_signatures(kind, ref, digest, top=digest == digests[0])
            if intended is None:
                return []
            fetched[kind] = _signatures(kind, intended, digest, config, identity, namespaces, registry, physical)
            return fetched[kind]

        held = kept.get(digest) if kept is not None and kept.first and intended is not None else None
        refused_held = None
        if held is not None:
            try:
                policy.check(requirements, str(ref), intended, digest, lambda kind: held.get(kind, []))
                continue  # the signatures it was accepted with still satisfy the policy in force
            except policy.Rejected as exc:
                refused_held = exc  # another policy, or never accepted under one: the registry's decide
        try:
            policy.check(requirements, str(ref), intended, digest, signatures)
        except policy.Rejected as exc:
            raise VerifyFailed(str(ref), f"rejected by {loaded.source} {entry} ({digest[:19]}): {exc}") from None
        except DiskkitError as exc:
            if refused_held is None:
                raise
            raise VerifyFailed(str(ref), f"rejected by {loaded.source} {entry} ({digest[:19]}): the signatures kept with it: {refused_held};"
                                         f" the registry's could not be read: {exc.rule or exc}") from None
        if kept is not None and fetched:
            kept.put(digest, fetched)


def require_boot_test(source: Source, trust: TrustOptions, registry: RegistryOptions | None, platform: Platform | None = None, instances: str = "selected") -> None:
    """VerifyFailed unless each manifest to be read (an index's: the platform's instance, or every
    one) has a passed boot-test attestation signed by one of the trust options' keys, as
    `diskkit verify-attestation` accepts one."""
    from diskkit.signing.boottest import accepted

    keys = [*trust.boot_test_keys, *trust.boot_test_gpg_keys]
    wanted = f"no passed boot-test attestation of {{}} signed by {' or '.join(keys)} (launcher test --attest-*)"
    # A copy of a registry's image (a node's cache) is asked about at its registry: attestations are not kept.
    name = source.name if source.remote else parse_ref(source.where).name
    if name is None:
        raise VerifyFailed(source.where, wanted.format("it") + ": attestations are read from a registry")
    data, media, desc = source.top_manifest()
    digests = [desc.digest if desc else sha256_digest(data)]
    if media in mt.INDEXES and instances != "none":
        index = parse_json(data, source.where)
        if instances == "every":
            digests = [child["digest"] for child in index.get("manifests") or []]
        else:
            digests = [select_platform(index, platform or Platform.host(), source.where).digest]
    for digest in digests:
        try:
            accepted(source.where, name, digest, [Path(k) for k in trust.boot_test_keys],
                     [Path(k) for k in trust.boot_test_gpg_keys], registry or RegistryOptions())
        except VerifyFailed as exc:
            raise VerifyFailed(source.where, f"{wanted.format(digest)}: {exc.rule}") from None


def _signatures(kind: str, name: DockerName, digest: str, config: dict, identity: str, namespaces: list[str], registry: RegistryOptions | None,
                physical=None) -> list:
    """The image's sigstore attachments (when registries.d says it uses them) or its simple
    signatures: from the registry's signature API when `physical` (registry, repository) offers
    it, else from the lookaside store registries.d names."""
    from diskkit.signing import registriesd
    if kind == "signedBy":
        from diskkit.signing import lookaside, sigapi
        if physical is not None and sigapi.supported(physical[0]):
            return sigapi.read(*physical, digest)
        base = registriesd.lookaside_base(config, identity, namespaces, name.repository, write=False)
        session = None
        if base.startswith("https://"):
            from diskkit.transports.remote import registry_for
            session = registry_for(name.registry, registry or RegistryOptions()).session
        return lookaside.read(base, digest, session, (registry or RegistryOptions()).timeout)
    if not registriesd.uses_attachments(config, identity, namespaces):
        return []
    from diskkit.signing import sigstore
    return sigstore.read_signatures(name, digest, registry or RegistryOptions())


def _dir_signatures(kind: str, ref: ImageRef, digest: str, top: bool) -> list:
    """A dir: image's simple signatures: `signature-N` for its manifest, `<hex>.signature-N` for an
    instance of its index (containers/image directory/directory_transport.go signaturePath)."""
    if kind != "signedBy":
        return []
    from diskkit.signing import lookaside
    return lookaside.read_dir(Path(ref.path or "."), str(ref), None if top else digest)


def enforce_ref(ref: str, trust: TrustOptions, registry: RegistryOptions | None, platform: Platform | None = None, instances: str = "selected") -> None:
    with open_source(ref, registry) as source:
        enforce_source(source, trust, registry, platform, instances)


def load_signer(opts: SignOptions):
    """The decrypted private key, asked for before anything is pushed so a wrong passphrase costs nothing."""
    from diskkit.signing import keys
    try:
        data = Path(opts.key).read_bytes()
    except OSError as exc:
        raise DiskkitError(opts.key, f"cannot read the private key: {exc.strerror}") from None
    passphrase = keys.read_passphrase(opts.passphrase_file, f"Passphrase for key {opts.key}: ")
    return keys.load_private_key(data, passphrase, str(opts.key))


def check_signable(dest: ImageRef | str, opts: SignOptions) -> ImageRef:
    """Refuse before any byte moves when the signature could not be stored (skopeo's rules)."""
    from diskkit.signing import registriesd
    dest = parse_ref(dest) if isinstance(dest, str) else dest
    if dest.transport != "docker":
        raise DiskkitError(str(dest), "sigstore signatures can only be stored in a registry (docker://)")
    identity, namespaces = _scope_names(dest)
    if not registriesd.uses_attachments(registriesd.load(opts.registries_d), identity, namespaces):
        raise DiskkitError(str(dest), "writing sigstore attachments is disabled by configuration (set use-sigstore-attachments: true in registries.d)")
    return dest


def sign_pushed(dest: ImageRef, digest: str, private_key, registry: RegistryOptions, instances: bool = True) -> list[str]:
    """Sign the pushed manifest and, for an index, each manifest in it unless only the index was
    copied (as skopeo does: each copied image is signed as it is copied); the digests signed."""
    from diskkit.signing import sigstore
    from diskkit.transports.remote import RemoteSource

    name = dest.name
    reference = policy.identity_of(name)
    source = RemoteSource(ImageRef("docker", name=DockerName(name.registry, name.repository, digest=digest)), registry)
    data, _, _ = source.top_manifest()
    obj = parse_json(data, str(dest))
    signed = []
    if instances and (obj.get("mediaType") in mt.INDEXES or "manifests" in obj):
        signed += [child["digest"] for child in obj.get("manifests") or []]
    signed.append(digest)
    for each in signed:
        sigstore.put_signature(name, each, sigstore.signature_layer(private_key, reference, each), registry)
    return signed


@dataclass(frozen=True)
class Signer:
    key: str
    identity: str
    digest: str


def signers(ref: ImageRef | str, key_paths: list[Path], registry: RegistryOptions | None) -> tuple[str, int, list[Signer]]:
    """(digest, signatures found, which given keys signed it and for which identity) of the manifest
    `ref` resolves to; a signature counts only when its payload names that digest."""
    from diskkit.signing import keys, sigstore
    ref = parse_ref(ref) if isinstance(ref, str) else ref
    if ref.transport != "docker":
        raise DiskkitError(str(ref), "signatures are read from a registry (docker://); local layouts and archives hold none")
    loaded = keys.load_public_key_files(key_paths)
    with open_source(ref, registry) as source:
        data, _, desc = source.top_manifest()
    digest = desc.digest if desc else sha256_digest(data)
    found = sigstore.read_signatures(ref.name, digest, registry or RegistryOptions())
    out = []
    for sig in found:
        annotation = sig.annotations.get(payload_module.SIGNATURE_ANNOTATION)
        if sig.media_type != payload_module.MIME_TYPE or annotation is None:
            continue
        try:
            raw = base64.b64decode(annotation, validate=True)
            signed_ref, signed_digest = payload_module.parse_payload(sig.payload)
        except ValueError:
            continue
        if signed_digest != digest:
            continue
        out += [Signer(path, signed_ref, digest) for path, pubs in loaded if any(keys.verifies(k, sig.payload, raw) for k in pubs)]
    return digest, len(found), out

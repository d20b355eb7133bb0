"""The signature policy on every image the node uses: `admit`, the one function each read of an image
passes before its first layer (a pull, the disk server's open, a VM export, a DataVolume import, the
hints an image gives) and each cache hit passes before its disk is used, as every copy in
containers/image passes its one policy context (copy/single.go: IsRunningImageAllowed, "BEFORE
reading any other information about the image"). An image the node pulled under no policy, or under
another one, is used under the policy in force now or refused, as skopeo would refuse it.

The signatures an image was accepted with are kept in the cache (`<cache>/signatures/`,
diskkit.signing.kept), as containers/image stores them with the copy it writes: a cache hit is
checked against them first, so no network is needed while they satisfy the policy in force; when
they do not (a policy now asking for another key, an image first pulled with none), the registry's
are read and decide. A boot-test requirement is asked of the registry every time: attestations are
not kept.

A cache hit is also served only to a request whose credentials could pull it, as the kubelet's
"ensure secret pulled images" (keps/sig-node/2535-ensure-secret-pulled-images) serves an image
pulled with one pod's secret to another pod: an image the registry gave without credentials is
anyone's; otherwise the request's credentials (a VMI's imagePullSecret, the node's, its TLS
identity) must be ones it was pulled or proved with, else they read its manifest from the registry
first (and are remembered, as a salted hash, once they have).
"""

from __future__ import annotations

import contextlib
import hashlib
import secrets
from pathlib import Path
from typing import Iterator

from diskkit.errors import DiskkitError
from diskkit.oci import mediatypes as mt
from diskkit.oci.image import Descriptor, Platform, check_digest, sha256_digest
from diskkit.oci.reference import DockerName, ImageRef, parse_ref
from diskkit.registry import authfile, tlsfiles
from diskkit.registry.options import RegistryOptions
from diskkit.signing.kept import Kept
from diskkit.signing.options import TrustOptions
from diskkit.signing.trust import enforce_source
from diskkit.transports import open_source
from diskkit.transports.base import Source
from diskkit.transports.remote import RemoteSource
from launcher.node.cache import Cache


def admit(source: Source, registry: RegistryOptions | None, platform: Platform | None, cache: Cache | None = None) -> None:
    """Raise (exit 8, one line naming the image, the policy entry and the reason) unless the policy in
    force, and any boot-test requirement, accept `source`'s image for `platform`; a cached image is
    checked against the signatures kept with it first. Accepted signatures read from the registry are
    kept in `cache`."""
    kept = Kept(cache.signatures_dir, first=isinstance(source, CachedImage)) if cache is not None else None
    enforce_source(source, TrustOptions.of(registry), registry, platform, kept=kept)
    if isinstance(source, CachedImage):
        source.prove_access(registry or RegistryOptions())


def access_of(source: Source) -> dict:
    """How a read from `source` got in, for the cache hits that follow: "public" when the registry
    asked for no credentials and no TLS identity was presented (a local transport's too), else
    the host and a salted hash of what was presented."""
    registry = getattr(source, "registry", None)
    if not isinstance(source, RemoteSource) or registry is None:
        return {"public": True}
    creds = registry.credentials() if registry.challenge is not None else None
    if creds is None and registry.identity is None:
        return {"public": True}
    salt = secrets.token_hex(16)
    return {"public": False, "host": registry.host, "salt": salt, "proved": [_fingerprint(salt, creds, registry.identity)]}


def _fingerprint(salt: str, creds, identity) -> str:
    parts = [salt]
    if creds is not None:
        parts += [creds.username, creds.password, creds.identity_token or ""]
    if identity is not None:
        parts += [identity.cert.decode("ascii", "replace"), identity.key.decode("ascii", "replace")]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


@contextlib.contextmanager
def admitted(ref: str, registry: RegistryOptions | None, platform: Platform | None, cache: Cache | None = None) -> Iterator[Source]:
    """`ref`'s source, once `admit` let it through: nothing of the image but its manifests is read before."""
    with open_source(ref, registry) as source:
        admit(source, registry, platform, cache)
        yield source


class CachedImage(Source):
    """An image the cache holds, as the policy reads it: the manifest (or index) its reference resolved
    to when it was pulled, from the cache's blobs and checked against its digest, under the name it was
    pulled by. Nothing else is read from it: a cache hit's disk is in place already."""

    def __init__(self, cache: Cache, record: dict, record_path: Path):
        self.cache, self.record, self.record_path = cache, record, record_path
        self.where = record.get("name") or record["image"]
        # Records written before the index was kept name the platform's manifest only.
        self.top = record.get("top") or record["digest"]
        self.media = record.get("topMediaType")
        check_digest(self.top, self.where)
        self.data = cache.read_blob(self.top)

    @property
    def present(self) -> bool:
        """The cache holds the manifest, as its digest says: else the image is not there to be used."""
        return self.data is not None and sha256_digest(self.data) == self.top

    def top_manifest(self) -> tuple[bytes, str | None, Descriptor]:
        if not self.present:
            raise DiskkitError(self.where, f"the cache's copy of manifest {self.top} is missing or damaged")
        return self.data, self.media, Descriptor(self.media or mt.OCI_MANIFEST, self.top, len(self.data))

    def open_blob(self, desc: Descriptor):
        raise DiskkitError(self.where, "a cached image is checked by its manifests only")

    def prove_access(self, registry: RegistryOptions) -> None:
        """Raise the registry's refusal unless the credentials `registry` presents may have the image:
        it is public, they are ones it was pulled or proved with, or they read its manifest now."""
        access = self.record.get("access") or {}
        if access.get("public"):
            return
        name = parse_ref(self.where).name
        host = access.get("host") or name.registry
        salt = access.get("salt") or secrets.token_hex(16)
        mine = _fingerprint(salt, authfile.held(host, registry), tlsfiles.held(host, registry))
        proved = list(access.get("proved") or [])
        if mine in proved:
            return
        pinned = ImageRef("docker", name=DockerName(name.registry, name.repository, digest=self.top))
        try:
            with open_source(str(pinned), registry) as source:
                source.top_manifest()
        except DiskkitError as exc:
            exc.rule = f"the node holds it, pulled with other credentials, and these cannot read it: {exc.rule}"
            exc.args = (exc.line(),)
            raise
        self.record["access"] = {"public": False, "host": host, "salt": salt, "proved": [*proved, mine][-16:]}
        self.cache.write_json(self.record_path, self.record)

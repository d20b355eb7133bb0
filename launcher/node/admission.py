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
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from diskkit.errors import DiskkitError
from diskkit.oci import mediatypes as mt
from diskkit.oci.image import Descriptor, Platform, check_digest, sha256_digest
from diskkit.registry.options import RegistryOptions
from diskkit.signing.kept import Kept
from diskkit.signing.options import TrustOptions
from diskkit.signing.trust import enforce_source
from diskkit.transports import open_source
from diskkit.transports.base import Source
from launcher.node.cache import Cache


def admit(source: Source, registry: RegistryOptions | None, platform: Platform | None, cache: Cache | None = None) -> None:
    """Raise (exit 8, one line naming the image, the policy entry and the reason) unless the policy in
    force, and any boot-test requirement, accept `source`'s image for `platform`; a cached image is
    checked against the signatures kept with it first. Accepted signatures read from the registry are
    kept in `cache`."""
    kept = Kept(cache.signatures_dir, first=isinstance(source, CachedImage)) if cache is not None else None
    enforce_source(source, TrustOptions.of(registry), registry, platform, kept=kept)


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

    def __init__(self, cache: Cache, record: dict):
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

"""What every transport provides: a Source to read images from, a Destination to write them to."""

from __future__ import annotations

import contextlib
from typing import BinaryIO, Iterator, Protocol

from diskkit import interrupts
from diskkit.errors import DiskkitError, UploadLost
from diskkit.oci import mediatypes as mt
from diskkit.oci.image import (
    Descriptor,
    Image,
    Platform,
    manifest_media_type,
    parse_json,
    select_platform,
)
from diskkit.streams.digestio import VerifyingReader, read_verified

# containers/image's MaxManifestBodySize and MaxConfigBodySize (internal/iolimits/iolimits.go)
SMALL_BLOB_LIMIT = 4 << 20


class Destination:
    """Receives blobs, then manifests, then commit(); abort() leaves nothing behind.

    `layer_compression` is set where the format dictates it (Docker archives hold plain tars);
    `docker_manifest` where it only carries Docker schema2 images.
    """

    layer_compression: str | None = None
    docker_manifest = False
    concurrent_blobs = False  # tar-stream destinations take one blob at a time
    oci_only = False  # OCI layouts index OCI media types only
    compresses_plain_layers = False  # registries and OCI layouts: skopeo gzips plain layers for them
    # Called as before_manifest(destination, digest, child) before a manifest is stored where a
    # signature can follow it (registries, dir:), so a signature exists before the tag moves.
    before_manifest = None
    # OCI layouts: index.json exactly as given (a KubeVirt VM export's), instead of one listing put_manifest's
    layout_index: bytes | None = None

    def has_blob(self, desc: Descriptor) -> bool:
        return False

    def check_writable(self) -> None:
        """Raise if nothing could be written here; checked before the first write of a multi-destination build."""

    def blob_writer(self, media_type: str) -> contextlib.AbstractContextManager["PendingBlob"]:
        raise NotImplementedError

    def put_blob(self, data: bytes, media_type: str) -> Descriptor:
        from diskkit.oci.image import sha256_digest

        with self.blob_writer(media_type) as pending:
            pending.write(data)
            pending.commit(sha256_digest(data), len(data))
        return Descriptor(media_type, sha256_digest(data), len(data))

    def put_manifest(self, data: bytes, media_type: str, platform: dict | None = None, child: bool = False) -> Descriptor:
        """Store a manifest; `child` ones belong to an index and get no tag of their own."""
        raise NotImplementedError

    def commit(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def begin(self) -> None:
        """Make what the destination stages into (a staging directory or file); abort() removes it."""

    def __enter__(self) -> "Destination":
        # Made with stop signals held: a SIGTERM landing between a staging's mkdir and the `with`
        # that aborts it would leave the staging behind (test_bad_input's SIGTERM mid-build).
        begun = False
        try:
            with interrupts.held():
                self.begin()
                begun = True
        except BaseException:
            if begun:
                self.abort()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


class PendingBlob(Protocol):
    def write(self, data: bytes | memoryview) -> object: ...
    def commit(self, digest: str, size: int) -> None: ...


class Source:
    """Reads one image reference. Subclasses provide the top manifest, manifests by digest and blobs."""

    where: str
    manifest_synthesized = False  # archives and engines store none: the manifest is made up on reading
    # A registry's image (RemoteSource, with its `registry`, `name` and `ref`): asked so rather than by
    # isinstance, so that reading a local image never loads the HTTP client.
    remote = False

    def top_manifest(self) -> tuple[bytes, str | None, Descriptor | None]:
        """The manifest or index the reference names, its media type if known, and its descriptor if known."""
        raise NotImplementedError

    def open_blob(self, desc: Descriptor) -> BinaryIO:
        """The raw, unverified stream of a blob; callers wrap it (see blob())."""
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextlib.contextmanager
    def blob(self, desc: Descriptor) -> Iterator[VerifyingReader]:
        raw = self.open_blob(desc)
        try:
            yield VerifyingReader(raw, desc.digest, desc.size, f"{self.where}: blob {desc.digest[:19]}")
        finally:
            raw.close()

    def read_range(self, desc: Descriptor, offset: int, size: int) -> bytes:
        """`size` bytes of a blob from `offset`, unverified (a lazy TOC is pinned by its own digest)."""
        raw = self.open_blob(desc)
        try:
            if raw.seekable():
                raw.seek(offset)
            else:
                skip = offset
                while skip and (skipped := len(raw.read(min(skip, 1 << 20)))):
                    skip -= skipped
            data = raw.read(size)
        finally:
            raw.close()
        if len(data) != size:
            raise DiskkitError(self.where, f"blob {desc.digest[:19]} ends before byte {offset + size}")
        return data

    def read_small(self, desc: Descriptor) -> bytes:
        raw = self.open_blob(desc)
        try:
            return read_verified(raw, desc.digest, desc.size, self.where, SMALL_BLOB_LIMIT)
        finally:
            raw.close()

    def read_manifest(self, desc: Descriptor) -> bytes:
        """A manifest named by an index; in layouts and archives manifests are blobs."""
        return self.read_small(desc)

    def manifest_descriptors(self) -> tuple[bytes, str, Descriptor | None]:
        data, media, desc = self.top_manifest()
        return data, manifest_media_type(parse_json(data, self.where), media), desc

    def image(self, platform: Platform | None = None) -> Image:
        data, media, digest, config_desc, layers = self.platform_manifest(platform)
        config = self.read_small(config_desc)
        return Image(self.where, data, media, digest, config, config_desc, layers)

    def platform_manifest(self, platform: Platform | None = None) -> tuple[bytes, str, str, Descriptor, list[Descriptor]]:
        """The manifest `platform` uses (bytes, media type, digest) and its config and layer descriptors:
        what a signature policy reads of an image, and nothing beyond it (no blob)."""
        data, media, desc = self.manifest_descriptors()
        obj = parse_json(data, self.where)
        if media in mt.INDEXES:
            desc = select_platform(obj, platform or Platform.host(), self.where)
            data = self.read_manifest(desc)
            obj = parse_json(data, self.where)
            media = manifest_media_type(obj, desc.media_type)
        if media not in mt.MANIFESTS:
            raise DiskkitError(self.where, f"unsupported manifest media type {media!r}")
        from diskkit.oci.image import sha256_digest

        digest = sha256_digest(data)
        if desc is not None and desc.digest != digest:
            raise DiskkitError(self.where, f"manifest does not match its digest {desc.digest}")
        try:
            config_desc = Descriptor.from_json(obj["config"], f"{self.where}: config")
            layers = [Descriptor.from_json(layer, f"{self.where}: layer {i}") for i, layer in enumerate(obj.get("layers") or [])]
        except (KeyError, TypeError):
            raise DiskkitError(self.where, "manifest has no config descriptor") from None
        return data, media, digest, config_desc, layers



def with_restarts(send, reporter, what: str, attempts: int = 3):
    """Run `send` (which streams one blob from its start) again when the registry lost the session."""
    for attempt in range(attempts):
        try:
            return send()
        except UploadLost as lost:
            if attempt == attempts - 1:
                raise
            reporter.note(f"{what}: {lost.rule}; sending it again from the start")

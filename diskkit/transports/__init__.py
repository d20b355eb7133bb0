"""Transports: where images are read from and written to (containers/image's model)."""

from __future__ import annotations

from ..errors import DiskkitError
from ..reference import ImageRef, parse_ref
from .base import Destination, Source


def open_source(ref: ImageRef | str) -> Source:
    ref = parse_ref(ref) if isinstance(ref, str) else ref
    if ref.transport == "oci":
        from .layout import LayoutSource

        return LayoutSource(ref)
    if ref.transport == "oci-archive":
        from .ociarchive import OciArchiveSource

        return OciArchiveSource(ref)
    if ref.transport == "docker-archive":
        from .dockerarchive import DockerArchiveSource

        return DockerArchiveSource(ref)
    raise DiskkitError(str(ref), "registries (docker://) are not supported by this version of diskkit yet")


def open_destination(ref: ImageRef | str, created: int = 0) -> Destination:
    ref = parse_ref(ref) if isinstance(ref, str) else ref
    if ref.transport == "oci":
        from .layout import LayoutDestination

        return LayoutDestination(ref, created)
    if ref.transport == "oci-archive":
        from .ociarchive import OciArchiveDestination

        return OciArchiveDestination(ref, created)
    if ref.transport == "docker-archive":
        from .dockerarchive import DockerArchiveDestination

        return DockerArchiveDestination(ref, created)
    raise DiskkitError(str(ref), "registries (docker://) are not supported by this version of diskkit yet")

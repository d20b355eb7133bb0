"""Transports: where images are read from and written to, as containers/image names them (docker://,
oci:, oci-archive:, docker-archive:, dir:,
docker-daemon:, containers-storage:). Each is a Source and a Destination of verified blobs and
manifests; what the bytes mean is diskkit.layers' and diskkit.disk's business."""

from __future__ import annotations

from diskkit.errors import DiskkitError
from diskkit.oci.reference import ImageRef, parse_ref
from diskkit.registry.options import RegistryOptions
from diskkit.transports.base import Destination, Source


def open_source(ref: ImageRef | str, opts: RegistryOptions | None = None) -> Source:
    ref = parse_ref(ref) if isinstance(ref, str) else ref
    if ref.transport == "docker":
        from diskkit.transports.remote import RemoteSource

        return RemoteSource(ref, opts or RegistryOptions())
    if ref.transport == "oci":
        from diskkit.transports.layout import LayoutSource

        return LayoutSource(ref)
    if ref.transport == "oci-archive":
        from diskkit.transports.ociarchive import OciArchiveSource

        return OciArchiveSource(ref)
    if ref.transport == "docker-archive":
        from diskkit.transports.dockerarchive import DockerArchiveSource

        return DockerArchiveSource(ref)
    if ref.transport == "dir":
        from diskkit.transports.directory import DirSource

        return DirSource(ref)
    if ref.transport in ("docker-daemon", "containers-storage"):
        from diskkit.transports.daemon import DaemonSource

        return DaemonSource(ref)
    raise DiskkitError(str(ref), f"unknown transport {ref.transport}")


def open_destination(ref: ImageRef | str, created: int = 0, opts: RegistryOptions | None = None) -> Destination:
    ref = parse_ref(ref) if isinstance(ref, str) else ref
    if ref.transport == "docker":
        from diskkit.transports.remote import RemoteDestination

        return RemoteDestination(ref, opts or RegistryOptions())
    if ref.transport == "oci":
        from diskkit.transports.layout import LayoutDestination

        return LayoutDestination(ref, created)
    if ref.transport == "oci-archive":
        from diskkit.transports.ociarchive import OciArchiveDestination

        return OciArchiveDestination(ref, created)
    if ref.transport == "docker-archive":
        from diskkit.transports.dockerarchive import DockerArchiveDestination

        return DockerArchiveDestination(ref, created)
    if ref.transport == "dir":
        from diskkit.transports.directory import DirDestination

        return DirDestination(ref)
    if ref.transport in ("docker-daemon", "containers-storage"):
        from diskkit.transports.daemon import DaemonDestination

        return DaemonDestination(ref, created)
    raise DiskkitError(str(ref), f"unknown transport {ref.transport}")

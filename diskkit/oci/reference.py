"""Image references in the containers-transports syntax that skopeo and podman users type.

`oci:DIR[:TAG]`, `oci-archive:FILE[:TAG]`, `docker-archive:FILE[:NAME:TAG]`, `dir:DIR`, `docker-daemon:NAME:TAG`, `containers-storage:NAME[:TAG]`,
`docker://HOST/REPO[:TAG|@DIGEST]`,
and a bare `HOST/REPO:TAG`, which means `docker://` as it does for podman.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from diskkit.errors import DiskkitError

DEFAULT_REGISTRY = "docker.io"
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_HOST = re.compile(r"^(?:[a-zA-Z0-9-]+\.)*[a-zA-Z0-9-]+(?::[0-9]+)?$|^\[[0-9a-fA-F:.]+\](?::[0-9]+)?$")

LOCAL_TRANSPORTS = ("oci", "oci-archive", "docker-archive")
ENGINE_TRANSPORTS = ("docker-daemon", "containers-storage")
TRANSPORTS = LOCAL_TRANSPORTS + ("dir",) + ENGINE_TRANSPORTS + ("docker",)


@dataclass(frozen=True)
class DockerName:
    """A registry repository with an optional tag or digest, normalised as docker/distribution does."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def reference(self) -> str:
        """What goes after /manifests/ in the distribution API."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        text = f"{self.registry}/{self.repository}"
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text

    def familiar_ref(self) -> str:
        """familiar() with a digest reference kept as one."""
        if self.digest:
            return self.familiar().rpartition(":")[0] + f"@{self.digest}"
        return self.familiar()

    def familiar(self) -> str:
        """The short form `docker save` writes into RepoTags (docker.io/library/ dropped)."""
        repo = self.repository
        if self.registry == DEFAULT_REGISTRY:
            repo = repo.removeprefix("library/")
        else:
            repo = f"{self.registry}/{repo}"
        return f"{repo}:{self.tag or 'latest'}"


def parse_docker_name(text: str, what: str = "image reference") -> DockerName:
    name, digest = text, None
    if "@" in name:
        name, digest = name.split("@", 1)
        if not _DIGEST.match(digest):
            raise DiskkitError(text, f"invalid {what}: digest must be sha256:<64 hex digits>")
    tag = None
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
        if not _TAG.match(tag):
            raise DiskkitError(text, f"invalid {what}: bad tag {tag!r}")
    parts = name.split("/")
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost" or parts[0].startswith("[")):
        registry, path = parts[0], parts[1:]
        if not _HOST.match(registry):
            raise DiskkitError(text, f"invalid {what}: bad registry host {registry!r}")
    else:
        registry, path = DEFAULT_REGISTRY, parts
    if registry == DEFAULT_REGISTRY and len(path) == 1:
        path = ["library", *path]
    if not path or not all(_COMPONENT.match(p) for p in path):
        raise DiskkitError(text, f"invalid {what}: repository must be lowercase [a-z0-9._-] components")
    if tag is None and digest is None:
        tag = "latest"
    return DockerName(registry, "/".join(path), tag, digest)


@dataclass(frozen=True)
class ImageRef:
    transport: str
    path: str | None = None  # local transports: the directory or archive file
    tag: str | None = None  # oci/oci-archive: the ref.name; docker-daemon: an image ID
    name: DockerName | None = None  # docker://, docker-archive's and docker-daemon's reference
    short: str | None = None  # a bare name without a registry host, as typed: registries.conf resolves it

    def __str__(self) -> str:
        if self.transport == "docker":
            # A short name stays as typed: it means whatever registries.conf resolves it to.
            return self.short or f"docker://{self.name}"
        if self.transport == "docker-archive" and self.name:
            return f"docker-archive:{self.path}:{self.name.familiar()}"
        if self.transport == "docker-archive" and self.tag:
            return f"docker-archive:{self.path}:{self.tag}"
        if self.transport == "docker-daemon":
            return f"docker-daemon:{self.name.familiar_ref() if self.name else self.tag}"
        if self.transport == "containers-storage":
            return f"containers-storage:{self.name or self.tag}"
        return f"{self.transport}:{self.path}" + (f":{self.tag}" if self.tag else "")


def parse_ref(text: str) -> ImageRef:
    """Parse a transport reference; raise DiskkitError naming the reference on anything malformed."""
    if text.startswith("docker://"):
        return ImageRef("docker", name=parse_docker_name(text[len("docker://") :]))
    transport, sep, rest = text.partition(":")
    if sep and transport in LOCAL_TRANSPORTS:
        # Like containers/image: the first ':' after the transport splits path and reference.
        path, _, tag = rest.partition(":")
        if not path:
            raise DiskkitError(text, f"{transport}: needs a path")
        if transport == "docker-archive":
            if re.match(r"^@[0-9]+$", tag):
                # containers/image docker/archive/transport.go: `@N` is the N-th image of manifest.json.
                return ImageRef(transport, path=path, tag=tag)
            name = parse_docker_name(tag, "docker-archive reference") if tag else None
            if name and name.digest:
                raise DiskkitError(text, "docker-archive references take a tag, not a digest")
            return ImageRef(transport, path=path, name=name)
        if tag and not re.match(r"^[A-Za-z0-9._:@/+-]+$", tag):
            raise DiskkitError(text, f"invalid {transport} tag {tag!r}")
        return ImageRef(transport, path=path, tag=tag or None)
    if sep and transport == "docker-daemon":
        return _parse_daemon_ref(text, rest)
    if sep and transport == "containers-storage":
        return _parse_storage_ref(text, rest)
    if sep and transport == "dir":
        # containers/image directory transport: everything after `dir:` is the path, colons included.
        if not rest:
            raise DiskkitError(text, "dir: needs a path")
        return ImageRef("dir", path=rest)
    if sep and transport in ("ostree", "sif"):
        raise DiskkitError(text, f"transport {transport}: is not supported; use oci:, oci-archive:, docker-archive:, dir:, docker-daemon:, containers-storage: or docker://")
    unknown = re.match(r"^([a-z][a-z0-9-]*):(//)?([^/]*)/", text)
    if unknown and unknown.group(1) not in TRANSPORTS and (unknown.group(2) or not unknown.group(3).isdigit()):
        # HOST:PORT/REPO is a bare registry reference; NAME://... or NAME:word/... names a transport
        # (containers/image transports/alltransports/alltransports.go, in its words).
        import difflib

        close = difflib.get_close_matches(unknown.group(1), TRANSPORTS, n=1, cutoff=0.6)
        hint = f'; did you mean "{close[0]}{"://" if close[0] == "docker" else ":"}"?' if close else f"; known transports: {', '.join(TRANSPORTS)}"
        raise DiskkitError(f'Invalid image name "{text}", unknown transport "{unknown.group(1)}"{hint}')
    if "/" in text and not text.startswith(("/", ".")) or re.match(r"^[a-z0-9][a-z0-9._-]*(?::[\w][\w.-]*|@sha256:[0-9a-f]{64})$", text):
        name = parse_docker_name(text)
        first = text.partition("/")[0]
        qualified = "/" in text and ("." in first or ":" in first or first == "localhost" or first.startswith("["))
        return ImageRef("docker", name=name, short=None if qualified else text)
    raise DiskkitError(
        text, "not an image reference: use oci:DIR[:TAG], oci-archive:FILE[:TAG], docker-archive:FILE[:REF] or docker://HOST/REPO:TAG"
    )


def _parse_daemon_ref(text: str, rest: str) -> ImageRef:
    """`docker-daemon:NAME:TAG`, `NAME@DIGEST` or an image ID `sha256:HEX`, with containers/image's
    refusals (docker/daemon/daemon_transport.go: ParseReference, NewReference)."""
    if _DIGEST.match(rest):
        return ImageRef("docker-daemon", tag=rest)
    if re.match(r"^[a-z0-9]+:[0-9a-fA-F]{32,}$", rest):
        raise DiskkitError(text, f"Invalid docker-daemon: reference {rest}: only digest algorithm sha256 accepted")
    name = parse_docker_name(rest, "docker-daemon reference")
    after_slash = rest.rpartition("/")[2]
    if ":" not in after_slash.partition("@")[0] and "@" not in rest:
        raise DiskkitError(text, f"docker-daemon: reference {rest} has neither a tag nor a digest")
    if name.digest and ":" in after_slash.partition("@")[0]:
        raise DiskkitError(text, "docker-daemon: references with both a tag and digest are currently not supported")
    if name.repository == "library/sha256" and name.registry == DEFAULT_REGISTRY:
        raise DiskkitError(text, f"Invalid docker-daemon: reference {rest}: The sha256 repository name is reserved for (non-shortened) digest references")
    return ImageRef("docker-daemon", name=name)


def _parse_storage_ref(text: str, rest: str) -> ImageRef:
    """`containers-storage:NAME[:TAG|@DIGEST]` or an image ID. As containers/image reads it
    (storage/storage_transport.go: ParseStoreReference) a short name means docker.io/library/NAME and
    a missing tag `latest`; the store is podman's, reached through its service, so a
    `[driver@graphroot+runroot]` store specifier cannot be honoured and is refused."""
    if rest.startswith("["):
        raise DiskkitError(text, "containers-storage: store specifiers [driver@graphroot+runroot] are not supported; point CONTAINER_HOST at the podman service of that store")
    ident = rest.removeprefix("sha256:")
    if re.match(r"^[0-9a-f]{64}$", ident):
        return ImageRef("containers-storage", tag=ident)
    if "@" in rest and re.match(r"^[0-9a-f]{64}$", rest.rpartition("@")[2]):
        raise DiskkitError(text, "containers-storage: NAME@IMAGE-ID references are not supported; give the name or the image ID")
    return ImageRef("containers-storage", name=parse_docker_name(rest, "containers-storage reference"))

"""`docker-daemon:NAME:TAG` (or an image ID as a source): images in a Docker engine's store, reached
through its API as skopeo does (containers/image docker/daemon: a source is the engine's `docker save`
stream of one image, a destination is a `docker load` of a docker-archive). podman's Docker-compatible
service answers the same API. DOCKER_HOST picks the engine, as for the docker CLI.

`containers-storage:NAME[:TAG]` is podman's image store. skopeo opens the store's files itself; here
podman's service is asked through the same API (CONTAINER_HOST, as for `podman --remote`, else the
service's default socket), so the store's locks and layout stay podman's business.

The save stream is not seekable and the archive's manifest.json may come last, so it is spooled to a
temporary file and read in place from there; the load is sent from the finished archive file. Neither
holds a layer in memory.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from pathlib import Path

from diskkit.errors import DiskkitError
from diskkit.oci.reference import ImageRef
from diskkit.transports.dockerarchive import DockerArchiveDestination, DockerArchiveSource

SPOOL_CHUNK = 1 << 20
API_TIMEOUT = 600


def engine_host(ref: ImageRef) -> tuple[str, str]:
    """(address, the variable that sets it) of the engine serving `ref`'s transport."""
    if ref.transport == "containers-storage":
        if os.environ.get("CONTAINER_HOST"):
            return os.environ["CONTAINER_HOST"], "CONTAINER_HOST"
        if os.geteuid() == 0:
            return "unix:///run/podman/podman.sock", "CONTAINER_HOST"
        runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.geteuid()}"
        return f"unix://{runtime}/podman/podman.sock", "CONTAINER_HOST"
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock", "DOCKER_HOST"


def _client(ref: ImageRef):
    import docker

    host, variable = engine_host(ref)
    try:
        if variable == "DOCKER_HOST":
            # The docker SDK reads DOCKER_HOST, DOCKER_TLS_VERIFY and DOCKER_CERT_PATH as the CLI does.
            client = docker.APIClient(**docker.utils.kwargs_from_env(), version="auto", timeout=API_TIMEOUT)
        else:
            client = docker.APIClient(base_url=host, version="auto", timeout=API_TIMEOUT)
        client.ping()
        return client
    except docker.errors.DockerException as exc:
        raise DiskkitError(str(ref), f"cannot reach the container engine at {host} ({_reason(exc)}); set {variable}") from None


def _api_name(ref: ImageRef) -> str:
    """The name the engine is asked for: docker's familiar form, or the full one podman stores."""
    if ref.name is None:
        return ref.tag
    return ref.name.familiar_ref() if ref.transport == "docker-daemon" else str(ref.name)


def _reason(exc: Exception) -> str:
    text = getattr(exc, "explanation", None) or str(exc)
    return str(text).splitlines()[0] if text else type(exc).__name__


def _spool_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="diskkit-engine-"))


class DaemonSource(DockerArchiveSource):
    def __init__(self, ref: ImageRef):
        import docker

        where = str(ref)
        client = _client(ref)
        host = engine_host(ref)[0]
        wanted = _api_name(ref)
        self.spool = _spool_dir()
        archive = self.spool / "image.tar"
        try:
            try:
                stream = client.get_image(wanted, chunk_size=SPOOL_CHUNK)
                with open(archive, "wb") as out:
                    for chunk in stream:
                        out.write(chunk)
            except docker.errors.NotFound:
                raise DiskkitError(where, f"no such image in the engine at {host}") from None
            except docker.errors.DockerException as exc:
                raise DiskkitError(where, f"the engine at {host} could not save the image ({_reason(exc)})") from None
            # One image was asked for, so the archive's single entry is it, whatever its RepoTags say.
            super().__init__(ImageRef("docker-archive", path=str(archive)))
        except BaseException:
            shutil.rmtree(self.spool, ignore_errors=True)
            raise
        finally:
            client.close()
        self.where = where

    def close(self) -> None:
        shutil.rmtree(self.spool, ignore_errors=True)


class DaemonDestination(DockerArchiveDestination):
    def __init__(self, ref: ImageRef, created: int = 0):
        if ref.name is None or ref.name.digest:
            # containers/image docker/daemon/daemon_dest.go refuses the same; a store keeps tags only.
            raise DiskkitError(str(ref), f"Invalid destination {ref}: a destination must be a name:tag")
        self.where = str(ref)
        self.host = engine_host(ref)[0]
        self.client = _client(ref)
        self.spool = Path(tempfile.gettempdir(), f"diskkit-engine-{secrets.token_hex(8)}")
        super().__init__(ImageRef("docker-archive", path=str(self.spool / "image.tar"), name=ref.name))

    def begin(self) -> None:
        self.spool.mkdir(mode=0o700)
        try:
            super().begin()
        except BaseException:
            self.spool.rmdir()
            raise

    def repo_tag(self) -> str:
        # Fully qualified, as containers/image writes it: engines normalise both forms alike.
        return f"{self.ref.name.registry}/{self.ref.name.repository}:{self.ref.name.tag or 'latest'}"

    def commit(self) -> None:
        import docker

        try:
            super().commit()
            with open(self.final, "rb") as archive:
                for status in self.client.load_image(archive):
                    error = status.get("error") or (status.get("errorDetail") or {}).get("message")
                    if error:
                        raise DiskkitError(self.where, f"the engine refused the image: {error}")
        except docker.errors.DockerException as exc:
            raise DiskkitError(self.where, f"the engine at {self.host} could not load the image ({_reason(exc)})") from None
        finally:
            self._cleanup()

    def abort(self) -> None:
        try:
            super().abort()
        finally:
            self._cleanup()

    def _cleanup(self) -> None:
        self.client.close()
        shutil.rmtree(self.spool, ignore_errors=True)

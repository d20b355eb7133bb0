"""`docker://HOST/REPO[:TAG|@DIGEST]`: images in an OCI distribution registry."""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from pathlib import Path
from typing import BinaryIO, Iterator

import urllib3

from diskkit.errors import AuthError, DiskkitError, Exit, RegistryError, ResumeFailed, UploadLost
from diskkit.oci import mediatypes as mt
from diskkit.oci.image import Descriptor, sha256_digest
from diskkit.oci.reference import DockerName, ImageRef
from diskkit.registry import registriesconf
from diskkit.registry.client import (
    MAX_MANIFEST_BYTES,
    RETRY_STATUS,
    Registry,
    ResumableBlob,
    check_status,
    get_blob,
    read_body,
    refusal,
    retry_after,
    scope,
)
from diskkit.registry.options import RegistryOptions
from diskkit.streams.digestio import VerifyingReader
from diskkit.streams.readahead import ReadAhead
from diskkit.transports.base import Destination, Source

ACCEPT = ", ".join([mt.OCI_MANIFEST, mt.OCI_INDEX, mt.DOCKER_MANIFEST, mt.DOCKER_LIST])
SEGMENT = 64 << 20  # bytes streamed per PATCH (see _Upload)
RETAIN = 16 << 20  # the newest bytes sent held for resending until acknowledged
UPLOAD_QUEUE = 16  # pieces waiting for the sender: it goes on writing while the registry syncs a segment


_registries: dict[tuple[str, RegistryOptions], Registry] = {}


def registry_for(host: str, opts: RegistryOptions) -> Registry:
    """One client per host and options, so tokens and connections are reused within a process."""
    key = (host, opts)
    if key not in _registries:
        _registries[key] = Registry(host, opts)
    return _registries[key]


def _error_codes(response) -> set[str]:
    try:
        return {e.get("code") for e in response.json().get("errors") or [] if isinstance(e, dict)}
    except (ValueError, AttributeError, TypeError):
        return set()


def not_found_code(registry: Registry, scope_: str, response, repository: str) -> str | None:
    """A missing repository told from a missing tag, by the registry's error codes: NAME_UNKNOWN, or a
    MANIFEST_UNKNOWN (distribution answers it for both) followed by the repository's tag list, which
    only an existing repository has. None: the registry's answers do not tell."""
    codes = _error_codes(response)
    if "NAME_UNKNOWN" not in codes:
        try:
            probe = registry.request("GET", f"/v2/{repository}/tags/list?n=1", scope_, what="GET tags", retry=False)
        except DiskkitError:
            probe = None  # the 404 is the news; a failed probe only leaves it less precise
        if probe is None:
            pass
        elif probe.status_code == 404 and "NAME_UNKNOWN" in _error_codes(probe):
            codes.add("NAME_UNKNOWN")
        elif probe.status_code == 200:
            codes.add("MANIFEST_UNKNOWN")
    for code in ("NAME_UNKNOWN", "MANIFEST_UNKNOWN"):
        if code in codes:
            return code
    return None


def not_found_reason(code: str | None, repository: str, reference: str) -> str:
    if code == "NAME_UNKNOWN":
        return f": repository {repository} does not exist (NAME_UNKNOWN); check the repository's name"
    if code == "MANIFEST_UNKNOWN":
        what = "manifest" if reference.startswith("sha256:") else "tag"
        return f": repository {repository} exists, {what} {reference} does not (MANIFEST_UNKNOWN)"
    return " (HTTP 404)"


class RemoteSource(Source):
    """Reads from the first of registries.conf's pull sources that has the image: a short name's
    candidates in order, each one's mirrors in order, then the registry itself."""

    remote = True

    def __init__(self, ref: ImageRef, opts: RegistryOptions):
        assert ref.name is not None
        self.ref = ref
        self.where = str(ref)
        conf = registriesconf.load()
        names = conf.short_name_candidates(ref.short) if ref.short else [ref.name]
        self.sources = [(name, source) for name in names for source in conf.pull_sources(name)]
        self.opts = opts
        self.partial_dir: Path | None = None  # where blob downloads keep what they received, to resume after a kill
        self._top = None
        self._use(*self.sources[0])

    def _use(self, requested: DockerName, source: registriesconf.PullSource) -> None:
        # What the policy and signatures speak of: a short name's candidate, never a mirror's location.
        self.requested = requested
        self.name = source.name
        self.registry = registry_for(self.name.registry, self.opts.for_endpoint(source.insecure))
        self.pull_scope = scope(self.name.repository, "pull")

    def _get_manifest(self, reference: str) -> tuple[bytes, str | None]:
        path = f"/v2/{self.name.repository}/manifests/{reference}"
        response = self.registry.request("GET", path, self.pull_scope, headers={"Accept": ACCEPT}, stream=True, what="GET manifest")
        if response.status_code == 404:
            code = not_found_code(self.registry, self.pull_scope, response, self.name.repository)
            raise RegistryError(self.where, f"manifest {reference} not found{not_found_reason(code, self.name.repository, reference)}", status=404, code=code)
        check_status(response, (200,), self.registry.host, f"GET manifest {reference}")
        data = read_body(response, MAX_MANIFEST_BYTES, self.where, f"manifest {reference}")
        if reference.startswith("sha256:") and sha256_digest(data) != reference:
            raise RegistryError(self.where, f"manifest does not match the digest it was fetched by ({reference})")
        header = response.headers.get("Docker-Content-Digest")
        if header and header.startswith("sha256:") and header != sha256_digest(data):
            raise RegistryError(self.where, f"manifest does not match the registry's Docker-Content-Digest {header}")
        return data, (response.headers.get("Content-Type") or "").split(";")[0] or None

    def top_manifest(self):
        """The manifest the reference names, read once: what the policy checks is what is read after
        it, even when the tag moves between the two (containers/image's UnparsedImage keeps it too)."""
        if self._top is None:
            self._top = self._read_top()
        return self._top

    def _read_top(self):
        failures, statuses = [], set()
        for requested, source in self.sources:
            self._use(requested, source)
            try:
                data, media = self._get_manifest(self.name.reference)
                break
            except DiskkitError as exc:
                if len(self.sources) == 1:
                    raise
                failures.append(f"{source.name}: {exc.rule}")
                statuses.add(exc.exit_code)
        else:
            # Not found everywhere is not found; any other mix stays a plain failure.
            status = 404 if statuses == {Exit.NOT_FOUND} else None
            raise RegistryError(self.where, "no pull source has it (" + "; ".join(failures) + ")", status=status)
        desc = None
        if self.name.digest:
            desc = Descriptor(media or mt.OCI_MANIFEST, self.name.digest, len(data))
        return data, media, desc

    def read_manifest(self, desc: Descriptor) -> bytes:
        data, _ = self._get_manifest(desc.digest)
        return data

    def open_blob(self, desc: Descriptor) -> BinaryIO:
        return ResumableBlob(self.registry, self.name.repository, desc.digest, desc.size, self.partial_dir)

    def read_range(self, desc: Descriptor, offset: int, size: int) -> bytes:
        response = get_blob(self.registry, self.name.repository, desc.digest, offset, offset + size - 1)
        with response:
            try:
                data = response.raw.read(size)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                raise RegistryError(self.where, f"blob {desc.digest[:19]} bytes {offset}-{offset + size - 1}: {refusal(exc)}") from None
        if len(data) != size:
            raise DiskkitError(self.where, f"blob {desc.digest[:19]} ends before byte {offset + size}")
        return data

    @contextlib.contextmanager
    def blob(self, desc: Descriptor) -> Iterator[ReadAhead]:
        """The verified blob, received on one thread and hashed on another (socket reads and
        hashlib release the GIL) while the caller writes or decompresses on its own: a pull to a
        layout spent about as long receiving as hashing as writing, one after the other. The digest
        check still ends the stream: its failure reaches the reader before the end of the blob does."""
        raw = self.open_blob(desc)
        received = ReadAhead(raw)
        hashed = ReadAhead(VerifyingReader(received, desc.digest, desc.size, f"{self.where}: blob {desc.digest[:19]}"))
        suspect: DiskkitError | None = None
        try:
            yield hashed
        except DiskkitError as exc:
            # Bytes an earlier download kept are covered by the digest only at the end: when a blob
            # resumed from them fails (its digest, or the decompressor before it), they are suspect.
            # A registry failure says nothing against them; they stay for the next attempt.
            if not (isinstance(raw, ResumableBlob) and raw.resumed and not isinstance(exc, RegistryError)):
                raise
            suspect = exc
        finally:
            for stage in (hashed, received):
                stage.close()  # their threads are done with `raw` once closed
            if suspect is not None:
                raw.discard()
            raw.close()
        if suspect is not None:
            raise ResumeFailed(self.where, f"blob {desc.digest[:19]} resumed from {raw.resumed} bytes kept by an earlier download failed ({suspect.rule}); those bytes are discarded")


class _Upload:
    """A blob upload session (POST, PATCH..., PUT ?digest=) that streams and resumes after a drop.

    Writes go through a short queue to a sender thread, which streams them to the registry in
    PATCH requests of up to SEGMENT bytes each (chunked transfer encoding, as docker and skopeo
    push), so the registry takes the bytes while compression goes on. Segments are large because
    every request costs: distribution syncs its upload file to disk at the end of each PATCH, and
    35 PATCHes of 8 MiB made a 700 MB build+push 0.17 s slower than 5 streamed ones.

    The bytes sent and not yet acknowledged are held, the newest RETAIN of them: after a dropped
    connection or a refusal the upload status (GET on the session) says how much arrived, and
    what is still held goes again in the same session. A registry that dropped the session, or
    acknowledged less than is held, needs the blob produced again (UploadLost).
    """

    def __init__(self, dest: "RemoteDestination"):
        self.dest = dest
        self.registry = dest.registry
        self.offset = 0  # bytes the registry has acknowledged
        self.sent = 0  # bytes taken from the queue, whether acknowledged or not
        self.held: collections.deque[tuple[int, bytes]] = collections.deque()  # (offset, piece), unacknowledged
        self.held_bytes = 0
        self.ended = False  # the writer's end was taken from the queue
        self.location = self._start()
        self.done = False
        self.error: BaseException | None = None
        self.pieces: queue.Queue = queue.Queue(UPLOAD_QUEUE)
        self.sender = threading.Thread(target=self._send_all, daemon=True)
        self.sender.start()

    def _start(self) -> str:
        response = self.registry.request("POST", f"/v2/{self.dest.repository}/blobs/uploads/", self.dest.push_scope, headers={"Content-Length": "0"}, what="start upload")
        check_status(response, (202,), self.registry.host, f"start blob upload to {self.dest.repository}")
        return self.registry.resolve(response.headers["Location"])

    def write(self, data) -> None:
        if self.error is not None:
            raise self.error
        if data:
            self.pieces.put(bytes(data))

    def _take(self) -> bytes | None:
        """The writer's next piece, held until acknowledged; None at the end."""
        piece = self.pieces.get()
        if piece is None:
            self.ended = True
            return None
        self.held.append((self.sent, piece))
        self.sent += len(piece)
        self.held_bytes += len(piece)
        while self.held_bytes - len(self.held[0][1]) >= RETAIN:
            self.held_bytes -= len(self.held.popleft()[1])
        return piece

    def _acknowledged(self, offset: int) -> None:
        self.offset = offset
        while self.held and self.held[0][0] + len(self.held[0][1]) <= offset:
            self.held_bytes -= len(self.held.popleft()[1])

    def _segment(self, start: int):
        """The body of one PATCH from `start`: what is held from there, then new pieces up to SEGMENT
        bytes. A factory, as the client calls it again to send the request again after a 401."""
        if start < (self.held[0][0] if self.held else self.sent):  # the bytes from `start` are no longer held
            raise UploadLost(self.registry.host, f"the registry has the first {start} bytes of the upload, and resending from there needs more than the {RETAIN >> 20} MiB kept")

        def body() -> Iterator[bytes | memoryview]:
            for at, piece in list(self.held):
                if at + len(piece) > start:
                    yield memoryview(piece)[max(0, start - at):]
            while not self.ended and self.sent - start < SEGMENT:
                piece = self._take()
                if piece is not None:
                    yield piece

        return body()

    def _send_all(self) -> None:
        try:
            failures = 0
            while self.offset < self.sent or not self.ended and self._take() is not None:
                start = self.offset
                headers = {"Content-Type": "application/octet-stream"}
                error: RegistryError | None = None
                try:
                    response = self.registry.request("PATCH", self.location, self.dest.push_scope, headers=headers, body=lambda: self._segment(start), what="upload chunk", retry=False)
                except AuthError:
                    raise
                except UploadLost:
                    raise
                except RegistryError as exc:
                    response, error = None, exc
                if response is None or response.status_code in RETRY_STATUS or response.status_code == 416:
                    # Dropped, refused for now, or out of step: ask the session how much arrived, go on from there.
                    if failures >= self.registry.opts.retries:
                        if error is not None:
                            raise error
                        check_status(response, (202,), self.registry.host, f"upload chunk at {start}")
                    time.sleep(retry_after(response, failures, self.registry.opts))
                    failures += 1
                    acknowledged = self._status()
                    if acknowledged > self.sent:
                        raise RegistryError(self.registry.host, f"the upload session reports {acknowledged} bytes, more than the {self.sent} sent")
                    self._acknowledged(acknowledged)
                    continue
                check_status(response, (202,), self.registry.host, f"upload chunk at {start}")
                self.location = self.registry.resolve(response.headers.get("Location", self.location))
                self._acknowledged(self.sent)
                failures = 0  # the retries are per segment
        except BaseException as exc:
            self.error = exc
            while not self.ended:  # the writer must never block on a queue nobody reads
                self._take()
                self.held.clear()

    def _finish_sending(self) -> None:
        if self.sender.is_alive():
            self.pieces.put(None)
            self.sender.join()
        if self.error is not None:
            raise self.error

    def _status(self) -> int:
        """Bytes the registry holds for this session, from the Range header of GET on the session."""
        response = self.registry.request("GET", self.location, self.dest.push_scope, what="upload status")
        if response.status_code in (400, 404):
            # distribution 2.8 and others drop a session whose chunk arrived in part: start over.
            raise UploadLost(self.registry.host, f"the registry dropped the upload session after an interrupted chunk (HTTP {response.status_code})")
        check_status(response, (204,), self.registry.host, "upload status")
        self.location = self.registry.resolve(response.headers.get("Location", self.location))
        end = int(response.headers.get("Range", "0-0").rsplit("-", 1)[1])
        # "0-0" means nothing received yet as well as one byte; nothing is the reading that can recover.
        return end + 1 if end or self.offset else 0

    def commit(self, digest: str, size: int) -> None:
        self._finish_sending()
        if self.offset != size:
            raise RegistryError(self.registry.host, f"uploaded {self.offset} bytes of blob {digest[:19]}, expected {size}")
        sep = "&" if "?" in self.location else "?"
        response = self.registry.request("PUT", f"{self.location}{sep}digest={digest}", self.dest.push_scope, headers={"Content-Length": "0"}, body=b"", what="finish upload")
        check_status(response, (201, 204), self.registry.host, f"finish upload of {digest[:19]}")
        self.done = True

    def cancel(self) -> None:
        with contextlib.suppress(BaseException):
            self._finish_sending()
        with contextlib.suppress(DiskkitError, OSError):
            self.registry.request("DELETE", self.location, self.dest.push_scope, what="cancel upload", retry=False)


class _SizedBody:
    """A request body that streams from a reader; its length lets requests send Content-Length."""

    def __init__(self, reader: BinaryIO, size: int, advance):
        self.reader, self.size, self.advance = reader, size, advance

    def __len__(self) -> int:
        return self.size

    def read(self, n: int = -1) -> bytes:
        data = self.reader.read(n if n and n > 0 else 1 << 20)
        self.advance(len(data))
        return data


class RemoteDestination(Destination):
    compresses_plain_layers = True
    concurrent_blobs = True

    def __init__(self, ref: ImageRef, opts: RegistryOptions):
        assert ref.name is not None
        self.ref = ref
        self.repository = ref.name.repository
        target = registriesconf.load().push_target(ref.name)
        self.registry = registry_for(ref.name.registry, opts.for_endpoint(target.insecure))
        self.push_scope = scope(self.repository, "pull,push")

    def has_blob(self, desc: Descriptor) -> bool:
        response = self.registry.request("HEAD", f"/v2/{self.repository}/blobs/{desc.digest}", self.push_scope, what="HEAD blob")
        # The size too, where the registry says it: a build record's layer is trusted no further than this.
        length = response.headers.get("Content-Length")
        return response.status_code == 200 and (length is None or not length.isdigit() or int(length) == desc.size)

    def check_writable(self) -> None:
        """An upload session opened and cancelled: the registry is reachable and takes pushes from us."""
        start = self.registry.request("POST", f"/v2/{self.repository}/blobs/uploads/", self.push_scope, headers={"Content-Length": "0"}, what="start upload")
        check_status(start, (202,), self.registry.host, f"start blob upload to {self.repository}")
        if "Location" in start.headers:
            with contextlib.suppress(DiskkitError):
                self.registry.request("DELETE", self.registry.resolve(start.headers["Location"]), self.push_scope, retry=False)

    def mount(self, desc: Descriptor, from_repository: str) -> bool:
        """Cross-repository mount: the registry links a blob it already holds, nothing is sent."""
        both = f"{self.push_scope} {scope(from_repository, 'pull')}"
        response = self.registry.request(
            "POST", f"/v2/{self.repository}/blobs/uploads/?mount={desc.digest}&from={from_repository}", both,
            headers={"Content-Length": "0"}, what="mount blob",
        )
        if response.status_code == 201:
            return True
        if response.status_code == 202 and "Location" in response.headers:
            with contextlib.suppress(DiskkitError):
                self.registry.request("DELETE", self.registry.resolve(response.headers["Location"]), self.push_scope, retry=False)
        return False

    @contextlib.contextmanager
    def blob_writer(self, media_type: str) -> Iterator[_Upload]:
        upload = _Upload(self)
        try:
            yield upload
        finally:
            if not upload.done:
                upload.cancel()

    def put_blob(self, data: bytes, media_type: str) -> Descriptor:
        desc = Descriptor(media_type, sha256_digest(data), len(data))
        if self.has_blob(desc):
            return desc
        # Small blobs go up monolithically: POST, then one PUT carrying the bytes.
        start = self.registry.request("POST", f"/v2/{self.repository}/blobs/uploads/", self.push_scope, headers={"Content-Length": "0"}, what="start upload")
        check_status(start, (202,), self.registry.host, f"start blob upload to {self.repository}")
        location = self.registry.resolve(start.headers["Location"])
        sep = "&" if "?" in location else "?"
        response = self.registry.request(
            "PUT", f"{location}{sep}digest={desc.digest}", self.push_scope,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(len(data))}, body=data, what="upload blob",
        )
        check_status(response, (201, 204), self.registry.host, f"upload blob {desc.digest[:19]}")
        return desc

    def put_blob_stream(self, desc: Descriptor, reader: BinaryIO, advance) -> None:
        """Monolithic streaming upload of a blob whose source can be read again: POST, then one PUT.

        The body streams from the (verifying) reader; a drop or a 5xx makes the whole blob go
        again (UploadLost), which a copy can do since its source re-opens.
        """
        start = self.registry.request("POST", f"/v2/{self.repository}/blobs/uploads/", self.push_scope, headers={"Content-Length": "0"}, what="start upload")
        check_status(start, (202,), self.registry.host, f"start blob upload to {self.repository}")
        location = self.registry.resolve(start.headers["Location"])
        sep = "&" if "?" in location else "?"
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(desc.size)}
        try:
            response = self.registry.request(
                "PUT", f"{location}{sep}digest={desc.digest}", self.push_scope,
                headers=headers, body=_SizedBody(reader, desc.size, advance), what="upload blob", retry=False,
            )
        except AuthError:
            raise
        except RegistryError as exc:
            raise UploadLost(self.registry.host, f"upload of {desc.digest[:19]} interrupted ({exc.rule})") from None
        if response.status_code in RETRY_STATUS:
            raise UploadLost(self.registry.host, f"upload of {desc.digest[:19]} refused for now (HTTP {response.status_code})")
        check_status(response, (201, 204), self.registry.host, f"upload blob {desc.digest[:19]}")

    def put_manifest(self, data: bytes, media_type: str, platform: dict | None = None, child: bool = False) -> Descriptor:
        digest = sha256_digest(data)
        name = self.ref.name
        if child or not (name.tag or name.digest):
            reference = digest
        elif name.digest:
            if name.digest != digest:
                raise DiskkitError(str(self.ref), f"the manifest hashes to {digest}, not the digest in the reference")
            reference = digest
        else:
            reference = name.tag
        if self.before_manifest is not None:
            self.before_manifest(self, digest, child)
        response = self.registry.request(
            "PUT", f"/v2/{self.repository}/manifests/{reference}", self.push_scope,
            headers={"Content-Type": media_type}, body=data, what="PUT manifest",
        )
        check_status(response, (201, 200, 202), self.registry.host, f"PUT manifest {reference}")
        return Descriptor(media_type, digest, len(data), platform=platform)

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        pass


"""Fill a DataVolume's claim the way CDI's importer does: fetch the source into scratch space in the
claim directory, check it, convert it to a sparse raw `disk.img` with qemu-img, size it to the claim.

Nothing is written under the name `disk.img` until the image is complete: it is staged under a
`.diskkit-` name and renamed, so a failed or killed import leaves the claim as it was. Every copy
streams in 1 MiB pieces (zero runs become holes), so memory stays flat whatever the disk size.
"""

from __future__ import annotations

import contextlib
import lzma
import os
import secrets
import ssl
import time
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

from diskkit.disk import diskheader, qemuimg
from diskkit.errors import DiskkitError
from diskkit.registry.options import RegistryOptions
from diskkit.streams.sparse import SparseWriter
from launcher.datavolumes import archive, dvstate
from launcher.datavolumes.dvstate import Target
from launcher.hostfs import asowner
from launcher.hostfs.dirfd import Dir, give
from launcher.spec import datavolume as dvm
from launcher.spec.datavolume import shown_url
from launcher.spec.k8s import Objects, read_secret
from launcher.volumes import sizing
from launcher.volumes.files import KUBEVIRT_QEMU, free_bytes
from launcher.volumes.storage import Storage

CHUNK = 1 << 20
HTTP_ATTEMPTS = 3  # a dropped download is tried again (with Range when the server honours it)
HTTP_TIMEOUT = (30, 300)  # connect, and between two reads
PROGRESS_EVERY = 1.0  # seconds between state file updates
ACCESS_KEY, SECRET_KEY = "accessKeyId", "secretKey"  # CDI's endpoint secret keys
DISK = "disk.img"
QCOW2_SLACK = 4 << 20  # qcow2's header, L1 and refcount tables beyond its per-cluster metadata


# CDI importer's processing phases (pkg/importer/data-processor.go, ProcessingPhase*) the work goes
# through, with what each does here; said as each begins, so a second pass of percentages is not news.
STAGES = {
    "TransferScratch": "fetching the source into scratch space in the claim",
    "Convert": "qemu-img convert to a raw disk.img",
}


class Progress:
    """Percent done, recorded in the state file as CDI's status.progress ("45.67%"), at most once a second,
    and told to `say` (when given) at each quarter, with the importer's processing phase (`stage`).

    It only grows, across phases too, as CDI's: its importer adds to one progress counter only what
    exceeds the value so far (pkg/image/qemu.go reportProgress, pkg/util/prometheus/prometheus.go
    updateProgress), so a conversion after a download does not start again from 0 %."""

    def __init__(self, target: Target, say: Callable[[str], None] | None = None):
        self.target, self.say = target, say
        self._last = 0.0
        self._quarter = 0
        self._stage: str | None = None
        self._best = _percent(dvstate.read_status(target).progress)  # an upload's received bytes count

    def stage(self, name: str) -> None:
        if name != self._stage:
            self._stage = name
            if self.say is not None:
                self.say(f"DataVolume {self.target.dv.key}: {self.target.dv.running_phase}, {name}: {STAGES[name]}")

    def __call__(self, percent: float, force: bool = False) -> None:
        now = time.monotonic()
        grown = min(percent, 100.0) > self._best
        self._best = max(self._best, min(percent, 100.0))
        if force or (grown and now - self._last >= PROGRESS_EVERY):
            self._last = now
            dvstate.record(self.target, progress=f"{self._best:.2f}%")
        quarter = int(self._best // 25)
        if self.say is not None and 0 < quarter < 4 and quarter > self._quarter:
            self._quarter = quarter
            stage = f" ({self._stage})" if self._stage else ""
            self.say(f"DataVolume {self.target.dv.key}: {self.target.dv.running_phase} {quarter * 25}%{stage}")

    def receive(self, message: dict) -> None:
        """A Relay's message from the worker that runs as the claim's owner."""
        if "stage" in message:
            self.stage(message["stage"])
        else:
            self(message["progress"], message["force"])


def _percent(text: str | None) -> float:
    try:
        return float((text or "").rstrip("%"))
    except ValueError:
        return 0.0  # "N/A", or none yet


class Relay:
    """Progress of work done as a claim's owner, sent to the parent that records it (a few times a second)."""

    def __init__(self, send: Callable[[dict], None]):
        self.send = send
        self._last = 0.0

    def stage(self, name: str) -> None:
        self.send({"stage": name})

    def __call__(self, percent: float, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last >= PROGRESS_EVERY / 4:
            self._last = now
            self.send({"progress": percent, "force": force})


def scratch(what: str) -> str:
    """A fresh work name in the claim directory (remove_scratch clears what a killed worker left)."""
    return f"{dvstate.TEMP_PREFIX}{what}-{secrets.token_hex(4)}"


# ---------------------------------------------------------------- checks

def check_source(path: Path, shown: str) -> qemuimg.DiskInfo:
    """CDI's validation of a fetched image (formats raw, qcow2, vmdk, vdi, vpc, vhdx; no backing file),
    plus what qemu must never be handed: images naming host files are refused from their first bytes."""
    with open(path, "rb") as f:
        head = f.read(diskheader.HEADER_BYTES)
    if head.startswith(b"# Disk DescriptorFile"):
        raise DiskkitError(shown, "a VMDK descriptor names its extents as files on this host; only single-file VMDKs are accepted")
    header = diskheader.parse(head)
    if header is not None and (unsafe := diskheader.safety_violations(header)):
        raise DiskkitError(shown, unsafe[0])
    info = qemuimg.info(path)
    if info.format not in qemuimg.INPUT_FORMATS:
        raise DiskkitError(shown, f"Invalid format {info.format} for image {shown}")
    if info.backing_file:
        raise DiskkitError(shown, f"expected no backing file, but found {info.backing_file}")
    if info.data_file:
        raise DiskkitError(shown, f"expected no external data file, but found {info.data_file}")
    extents = ((info.raw.get("format-specific") or {}).get("data") or {}).get("extents") or []
    if any(e.get("filename") not in (None, str(path)) for e in extents):
        raise DiskkitError(shown, "the VMDK names extents in other files; only single-file VMDKs are accepted")
    if info.format == "qcow2":
        qemuimg.check(path, "qcow2")
    return info



def disk_size(target: Target, virtual_size: int, reclaimable: int, tolerance: int) -> tuple[int, str | None]:
    """The size of disk.img: the claim's request (whole MiB; KubeVirt's tolerance when space is short),
    and never below the image, which is CDI's `A larger PVC is required`."""
    if target.size is None:
        wanted = -(-virtual_size // sizing.MIB) * sizing.MIB  # no request: exactly what the image needs
    else:
        wanted = sizing.image_size(target.size, None) or 0
    fitted = sizing.fit(wanted, free_bytes(target.directory) + reclaimable, f"DataVolume {target.dv.key}", tolerance)
    if virtual_size > fitted.size:
        raise DiskkitError(f"DataVolume {target.dv.key}", f"virtual image size {virtual_size} is larger than the reported"
                                                          f" available storage {fitted.size}. A larger PVC is required")
    return fitted.size, fitted.note


def install(target: Target, claim: Dir, work: Dir, source: str | Path, shown: str, progress: Progress | Relay, tolerance: int) -> list[str]:
    """Check the source, write it as raw disk.img sized to the claim, atomically. Returns notes.

    `source` is either a name in `work` (a root-made directory in the claim), consumed: a raw one is
    renamed into place, as it already is the sparse raw image; or a path read as it stands (a clone's
    source, given as its open fd). Anything but raw goes through `qemu-img convert -O raw`, whose
    progress is recorded. qemu-img gets `work` as /proc/PID/fd/N: the claim's owner cannot swap it.
    """
    consume = isinstance(source, str)
    path = work.proc / source if consume else source
    info = check_source(path, shown)
    reclaimable = work.regular(source).st_blocks * 512 if consume else 0
    size, note = disk_size(target, info.virtual_size, reclaimable, tolerance)
    if consume and info.format == "raw":
        out = source
    else:
        out = scratch("disk")
        progress.stage("Convert")
        qemuimg.convert(path, work.proc / out, info.format, "raw", progress=progress)
        if consume:
            work.unlink(source)
    try:
        fd = work.open_file(out, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # CDI resizes the image to the claim, so the guest sees all of it
            os.fsync(fd)
            give(fd, KUBEVIRT_QEMU, 0o660)
        finally:
            os.close(fd)
        work.rename(out, claim, DISK)  # a link planted at disk.img is replaced, never followed
        claim.fsync()
    except OSError as exc:
        work.unlink(out)
        raise DiskkitError(target.disk, f"cannot be written ({exc.strerror})") from None
    return [note] if note else []


def fetch_limit(target: Target) -> int:
    """How many bytes a source may bring, compressed or inflated: the claim's size plus what qcow2 can
    add around it (L2 tables and refcounts, under 1/32 of the virtual size even with 512-byte clusters,
    and a few MiB of header, L1 and refcount table). CDI's importer is bounded by its scratch volume,
    sized as the claim (pkg/importer/http-datasource.go Transfer: GetAvailableSpace, then
    StreamDataToFile into the scratch space); with no size, the claim's free space is the bound."""
    if target.size is None:
        return free_bytes(target.directory)
    return target.size + target.size // 32 + QCOW2_SLACK


# ---------------------------------------------------------------- sources

def _ca_bundle(objects: Objects | None, namespace: str, name: str, where: str, into: Path) -> Path:
    """The system's CAs plus every value of the ConfigMap (CDI mounts them as files and adds them all)."""
    cm = objects.get("ConfigMap", namespace, name) if objects is not None else None
    if cm is None:
        raise DiskkitError(where, f'configmaps "{name}" not found in namespace {namespace} (the certConfigMap)')
    certs = [str(v) for v in (cm.get("data") or {}).values() if v]
    if not any("-----BEGIN CERTIFICATE-----" in c for c in certs):
        raise DiskkitError(where, f"configmap {namespace}/{name} holds no PEM certificate (the certConfigMap)")
    system = Path(ssl.get_default_verify_paths().cafile or "/etc/ssl/certs/ca-certificates.crt")
    into.mkdir(exist_ok=True)
    bundle = into / "ca.crt"
    bundle.write_text((system.read_text() if system.is_file() else "") + "\n" + "\n".join(certs) + "\n")
    return bundle


def _endpoint_secret(objects: Objects | None, namespace: str, name: str, where: str) -> tuple[str, str]:
    if objects is None:
        raise DiskkitError(where, f"secretRef {name} needs --manifests holding the Secret")
    shown, data = read_secret(objects, {"name": name}, namespace, where, "source")
    try:
        return data.get(ACCESS_KEY, b"").decode(), data.get(SECRET_KEY, b"").decode()
    except UnicodeDecodeError:
        raise DiskkitError(where, f"secret {shown}: {ACCESS_KEY} and {SECRET_KEY} must be text") from None


def _http_error(status: int, reason: str) -> str:
    return f"Unable to connect to http data source: expected status code 200, got {status}. Status: {status} {reason}"


class _Unpacker:
    """gzip and xz sources are decompressed as they arrive, as CDI's importer does; output comes in
    pieces of at most CHUNK bytes, so a highly compressed stream cannot balloon memory."""

    def __init__(self, kind: str):
        self.kind = kind
        self._new()

    def _new(self) -> None:
        self._d = zlib.decompressobj(wbits=31) if self.kind == "gzip" else lzma.LZMADecompressor()

    @classmethod
    def detect(cls, head: bytes) -> _Unpacker | None:
        if head[:2] == b"\x1f\x8b":
            return cls("gzip")
        if head[:6] == b"\xfd7zXZ\x00":
            return cls("xz")
        return None

    def feed(self, data: bytes):
        try:
            while data:
                if self.kind == "gzip":
                    yield self._d.decompress(data, CHUNK)
                    data = self._d.unconsumed_tail
                    if self._d.eof and self._d.unused_data:  # concatenated gzip members (pigz, cat a.gz b.gz)
                        data = self._d.unused_data
                        self._new()
                else:
                    yield self._d.decompress(data, CHUNK)
                    data = b""
                    while not self._d.needs_input and not self._d.eof:
                        yield self._d.decompress(b"", CHUNK)
        except (zlib.error, lzma.LZMAError) as exc:
            raise DiskkitError("source", f"{self.kind} data is corrupt ({exc})") from None

    def check_end(self, shown: str) -> None:
        if not self._d.eof:
            raise DiskkitError(shown, f"the {self.kind} stream ends before its end marker (truncated)")


def download(url: str, dest: Path, progress: Progress | Relay, auth: tuple[str, str] | None, verify: str | bool, limit: int) -> None:
    """GET `url` into `dest` (sparse; gzip and xz decompressed on the way). A body cut short is fetched
    again: from where it stopped when the server honours Range (and the body is not compressed),
    else from the start; after HTTP_ATTEMPTS tries the import fails. More than `limit` bytes, on the
    wire or inflated, stops the import there: an endless body or a gzip bomb never fills the host."""
    import requests

    shown = shown_url(url)
    have, total, problem = 0, None, ""
    unpacker: _Unpacker | None = None
    session = requests.Session()
    session.headers["User-Agent"] = "diskkit-launcher"
    with session, open(dest, "wb") as out:
        writer = SparseWriter(out)
        for attempt in range(HTTP_ATTEMPTS):
            if attempt:
                time.sleep(min(2 ** (attempt - 1), 5))
            headers = {"Range": f"bytes={have}-"} if have and unpacker is None else {}
            try:
                with session.get(url, stream=True, timeout=HTTP_TIMEOUT, auth=auth, verify=verify, headers=headers) as resp:
                    if resp.status_code == 206 and headers and (resp.headers.get("Content-Range") or "").startswith(f"bytes {have}-"):
                        pass  # continues where the last attempt stopped
                    elif resp.status_code == 200:
                        have, unpacker = 0, None
                        out.seek(0)
                        out.truncate(0)
                    elif 500 <= resp.status_code or resp.status_code in (408, 429):
                        problem = _http_error(resp.status_code, resp.reason)
                        continue
                    else:
                        raise DiskkitError(shown, _http_error(resp.status_code, resp.reason))
                    length = resp.headers.get("Content-Length")
                    total = have + int(length) if length and length.isdigit() else None
                    if total is not None and total > limit:
                        raise DiskkitError(shown, _too_large(f"is {total} bytes", limit))
                    for chunk in resp.iter_content(CHUNK):
                        if have == 0:
                            unpacker = _Unpacker.detect(chunk)
                        have += len(chunk)
                        if have > limit:
                            raise DiskkitError(shown, _too_large(f"sent more than {limit} bytes", limit))
                        for piece in unpacker.feed(chunk) if unpacker is not None else (chunk,):
                            writer.write(piece)
                            if out.tell() > limit:
                                raise DiskkitError(shown, _too_large(f"inflates to more than {limit} bytes", limit))
                        if total:
                            progress(100.0 * have / total)
            except requests.exceptions.SSLError as exc:
                raise DiskkitError(shown, f"TLS verification failed ({_reason(exc)}); a private CA goes in certConfigMap") from None
            except requests.exceptions.ChunkedEncodingError:
                problem = f"the connection closed after {have} of {total if total is not None else '?'} bytes"
                continue
            except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
                if have:
                    problem = f"the connection failed after {have} of {total if total is not None else '?'} bytes ({_reason(exc)})"
                else:
                    problem = f"cannot connect ({_reason(exc)})"
                continue
            except requests.exceptions.RequestException as exc:  # a redirect to file://, a bad URL, a redirect loop
                raise DiskkitError(shown, f"the request failed ({type(exc).__name__}: {_reason(exc)})") from None
            if total is not None and have != total:
                problem = f"the connection closed after {have} of {total} bytes"
                continue
            if unpacker is not None:
                unpacker.check_end(shown)
            out.truncate(out.tell())  # a trailing hole still counts
            out.flush()
            os.fsync(out.fileno())
            return
    raise DiskkitError(shown, f"{problem} ({HTTP_ATTEMPTS} attempts)")


def _too_large(what: str, limit: int) -> str:
    return f"the source {what}, more than the claim holds (its size and qcow2 overhead, {limit} bytes); the import stopped there. A larger PVC is required"


def _reason(exc: BaseException) -> str:
    text = str(exc.args[0] if exc.args else exc)
    return text.split(": ")[-1].strip("()'\" ")[:160] or type(exc).__name__


def _http(target: Target, store: Storage, progress: Progress | Relay, work: Dir) -> tuple[str, str]:
    source, dv = target.dv.source, target.dv
    where = f"DataVolume {dv.key}"
    auth = _endpoint_secret(store.objects, dv.namespace, source.secret_ref, where) if source.secret_ref else None
    verify: str | bool = True
    if source.cert_config_map:
        verify = str(_ca_bundle(store.objects, dv.namespace, source.cert_config_map, where, work.proc))
    staged = "download"
    progress.stage("TransferScratch")
    download(source.url, work.proc / staged, progress, auth if auth and all(auth) else None, verify, fetch_limit(target))
    return staged, shown_url(source.url)


def _registry(target: Target, store: Storage, registry: RegistryOptions, work: Dir) -> tuple[str, str]:
    from diskkit.ops.verify import scan_image
    from launcher.node.admission import admitted

    source, dv = target.dv.source, target.dv
    where = f"DataVolume {dv.key}"
    scheme, _, rest = source.url.partition("://")
    ref = rest if scheme == "docker" else f"oci-archive:{rest}"
    opts = registry
    if source.cert_config_map:
        certs = work.proc / "certs"
        _ca_bundle(store.objects, dv.namespace, source.cert_config_map, where, certs)
        opts = replace(opts, cert_dir=str(certs), tls_verify=True)
    if source.secret_ref:
        user, password = _endpoint_secret(store.objects, dv.namespace, source.secret_ref, where)
        opts = replace(opts, creds=f"{user}:{password}")
    spool = work.proc / "spool"
    spool.mkdir()
    with admitted(ref, opts, None) as src:  # as every pull: the policy before any layer is read
        image = src.image(None)
        tree, found, staged = scan_image(src, image, None, spool)
        blocking = tree.findings + [p for p in found.problems if p not in found.access]
        if found.node is None or staged is None or blocking:
            raise DiskkitError(shown_url(source.url), "; ".join(blocking) or f"{found.shown}: not found in the image")
    return str(Path(staged).relative_to(work.proc)), shown_url(source.url)


def _blank(target: Target, claim: Dir, work: Dir, tolerance: int) -> list[str]:
    if target.size is None:
        raise DiskkitError(f"DataVolume {target.dv.key}", "a blank DataVolume needs a size (spec.storage.resources.requests.storage or --pvc NAME=DIR:SIZE)")
    size, note = disk_size(target, 0, 0, tolerance)
    fd = work.create(DISK, 0o660)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
        give(fd, KUBEVIRT_QEMU, 0o660)
    finally:
        os.close(fd)
    work.rename(DISK, claim, DISK)
    claim.fsync()
    return [note] if note else []


def _clone(target: Target, into: Dir, work: Dir, store: Storage, progress: Progress | Relay, tolerance: int) -> list[str]:
    source = target.dv.source
    origin = dvm.DataVolume(source.claim, source.claim_namespace, dvm.Source("blank"), None, None, None, target.dv.origin)
    try:
        claim = dvstate.resolve(origin, store)
    except DiskkitError as exc:
        raise DiskkitError(f"DataVolume {target.dv.key}", f"source claim {origin.key}: {exc.rule}") from None
    if claim.directory.resolve() == target.directory.resolve():
        raise DiskkitError(f"DataVolume {target.dv.key}", "the source claim is the target claim")
    # The source's disk.img is opened here (no link followed) and qemu-img reads that open file.
    with claim.claim() as source_dir:
        if source_dir.regular(DISK) is None:
            raise DiskkitError(f"DataVolume {target.dv.key}", f"source claim {origin.key} holds no disk.img yet")
        fd = source_dir.open_file(DISK)
        source = source_dir.file_path(DISK, fd)
    try:
        if target.size is not None and target.size < os.fstat(fd).st_size:
            raise DiskkitError(f"DataVolume {target.dv.key}", "target resources requests storage size is smaller than the source")
        return install(target, into, work, source, f"claim {origin.key}", progress, tolerance)
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the whole job

def fill(target: Target, store: Storage, registry: RegistryOptions | None, say: Callable[[str], None] | None = None) -> list[str]:
    """Import, clone or create the DataVolume's disk, recording each phase. The caller holds the work lock.

    Returns notes (KubeVirt's ToleratedSmallPV text when the claim is short of space).
    """
    dv = target.dv
    with target.claim() as claim:
        if claim.lstat(DISK) is not None:
            raise DiskkitError(f"DataVolume {dv.key}", f"claim {dv.name} already holds {target.disk} that this DataVolume did not"
                                                       " write; remove it to import again")
        dvstate.remove_scratch(target)
        dvstate.record(target, phase=dv.running_phase, progress="0.00%", message=None, pid=os.getpid())
        progress = Progress(target, say)
        owner = asowner.owner_of(claim)
        try:
            if owner is None:
                notes = _fill_in_work(target, claim, store, registry, progress)
            else:
                # A claim of a user's: its owner does the work, so a link it planted leads nowhere it
                # could not go itself. The state file stays ours: progress comes back as messages.
                notes = _fill_as(owner, target, claim, store, registry, progress)
        except DiskkitError as exc:
            failure = exc
            if not (exc.subject or "").startswith("DataVolume"):
                failure = DiskkitError(f"DataVolume {dv.key}", exc.line())
                failure.exit_code = exc.exit_code  # named for the DataVolume, a registry's 404 or 401 keeps its status
            dvstate.record(target, phase=dvm.FAILED, message=failure.line(), pid=None)
            raise failure from None
        except OSError as exc:  # the claim ran out of space, or went away
            failure = DiskkitError(f"DataVolume {dv.key}", f"writing to claim {dv.name} failed ({exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''})")
            dvstate.record(target, phase=dvm.FAILED, message=failure.line(), pid=None)
            raise failure from None
        except BaseException:
            dvstate.record(target, phase=dvm.PENDING, message="interrupted; the next importer starts again", pid=None)
            raise
        finally:
            dvstate.remove_scratch(target)
    dvstate.record(target, phase=dvm.SUCCEEDED, progress="100.0%", message="Import Complete" if dv.source.kind != "pvc" else "Clone Complete", pid=None)
    return notes


def _fill_as(owner: asowner.Owner, target: Target, claim: Dir, store: Storage, registry: RegistryOptions | None, progress: Progress) -> list[str]:
    fetched = None
    if target.dv.source.kind == "registry":
        # The registry configuration, policy and credentials are the launcher's user's, which the claim's
        # owner cannot read: the image is fetched here, in a work directory of ours, and the worker gets
        # the disk as an open file (its name is gone from the claim by then).
        with _work(claim) as work:
            progress.stage("TransferScratch")
            staged, shown = _registry(target, store, registry or RegistryOptions(), work)
            fetched = (work.open_file(staged), shown)
    try:
        return asowner.run_as(owner, lambda send: {"notes": _fill_in_work(target, claim, store, registry, Relay(send), fetched)},
                              progress.receive)["notes"]
    finally:
        if fetched is not None:
            os.close(fetched[0])


@contextlib.contextmanager
def _work(claim: Dir) -> Iterator[Dir]:
    work_name = scratch("work")
    # The claim's owner can write the claim directory, not this one (0700, made by whoever works here:
    # root, or the owner itself): what is staged here, and the paths tools are given into it, stay ours.
    work = claim.mkdir(work_name, 0o700)
    try:
        yield work
    finally:
        claim.discard(work, work_name)


def _fill_in_work(target: Target, claim: Dir, store: Storage, registry: RegistryOptions | None, progress: Progress | Relay,
                  fetched: tuple[int, str] | None = None) -> list[str]:
    with _work(claim) as work:
        return _fill(target, claim, work, store, registry, progress, fetched)


def _copy_in(fd: int, work: Dir) -> str:
    """The source the parent fetched (an open file), copied into our work directory (sparse)."""
    name = "source"
    out = work.create(name, 0o600)
    with os.fdopen(out, "wb") as f:
        writer, offset = SparseWriter(f), 0
        while chunk := os.pread(fd, CHUNK, offset):
            writer.write(chunk)
            offset += len(chunk)
        f.truncate(f.tell())
        f.flush()
        os.fsync(f.fileno())
    return name


def _fill(target: Target, claim: Dir, work: Dir, store: Storage, registry: RegistryOptions | None, progress: Progress | Relay,
          fetched: tuple[int, str] | None = None) -> list[str]:
    dv = target.dv
    if dv.source.kind == "blank":
        return _blank(target, claim, work, store.tolerance)
    if dv.source.kind == "pvc":
        return _clone(target, claim, work, store, progress, store.tolerance)
    if fetched is not None:
        staged, shown = _copy_in(fetched[0], work), fetched[1]
    elif dv.source.kind == "http":
        staged, shown = _http(target, store, progress, work)
    else:
        progress.stage("TransferScratch")
        staged, shown = _registry(target, store, registry or RegistryOptions(), work)
    if dv.content_type == "archive":
        archive.unpack(work.proc / staged, claim, work, target.size, shown, KUBEVIRT_QEMU)
        return []
    return install(target, claim, work, staged, shown, progress, store.tolerance)

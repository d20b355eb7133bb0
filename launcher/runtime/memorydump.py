"""Memory dumps of a running VM into a claim, as `virtctl memory-dump get|remove` have KubeVirt take them.

KubeVirt (pkg/virt-api/rest/memorydump.go validates the request and the claim; virt-handler names the
file, pkg/virt-handler/vm.go dumpTargetFile; virt-launcher takes it,
pkg/virt-launcher/virtwrap/storage/memoryDump.go): the claim is mounted into the VM's pod, earlier
dumps in it (names containing `memory.dump`) are removed, and libvirt writes the guest's memory as an
ELF core (virDomainCoreDumpWithFormat, raw format, memory only) to `<vmi>-<claim>-<YYYYMMDD-HHMMSS>.memory.dump`
in it. The VM keeps the claim associated (status.memoryDumpRequest) until `remove`: a later `get`
without a claim name dumps into it again, and another claim is refused meanwhile.

Here the claim is a directory of the node's (--pvc, a hostPath/local PV), which root did not make and
whose owner, or a guest it was shared with, may plant anything in it. So libvirt never opens a path
in the claim: the VM's own libvirt daemon (the VM's uid for a root launcher) writes the dump into a
directory in the VM's run directory that root made and gave to that uid alone, and root then moves
the finished file into the claim through directory fds: a rename (same filesystem) or a copy into a
new file it creates there O_EXCL|O_NOFOLLOW (another filesystem), never following a name it finds.
The file ends up the claim directory owner's, mode 0600. The association is kept in the cache
(`<cache>/dumps/<domain>.json`, root's for a root launcher), not in the run directory: KubeVirt keeps
status.memoryDumpRequest on the VirtualMachine, so it outlives the VM's runs until `remove`.

`download` is `virtctl memory-dump download` (pkg/virtctl/memorydump/memorydump.go downloadMemoryDump):
virtctl exports the claim (a VirtualMachineExport of the PVC) and fetches its archive, a gzipped tar of
the claim's directory (pkg/storage/export/virt-exportserver/exportserver.go archiveHandler: `tar Scv .`
with lost+found left out); `--format raw` has it decompressed, the tar itself. Here the tar holds the
last dump, `./<fileName>`, read from the claim through its directory fd as a regular file with one
link, the same file (inode, size, change time) the dump put there; the output is written whole or not at all.
"""

from __future__ import annotations

import os
import stat
import tarfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from diskkit.errors import DiskkitError
from diskkit.streams.compression import compressor
from launcher.hostfs.dirfd import Dir, give
from launcher.node.cache import Cache
from launcher.runtime.vmuser import VmUser
from launcher.runtime.lookup import connect, match, record_of
from launcher.spec.k8s import resolve_claim
from launcher.volumes.files import free_bytes, is_block
from launcher.volumes.storage import LocalClaim, Storage, pv_path

SUFFIX = ".memory.dump"
PREVIOUS = "memory.dump"  # memoryDump.go removePreviousMemoryDump: any name containing it
STAGING = "memory-dump"  # in the run directory: the VM's uid's, where its libvirt writes the dump
FORMATS = ("gzip", "raw")  # virtctl's --format: gzip (the default) or raw (the archive decompressed)
# pkg/util/util.go CalcExpectedMemoryDumpSize: the memory request and 100 MiB; the claim must hold that
# and CDI's default filesystem overhead (pkg/storage/types GetSizeIncludingDefaultFSOverhead, 5.5 %).
DUMP_OVERHEAD = 100 * 1024 * 1024
FS_OVERHEAD = 0.055
FILE_MODE = 0o600
_COPY_CHUNK = 1 << 24


def target_file_name(vmi: str, claim: str, now: datetime) -> str:
    """virt-handler's dumpTargetFile: `<vmi>-<claim>-<20060102-150405>.memory.dump` (the VM's local time)."""
    return f"{vmi}-{claim}-{now.strftime('%Y%m%d-%H%M%S')}{SUFFIX}"


def needed_bytes(memory: int) -> int:
    """The claim size virt-api asks for a dump of `memory` bytes."""
    return int((memory + DUMP_OVERHEAD) / (1 - FS_OVERHEAD))


@dataclass
class Dumped:
    claim: str
    path: Path  # the dump in the claim
    size: int
    created_claim: bool


def _valid(kept: dict | None) -> dict | None:
    if not isinstance(kept, dict) or not isinstance(kept.get("request"), dict) or not isinstance(kept["request"].get("claimName"), str):
        return None
    return kept if all(isinstance(kept.get(k), str) for k in ("domain", "vmi", "namespace")) else None


def kept(cache: Cache, domain: str) -> dict | None:
    """What is kept of the VM's memory dump association: its domain, vmi, namespace, the claim's
    directory and the last dump's inode, size and change time, and `request`."""
    return _valid(cache.read_json(cache.memory_dump_path(domain)))


def request(cache: Cache, domain: str) -> dict | None:
    """The VM's memory dump association, as KubeVirt's VM status.memoryDumpRequest: claimName, phase,
    fileName, startTimestamp, endTimestamp, message."""
    found = kept(cache, domain)
    return None if found is None else found["request"]


def find(cache: Cache, name: str) -> dict | None:
    """The kept association of the VM `name` (as `launcher.runtime.lookup.find_record` finds a VM), running
    or not."""
    return match([k for k in map(_valid, cache.memory_dump_records()) if k is not None], name)


def associate(cache: Cache, vm: dict, claim_dir: Path | None = None, dumped: os.stat_result | None = None, **fields) -> None:
    """Keep the VM's (`vm`: its record's domain, vmi, namespace) association, `fields` its request."""
    cache.write_json(cache.memory_dump_path(vm["domain"]), {
        "domain": vm["domain"], "vmi": vm.get("vmi") or vm["domain"], "namespace": vm.get("namespace") or "default",
        "claimDir": None if claim_dir is None else str(claim_dir),
        "dump": None if dumped is None else {"dev": dumped.st_dev, "ino": dumped.st_ino, "size": dumped.st_size, "ctime": dumped.st_ctime_ns},
        "request": fields})


def _claim_place(store: Storage, namespace: str, claim: str) -> LocalClaim:
    local = store.pvcs.get(claim)
    if local is None and store.objects is not None:
        resolved = resolve_claim(store.objects, namespace, claim, f"claim {claim}")
        if resolved.volume_mode == "Block":
            raise DiskkitError(f"persistentvolumeclaim {claim}", "pvc should be filesystem pvc")
        if resolved.read_only:
            raise DiskkitError(f"persistentvolumeclaim {claim}", "pvc access mode can't be read only")
        local = pv_path(resolved)
        if local is not None and (resolved.request or resolved.capacity):
            local = LocalClaim(local.path, resolved.capacity or resolved.request)
    if local is None:
        raise DiskkitError(f"claim {claim}", f"give --pvc {claim}=DIR[:SIZE] or --manifests with a claim bound to a hostPath/local PV")
    return local


def _claim_dir(local: LocalClaim, namespace: str, claim: str, create: bool) -> bool:
    """Make the claim's directory for --create-claim (virtctl's refusal when it exists); True if made."""
    if create:
        try:
            os.mkdir(local.path, 0o700)
        except FileExistsError:
            raise DiskkitError(f"claim {claim}", f"PVC {namespace}/{claim} already exists, check if it should be created if not remove create flag") from None
        except OSError as exc:
            raise DiskkitError(f"claim {claim}", f"{local.path} cannot be made ({exc.strerror})") from None
        return True
    if is_block(local.path):
        raise DiskkitError(f"persistentvolumeclaim {claim}", "pvc should be filesystem pvc")
    if not local.path.is_dir():
        raise DiskkitError(f"claim {claim}", f"{local.path} is not a directory (--create-claim makes it)")
    return False


def _check_size(local: LocalClaim, claim: str, memory: int) -> None:
    size = local.size if local.size is not None else free_bytes(local.path)
    needed = needed_bytes(memory)
    if size < needed:
        what = "pvc size" if local.size is not None else "pvc size (the free space of its directory)"
        raise DiskkitError(f"persistentvolumeclaim {claim}", f"{what} [{size}] should be bigger then [{needed}]")


def _remove_previous(claim_dir: Dir) -> None:
    """memoryDump.go removePreviousMemoryDump: each entry naming a dump goes (a link: the link itself)."""
    for name in claim_dir.names():
        st = claim_dir.lstat(name)
        if PREVIOUS in name and st is not None and not stat.S_ISDIR(st.st_mode):
            claim_dir.unlink(name)


def _staging(run: Dir, owner: tuple[int, int] | None) -> Dir:
    """A new directory of the VM's uid in its run directory, for its libvirt to write the dump in."""
    run.remove(STAGING)
    staging = run.mkdir(STAGING, 0o700)
    give(staging.fd, owner)
    return staging


def move_into_claim(staging: Dir, claim_dir: Dir, name: str) -> os.stat_result:
    """The dump from the staging directory into the claim, as root, by fds; its stat."""
    st = staging.regular(name)
    if st is None:
        raise DiskkitError(staging.path / name, "libvirt reported a dump but wrote no file")
    planted = claim_dir.lstat(name)
    if planted is not None and stat.S_ISDIR(planted.st_mode):
        raise DiskkitError(claim_dir.path / name, "is a directory; the dump is not put in its place")
    claim_dir.unlink(name)  # whatever was planted under the name since (a link: the link itself)
    if os.fstat(staging.fd).st_dev == os.fstat(claim_dir.fd).st_dev:
        staging.rename(name, claim_dir, name)  # a rename over a link replaces the link, never its target
        fd = claim_dir.open_file(name, os.O_RDONLY)
    else:
        source = staging.open_file(name)
        fd = claim_dir.create(name, FILE_MODE)
        try:
            while os.sendfile(fd, source, None, _COPY_CHUNK):  # copy_file_range refuses to cross filesystems
                pass
            os.fsync(fd)
        except OSError as exc:
            os.close(fd)
            claim_dir.unlink(name)
            raise DiskkitError(claim_dir.path / name, f"cannot be written ({exc.strerror})") from None
        finally:
            os.close(source)
    try:
        owner = os.fstat(claim_dir.fd)
        give(fd, (owner.st_uid, owner.st_gid), FILE_MODE)
        st = os.fstat(fd)
    finally:
        os.close(fd)
    claim_dir.fsync()
    return st


def get(cache: Cache, store: Storage, name: str, claim: str | None, create: bool,
        say: Callable[[str], None] = lambda _: None) -> Dumped:
    """Dump the memory of the running VM `name` into `claim` (or the claim associated with it)."""
    record = record_of(cache, name)
    domain, vmi, namespace = record["domain"], record.get("vmi") or name, record.get("namespace") or "default"
    associated = request(cache, domain)
    vm = {"domain": domain, "vmi": vmi, "namespace": namespace}
    if create:
        if not claim:
            raise DiskkitError("--claim-name", "missing claim name")
        if associated is not None:
            raise DiskkitError(name, "please remove current memory dump association before creating a new claim for a new memory dump")
    if not claim and associated is None:
        raise DiskkitError(name, "Memory dump requires claim name to be set")
    if claim and associated is not None and associated["claimName"] != claim:
        raise DiskkitError(name, f"can't request memory dump for pvc [{claim}] while pvc [{associated['claimName']}]"
                                 " is still associated as the memory dump pvc")
    claim = claim or associated["claimName"]
    lv = connect(record)
    try:
        memory = lv.memory_bytes(domain)  # and "VMI is not running" first, as virt-api
        local = _claim_place(store, namespace, claim)
        created = _claim_dir(local, namespace, claim, create)
        if created:
            say(f"PVC {namespace}/{claim} created")
        _check_size(local, claim, memory)
        user = VmUser.from_json(record.get("vmUser"))
        file_name = target_file_name(vmi, claim, datetime.now())
        started = _now()
        associate(cache, vm, local.path, claimName=claim, phase="InProgress", fileName=file_name, startTimestamp=started)
        say(f"memory dump of VM {name} into claim {claim}: InProgress")
        with Dir.open(local.path) as claim_dir, Dir.open(cache.run_dir(domain)) as run:
            _remove_previous(claim_dir)
            staging = _staging(run, user.ids if user is not None else None)
            try:
                try:
                    lv.core_dump(domain, staging.path / file_name)
                except DiskkitError as err:
                    associate(cache, vm, local.path, claimName=claim, phase="Failed", fileName=file_name, startTimestamp=started,
                              endTimestamp=_now(), message=err.rule)
                    raise
                dumped = move_into_claim(staging, claim_dir, file_name)
            finally:
                run.discard(staging, STAGING)
        associate(cache, vm, local.path, dumped, claimName=claim, phase="Completed", fileName=file_name, startTimestamp=started,
                  endTimestamp=_now())
        return Dumped(claim, local.path / file_name, dumped.st_size, created)
    finally:
        lv.close()


def remove(cache: Cache, name: str) -> str:
    """Dissociate the VM's memory dump claim (the dumps stay in it), running or not; the claim's name."""
    associated = find(cache, name)
    if associated is None:
        record = record_of(cache, name)
        raise DiskkitError(name, f"can't remove memory dump association for vm {record.get('vmi') or name}, no association found")
    cache.memory_dump_path(associated["domain"]).unlink(missing_ok=True)
    return associated["request"]["claimName"]


@dataclass
class Downloaded:
    claim: str
    file_name: str  # the dump's, in the claim and in the archive
    output: Path
    size: int  # of the output


def download(cache: Cache, name: str, output: Path | None, fmt: str = "gzip", say: Callable[[str], None] = lambda _: None) -> Downloaded:
    """The VM's last memory dump as virtctl downloads it: a tar holding `./<fileName>`, gzipped unless
    `fmt` is raw, written to `output` whole or not at all. The VM may have stopped since."""
    if not output:
        raise DiskkitError("--output", "missing outputFile to download the memory dump")  # virtctl's words
    if fmt not in FORMATS:
        raise DiskkitError("--format", f"{fmt} is not a valid value, acceptable values are {'/'.join(FORMATS)}")
    associated = find(cache, name)
    if associated is None:
        record_of(cache, name)  # a VM never run here: not found, in find_record's words
        raise DiskkitError(name, "no memory dump is associated with this VM: `launcher memory-dump get` takes one")
    req = associated["request"]
    claim, file_name, phase = req["claimName"], req.get("fileName"), req.get("phase")
    if phase != "Completed" or not isinstance(file_name, str) or not associated.get("claimDir") or not associated.get("dump"):
        why = f": {req['message']}" if req.get("message") else ""
        raise DiskkitError(name, f"the memory dump into claim {claim} is {phase}{why}; there is nothing to download")
    say("Memory dump completed successfully")  # virtctl's words, once the request's phase is Completed
    with Dir.open(associated["claimDir"]) as claim_dir:
        fd = claim_dir.open_file(file_name)
        try:
            st, want = os.fstat(fd), associated["dump"]
            # A file made under the name since may get the same inode back; its change time it cannot.
            if (st.st_dev, st.st_ino, st.st_size, st.st_ctime_ns) != tuple(want.get(k) for k in ("dev", "ino", "size", "ctime")):
                raise DiskkitError(claim_dir.path / file_name, "is no longer the dump `memory-dump get` wrote there (replaced or changed)")
            member = tarfile.TarInfo(f"./{file_name}")
            member.size, member.mode, member.mtime, member.uid, member.gid = st.st_size, FILE_MODE, int(st.st_mtime), st.st_uid, st.st_gid

            def write(out) -> None:
                sink = _Gzipped(out) if fmt == "gzip" else out
                with os.fdopen(os.dup(fd), "rb") as dump, tarfile.open(fileobj=sink, mode="w|", format=tarfile.GNU_FORMAT) as tar:
                    tar.addfile(member, dump)
                if fmt == "gzip":
                    sink.finish()

            output = Path(output)
            with Dir.open_named(output.parent) as where:
                owner = os.fstat(where.fd)
                size = where.replace_with(output.name, write, FILE_MODE, (owner.st_uid, owner.st_gid))
        finally:
            os.close(fd)
    say("Download finished successfully")
    return Downloaded(claim, file_name, output, size)


class _Gzipped:
    """A writer that gzips what passes through it (ISA-L, as the node's layers)."""

    def __init__(self, out):
        self._out, self._z = out, compressor("gzip")

    def write(self, data) -> int:
        self._out.write(self._z.compress(data))
        return len(data)

    def finish(self) -> None:
        self._out.write(self._z.flush())


def _now() -> str:
    return datetime.fromtimestamp(time.time(), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

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
The file ends up the claim directory owner's, mode 0600. The association is kept in the run
directory (root's), so it lasts as long as the VM runs.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from diskkit.errors import DiskkitError
from launcher.hostfs.dirfd import Dir, give
from launcher.node.cache import Cache
from launcher.runtime.vmuser import VmUser
from launcher.runtime.vms import connect, record_of
from launcher.spec.k8s import resolve_claim
from launcher.volumes.files import free_bytes, is_block
from launcher.volumes.storage import LocalClaim, Storage, pv_path

SUFFIX = ".memory.dump"
PREVIOUS = "memory.dump"  # memoryDump.go removePreviousMemoryDump: any name containing it
STAGING = "memory-dump"  # in the run directory: the VM's uid's, where its libvirt writes the dump
ASSOCIATION = "memory-dump.json"  # in the run directory: status.memoryDumpRequest
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


def request(cache: Cache, domain: str) -> dict | None:
    """The VM's memory dump association, as KubeVirt's VM status.memoryDumpRequest: claimName, phase,
    fileName, startTimestamp, endTimestamp, message."""
    path = cache.run_dir(domain) / ASSOCIATION
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("claimName"), str) else None


def _associate(cache: Cache, domain: str, **fields) -> None:
    # The run directory is root's alone (launcher.runtime.rundir): its own names are safe to write.
    with Dir.open(cache.run_dir(domain)) as run:
        run.replace(ASSOCIATION, json.dumps(fields, indent=2).encode(), mode=0o600)


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


def move_into_claim(staging: Dir, claim_dir: Dir, name: str) -> int:
    """The dump from the staging directory into the claim, as root, by fds; its size."""
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
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    claim_dir.fsync()
    return size


def get(cache: Cache, store: Storage, name: str, claim: str | None, create: bool,
        say: Callable[[str], None] = lambda _: None) -> Dumped:
    """Dump the memory of the running VM `name` into `claim` (or the claim associated with it)."""
    record = record_of(cache, name)
    domain, vmi, namespace = record["domain"], record.get("vmi") or name, record.get("namespace") or "default"
    associated = request(cache, domain)
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
        _associate(cache, domain, claimName=claim, phase="InProgress", fileName=file_name, startTimestamp=started)
        say(f"memory dump of VM {name} into claim {claim}: InProgress")
        with Dir.open(local.path) as claim_dir, Dir.open(cache.run_dir(domain)) as run:
            _remove_previous(claim_dir)
            staging = _staging(run, user.ids if user is not None else None)
            try:
                try:
                    lv.core_dump(domain, staging.path / file_name)
                except DiskkitError as err:
                    _associate(cache, domain, claimName=claim, phase="Failed", fileName=file_name, startTimestamp=started,
                               endTimestamp=_now(), message=err.rule)
                    raise
                size = move_into_claim(staging, claim_dir, file_name)
            finally:
                run.discard(staging, STAGING)
        _associate(cache, domain, claimName=claim, phase="Completed", fileName=file_name, startTimestamp=started, endTimestamp=_now())
        return Dumped(claim, local.path / file_name, size, created)
    finally:
        lv.close()


def remove(cache: Cache, name: str) -> str:
    """Dissociate the VM's memory dump claim (the dumps stay in it); the claim's name."""
    record = record_of(cache, name)
    associated = request(cache, record["domain"])
    if associated is None:
        raise DiskkitError(name, f"can't remove memory dump association for vm {record.get('vmi') or name}, no association found")
    (cache.run_dir(record["domain"]) / ASSOCIATION).unlink(missing_ok=True)
    return associated["claimName"]


def _now() -> str:
    return datetime.fromtimestamp(time.time(), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

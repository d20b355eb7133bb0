"""Where a DataVolume's claim lives on this node, and the state file beside its disk.img.

The claim directory holds `disk.img` (what the VM uses, written only when complete), the state file
`datavolume.json` (the phase, progress and message `launcher dv ls` shows, replaced atomically),
the work lock (held by whoever imports or receives an upload, so a second worker waits instead of
racing) and, while work runs, scratch files with a `.diskkit-` prefix.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from diskkit.errors import DiskkitError
from launcher.hostfs.dirfd import Dir, give
from launcher.spec import datavolume as dvm
from launcher.spec.datavolume import DataVolume, Status
from launcher.spec.k8s import Objects, resolve_claim
from launcher.volumes.files import KUBEVIRT_QEMU, is_block
from launcher.volumes.storage import LocalClaim, Storage, pv_path

STATE_FILE = "datavolume.json"
LOCK_FILE = ".datavolume.lock"
STATE_LOCK_FILE = ".datavolume.state.lock"
TEMP_PREFIX = ".diskkit-"  # scratch and staged images; anything of this name is ours to remove
UPLOAD_PART = ".diskkit-upload.part"  # kept across dropped connections, so uploads resume
DEFAULT_CLASS = "storageclass.kubernetes.io/is-default-class"


@dataclass(frozen=True)
class Target:
    dv: DataVolume
    directory: Path
    size: int | None  # the claim's requested bytes: DataVolume request, else --pvc SIZE, else PV capacity
    storage_class: str | None
    wait_for_first_consumer: bool

    @property
    def disk(self) -> Path:
        return self.directory / "disk.img"

    def filled(self, status: Status) -> bool:
        """Succeeded, with its content in place: disk.img, or for an archive the files it unpacked."""
        return status.phase == dvm.SUCCEEDED and (self.dv.content_type == "archive" or self.disk_stat() is not None)

    def claim(self) -> Dir:
        """The claim directory, held open: its owner writes it, so every name in it is looked up through this."""
        return Dir.open(self.directory)

    def disk_stat(self) -> os.stat_result | None:
        """disk.img's stat when it is there (a link or device under that name is refused)."""
        with self.claim() as claim:
            return claim.regular("disk.img")

    def part_size(self) -> int:
        """The bytes an upload holds so far (a link or device under the part's name is refused)."""
        with self.claim() as claim:
            st = claim.regular(UPLOAD_PART)
        return st.st_size if st is not None else 0



def _bound_pv(objects: Objects, namespace: str, name: str) -> dict | None:
    """A PersistentVolume reserved for the claim through its claimRef (how local PVs are pre-bound)."""
    for _, pv in objects.documents("PersistentVolume"):
        ref = (pv.get("spec") or {}).get("claimRef") or {}
        if ref.get("name") == name and (ref.get("namespace") or dvm.DEFAULT_NAMESPACE) == namespace:
            return pv
    return None


def _capacity(pv: dict | None) -> int | None:
    from launcher.spec.fields import parse_quantity

    value = (((pv or {}).get("spec") or {}).get("capacity") or {}).get("storage")
    return None if value is None else int(parse_quantity(value, "capacity"))


def _location(dv: DataVolume, store: Storage, volume_name: str | None) -> tuple[LocalClaim | None, int | None, dict | None]:
    """(where the claim lives here, the PV's capacity, the claim's manifest)."""
    pvc = store.objects.get("PersistentVolumeClaim", dv.namespace, dv.name) if store.objects is not None else None
    local = store.pvcs.get(dv.name)
    if local is not None:
        return local, None, pvc
    if store.objects is not None:
        phase = ((pvc or {}).get("status") or {}).get("phase")
        if pvc is not None and phase == "Bound":
            claim = resolve_claim(store.objects, dv.namespace, dv.name, dv.origin)
            return pv_path(claim), claim.capacity, pvc
        pv = _bound_pv(store.objects, dv.namespace, dv.name)
        if pv is not None:
            from launcher.spec.k8s import Claim

            spec = pv.get("spec") or {}
            claim = Claim(dv.name, dv.namespace, spec.get("volumeMode") or "Filesystem", None, None, (), False, pv)
            return pv_path(claim), _capacity(pv), pvc
    if volume_name is not None and (store.pod_disks / volume_name).is_dir():
        return LocalClaim(store.pod_disks / volume_name), None, pvc
    return None, None, pvc


def _storage_class(dv: DataVolume, objects: Objects | None, pvc: dict | None) -> tuple[str | None, bool]:
    """The claim's storage class and whether it binds only for its first consumer."""
    if objects is None:
        return dv.storage_class, False
    name = dv.storage_class or ((pvc or {}).get("spec") or {}).get("storageClassName")
    if name is None:
        defaults = [sc for _, sc in objects.documents("StorageClass")
                    if str(((sc.get("metadata") or {}).get("annotations") or {}).get(DEFAULT_CLASS)).lower() == "true"]
        if len(defaults) == 1:  # Kubernetes picks none when several claim to be the default
            return defaults[0]["metadata"]["name"], defaults[0].get("volumeBindingMode") == "WaitForFirstConsumer"
        return None, False
    sc = objects.get("StorageClass", None, name)
    if sc is None:
        return name, False  # a class without a manifest: nothing says its claims wait
    return name, sc.get("volumeBindingMode") == "WaitForFirstConsumer"


def resolve(dv: DataVolume, store: Storage, volume_name: str | None = None) -> Target:
    """The DataVolume's claim on this node: a `--pvc` directory, a hostPath/local PV, or the pod's mount."""
    local, capacity, pvc = _location(dv, store, volume_name)
    where = f"DataVolume {dv.key}"
    if local is None:
        mount = store.pod_disks / (volume_name or dv.name)
        raise DiskkitError(where, f"claim {dv.name}: give --pvc {dv.name}=DIR[:SIZE], --manifests with a hostPath or local PV"
                                  f" bound to it, or mount it at {mount}")
    if is_block(local.path):
        raise DiskkitError(where, f"claim {dv.name} is the block device {local.path}; DataVolumes are written to filesystem claims (a directory)")
    if not local.path.is_dir():
        raise DiskkitError(where, f"claim {dv.name}: {local.path} is not a directory")
    if dv.volume_mode == "Block":
        raise DiskkitError(where, "spec volumeMode Block: DataVolumes are written to filesystem claims (a directory)")
    storage_class, wffc = _storage_class(dv, store.objects, pvc)
    return Target(dv, local.path, dv.size or local.size or capacity, storage_class, wffc)


# ---------------------------------------------------------------- state file

STATE_LIMIT = 1 << 20  # the state file is a few hundred bytes; a bigger one is not ours


def _read_state(claim: Dir) -> dict:
    try:
        data = claim.read_bytes(STATE_FILE, STATE_LIMIT)
        current = json.loads(data) if data is not None else {}
    except (OSError, ValueError, DiskkitError):
        return {}
    return current if isinstance(current, dict) else {}


def read_status(target: Target) -> Status:
    with target.claim() as claim:
        return Status.from_json(_read_state(claim))


def record(target: Target, **changes) -> Status:
    """Update the state file (read, change, replace atomically) under its own short lock, so a server
    marking UploadReady and a VM recording itself as consumer never lose each other's change."""
    with target.claim() as claim, _flock(claim, STATE_LOCK_FILE, wait=True):
        current = _read_state(claim)
        current.update({k: v for k, v in changes.items()})
        current.update({
            "apiVersion": dvm.API_VERSION, "kind": dvm.KIND, "name": target.dv.name, "namespace": target.dv.namespace,
            "source": target.dv.source.kind, "updated": time.time(),
        })
        claim.replace(STATE_FILE, json.dumps(current, indent=2, sort_keys=True).encode() + b"\n")
    return Status.from_json(current)


def current_phase(target: Target, status: Status | None = None) -> str:
    status = status if status is not None else read_status(target)
    return dvm.phase(target.dv, status, target.wait_for_first_consumer, worker_alive(target))


def describe(target: Target) -> dict:
    """`launcher dv status --json`: the DataVolume's status, as CDI's object shows it, and where it lives."""
    status = read_status(target)
    disk = target.disk if target.disk_stat() is not None else None
    uploaded = target.part_size()
    return {
        "name": target.dv.name, "namespace": target.dv.namespace, "source": target.dv.source.kind,
        "phase": current_phase(target, status), "progress": status.progress or "N/A", "message": status.message,
        "consumer": status.consumer, "claim": str(target.directory), "storageClass": target.storage_class,
        "size": target.size, "disk": str(disk) if disk else None, "origin": target.dv.origin,
        **({"uploaded": uploaded} if uploaded else {}),
    }


# ---------------------------------------------------------------- locks

@contextlib.contextmanager
def _flock(claim: Dir, name: str, wait: bool, timeout: float | None = None) -> Iterator[bool]:
    # A lock file planted as a link (to a root file) is refused, not opened, and never chowned.
    fd = claim.open_file(name, os.O_RDWR, create=0o644)
    try:
        if os.fstat(fd).st_uid == os.geteuid():
            with contextlib.suppress(OSError):
                give(fd, KUBEVIRT_QEMU)  # a worker running as root must not lock the qemu user out
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait and deadline is None else fcntl.LOCK_NB))
                break
            except BlockingIOError:
                if not wait or (deadline is not None and time.monotonic() >= deadline):
                    yield False
                    return
                time.sleep(0.05)
        yield True
    finally:
        os.close(fd)


@contextlib.contextmanager
def work_lock(target: Target, wait: bool = False, timeout: float | None = None) -> Iterator[bool]:
    """Held while importing, cloning or receiving an upload. Yields False when another worker has it."""
    with target.claim() as claim, _flock(claim, LOCK_FILE, wait, timeout) as got:
        yield got


def worker_alive(target: Target) -> bool:
    with target.claim() as claim:
        if claim.lstat(LOCK_FILE) is None:
            return False
        with _flock(claim, LOCK_FILE, wait=False) as got:
            return not got


def remove_scratch(target: Target, keep_upload: bool = True) -> None:
    """What a killed worker left behind (call with the work lock held); links are removed, never followed."""
    with target.claim() as claim:
        for name in claim.names():
            if name.startswith(TEMP_PREFIX) and not (keep_upload and name == UPLOAD_PART):
                claim.remove(name)

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
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from diskkit.errors import DiskkitError
from diskkit.streams.fsutil import write_atomic
from launcher.spec import datavolume as dvm
from launcher.spec.datavolume import DataVolume, Status
from launcher.spec.k8s import Objects, resolve_claim
from launcher.volumes.files import give_to_qemu, is_block
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
        return status.phase == dvm.SUCCEEDED and (self.dv.content_type == "archive" or self.disk.exists())

    @property
    def state_path(self) -> Path:
        return self.directory / STATE_FILE

    @property
    def upload_part(self) -> Path:
        return self.directory / UPLOAD_PART



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

def read_status(target: Target) -> Status:
    try:
        return Status.from_json(json.loads(target.state_path.read_bytes()))
    except (OSError, ValueError):
        return Status()


def record(target: Target, **changes) -> Status:
    """Update the state file (read, change, replace atomically) under its own short lock, so a server
    marking UploadReady and a VM recording itself as consumer never lose each other's change."""
    with _flock(target.directory / STATE_LOCK_FILE, wait=True):
        try:
            current = json.loads(target.state_path.read_bytes())
        except (OSError, ValueError):
            current = {}
        current.update({k: v for k, v in changes.items()})
        current.update({
            "apiVersion": dvm.API_VERSION, "kind": dvm.KIND, "name": target.dv.name, "namespace": target.dv.namespace,
            "source": target.dv.source.kind, "updated": time.time(),
        })
        write_atomic(target.state_path, json.dumps(current, indent=2, sort_keys=True).encode() + b"\n")
    return Status.from_json(current)


def current_phase(target: Target, status: Status | None = None) -> str:
    status = status if status is not None else read_status(target)
    return dvm.phase(target.dv, status, target.wait_for_first_consumer, worker_alive(target))


def describe(target: Target) -> dict:
    """`launcher dv status --json`: the DataVolume's status, as CDI's object shows it, and where it lives."""
    status = read_status(target)
    disk = target.disk
    return {
        "name": target.dv.name, "namespace": target.dv.namespace, "source": target.dv.source.kind,
        "phase": current_phase(target, status), "progress": status.progress or "N/A", "message": status.message,
        "consumer": status.consumer, "claim": str(target.directory), "storageClass": target.storage_class,
        "size": target.size, "disk": str(disk) if disk.exists() else None, "origin": target.dv.origin,
        **({"uploaded": target.upload_part.stat().st_size} if target.upload_part.exists() else {}),
    }


# ---------------------------------------------------------------- locks

@contextlib.contextmanager
def _flock(path: Path, wait: bool, timeout: float | None = None) -> Iterator[bool]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        with contextlib.suppress(OSError):
            give_to_qemu(path)  # a worker running as root must not lock the qemu user out
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


def work_lock(target: Target, wait: bool = False, timeout: float | None = None):
    """Held while importing, cloning or receiving an upload. Yields False when another worker has it."""
    return _flock(target.directory / LOCK_FILE, wait, timeout)


def worker_alive(target: Target) -> bool:
    path = target.directory / LOCK_FILE
    if not path.exists():
        return False
    with _flock(path, wait=False) as got:
        return not got


def remove_scratch(target: Target, keep_upload: bool = True) -> None:
    """What a killed worker left behind (call with the work lock held)."""
    for path in target.directory.glob(f"{TEMP_PREFIX}*"):
        if keep_upload and path.name == UPLOAD_PART:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                path.unlink()

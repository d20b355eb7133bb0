"""The DataVolume controller of the launcher: which DataVolumes a VM needs, importing them (its own
templates and the standalone DataVolumes it uses, as CDI's controller would), and holding the VM back
until every one of them has Succeeded (as KubeVirt does).

A VM is its DataVolumes' first consumer: under a WaitForFirstConsumer storage class starting it is
what binds their claims, so the imports (or the upload) can begin.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from diskkit.errors import DiskkitError
from diskkit.registry.options import RegistryOptions
from launcher.datavolumes import dvstate, importer
from launcher.datavolumes.dvstate import Target
from launcher.spec import datavolume as dvm
from launcher.spec.datavolume import DataVolume
from launcher.spec.vmi import VMI
from launcher.volumes.storage import Storage

POLL = 0.5  # seconds between two looks at the state files of the DataVolumes waited for
Say = Callable[[str], None]


@dataclass(frozen=True)
class Needed:
    dv: DataVolume
    volume: str | None  # the VM volume using it (its mount path in a pod)


def manifests(store: Storage) -> dict[tuple[str, str], DataVolume]:
    """DataVolume manifests among `--manifests`, by (namespace, name)."""
    if store.objects is None:
        return {}
    found = {}
    for origin, doc in store.objects.documents(dvm.KIND):
        dv = dvm.from_manifest(doc, origin)
        found[(dv.namespace, dv.name)] = dv
    return found


def find(store: Storage, name: str, namespace: str, extra: tuple[DataVolume, ...] = ()) -> DataVolume:
    """A DataVolume by name, from `extra` (a VM's templates) or the manifests."""
    for dv in extra:
        if dv.name == name and dv.namespace == namespace:
            return dv
    dv = manifests(store).get((namespace, name))
    if dv is None:
        where = "--manifests" if store.objects is not None else "no --manifests given"
        raise DiskkitError(f"DataVolume {namespace}/{name}", f"not found ({where})")
    return dv


def needed(vmi: VMI, store: Storage) -> list[Needed]:
    """The DataVolumes behind the VM's dataVolume volumes. A volume naming no known DataVolume is used
    as a plain claim of that name (the claim may have been filled some other way)."""
    own = {dv.name: dv for dv in vmi.data_volume_templates}
    known = manifests(store)
    out = []
    for volume in vmi.volumes:
        if volume.kind != "dataVolume":
            continue
        name = volume.source.name
        dv = own.get(name) or known.get((vmi.namespace, name))
        if dv is not None:
            out.append(Needed(dv, volume.name))
    return out


def fill_now(target: Target, store: Storage, registry: RegistryOptions | None, say: Say) -> bool:
    """Import (clone, create) the DataVolume unless another worker is at it; False when one is."""
    with dvstate.work_lock(target) as got:
        if not got:
            return False
        if target.filled(dvstate.read_status(target)):
            return True
        source = target.dv.source
        what = dvm.shown_url(source.url) if source.url else (f"claim {source.claim_namespace}/{source.claim}" if source.kind == "pvc" else source.kind)
        say(f"DataVolume {target.dv.key}: {source.kind} import from {what} into {target.directory}")
        for note in importer.fill(target, store, registry, say):
            say(f"note: {note}")
        say(f"DataVolume {target.dv.key}: Succeeded")
    return True


def _hint(item: Needed, phase: str) -> str:
    if item.dv.source.kind == "upload" and phase in (dvm.UPLOAD_SCHEDULED, dvm.UPLOAD_READY):
        return f"; upload it with: diskkit upload {item.dv.key} FILE"
    return ""


def ensure_ready(vmi: VMI, store: Storage, registry: RegistryOptions | None, timeout: float | None, say: Say) -> list[Target]:
    """Return once every DataVolume the VM uses has Succeeded; raise when one failed or at `timeout`."""
    items = needed(vmi, store)
    targets = [(item, dvstate.resolve(item.dv, store, item.volume)) for item in items]
    for item, target in targets:
        status = dvstate.read_status(target)
        changes = {}
        if target.wait_for_first_consumer and not status.consumer and status.phase != dvm.SUCCEEDED:
            say(f"DataVolume {item.dv.key}: {vmi.domain_name} is the first consumer of claim {item.dv.name}"
                f" (storage class {target.storage_class} binds on first use)")
            changes["consumer"] = vmi.domain_name
        if status.phase in (None, dvm.PENDING):
            changes["phase"] = item.dv.scheduled_phase  # its claim is bound: the import (or upload) can start
        if changes:
            dvstate.record(target, **changes)
    deadline = None if timeout is None else time.monotonic() + timeout
    shown: dict[str, str] = {}
    while True:
        waiting = []
        for item, target in targets:
            status = dvstate.read_status(target)
            phase = dvstate.current_phase(target, status)
            if target.filled(status):
                continue
            # As CDI's controller, the run starts every import its VM waits for, the VM's own templates
            # and standalone DataVolumes alike, unless another worker already has it.
            if item.dv.source.kind != "upload" and not dvstate.worker_alive(target):
                if fill_now(target, store, registry, say):
                    continue  # done now (a failure raised)
            elif phase == dvm.FAILED:
                raise DiskkitError(f"DataVolume {item.dv.key}", f"Failed: {status.message or 'no message'}; the VM was not started")
            waiting.append((item, phase))
        if not waiting:
            return [target for _, target in targets]
        for item, phase in waiting:
            if shown.get(item.dv.key) != phase:  # once per phase, not once per look
                shown[item.dv.key] = phase
                say(f"waiting for DataVolume {item.dv.key} ({phase}{_hint(item, phase)})")
        if deadline is not None and time.monotonic() >= deadline:
            item, phase = waiting[0]
            raise DiskkitError(f"DataVolume {item.dv.key}", f"still {phase} after {timeout:g} s; the VM was not started")
        time.sleep(POLL)

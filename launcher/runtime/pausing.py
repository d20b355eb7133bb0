"""Pause and unpause a VM started by `launcher run` (virtctl pause vmi / unpause vmi), from any process."""

from __future__ import annotations

import time
from dataclasses import dataclass

from diskkit.errors import DiskkitError
from launcher.node.cache import Cache
from launcher.runtime.conditions import PAUSED_BY_USER, Paused, pause_refusal, paused_condition, unpause_refusal
from launcher.runtime.iopause import describe
from launcher.runtime.runner import Libvirt
from launcher.runtime.lookup import connect, record_of

# After unpausing a VM an I/O error paused, this long to see whether qemu's retry of the failed
# request paused it again (the disk still full, say): qemu retries at once on resume.
PAUSED_AGAIN_WITHIN = 3.0


@dataclass
class Unpaused:
    domain: str
    was: Paused
    paused_again: str | None  # iopause.describe's line when the retried request paused it again


def _vm(cache: Cache, name: str) -> tuple[dict, Libvirt]:
    record = record_of(cache, name)
    return record, connect(record)


def _condition(lv: Libvirt, domain: str) -> Paused | None:
    errors = lv.disk_errors(domain)
    return paused_condition(lv.paused_by(domain), None if errors is None else describe(errors))


def pause(cache: Cache, name: str) -> str:
    """Suspend the VM's domain; its domain name. Refused in KubeVirt's words when not running or paused already."""
    record, lv = _vm(cache, name)
    try:
        domain = record["domain"]
        refusal = pause_refusal(lv.active(domain), _condition(lv, domain), record.get("livenessProbe"))
        if refusal:
            raise DiskkitError(name, refusal)
        if lv.paused_by(domain) is None:  # paused for another reason (starting up, say): virt-launcher leaves it
            lv.suspend(domain)
        return domain
    finally:
        lv.close()


def unpause(cache: Cache, name: str, paused_again_within: float = PAUSED_AGAIN_WITHIN) -> Unpaused:
    """Resume the VM's domain, whoever paused it; refused in KubeVirt's words when it is not paused."""
    record, lv = _vm(cache, name)
    try:
        domain = record["domain"]
        was = _condition(lv, domain)
        refusal = unpause_refusal(lv.active(domain), was)
        if refusal:
            raise DiskkitError(name, refusal)
        lv.unsuspend(domain)
        again = None
        if was.reason != PAUSED_BY_USER:
            deadline = time.monotonic() + paused_again_within
            while again is None and time.monotonic() < deadline:
                errors = lv.disk_errors(domain)
                again = None if errors is None else describe(errors)
                time.sleep(0.1)
        return Unpaused(domain, was, again)
    finally:
        lv.close()

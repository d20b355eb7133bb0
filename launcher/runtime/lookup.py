"""The VMs started from a cache, found by name, connected to and asked how they are: what `status`,
`ls`, `stop`, `gc` and virtctl's verbs (console, vnc, pause, ssh, port-forward) need, without what
starting a VM needs (launcher.runtime.vms), which a probe run every few seconds should not import."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from diskkit.errors import DiskkitError, NotFound
from launcher.node.cache import Cache
from launcher.runtime import guestagent, sessiond, vmuser
from launcher.runtime.conditions import Paused, paused_condition
from launcher.runtime.iopause import describe
from launcher.runtime.runner import Libvirt
from launcher.runtime.vmuser import VmUser


def connect(record: dict) -> Libvirt:
    """libvirt at a record's URI; a VM's own session daemon is started again if it has exited while
    its VM may still run (killed: it finds the domain still running and its qemu process). A VM whose
    uid was given back is gone: its socket may be another VM's by now, never connected to."""
    user = VmUser.from_json(record.get("vmUser"))
    if gone_for_good(record):
        raise DiskkitError(record["domain"], "VM is not running (its own uid was given back)")
    sessiond.ensure(record["uri"], user)
    return Libvirt(record["uri"]) if user is None else own_libvirt(record["uri"], user)


@contextlib.contextmanager
def reachable(record: dict) -> Iterator[Libvirt | None]:
    """connect(record), or None when its daemon cannot be reached (the domain is gone with it, and only
    its files are left to remove); closed when the block ends, not when the garbage collector runs."""
    try:
        lv = connect(record)
    except DiskkitError:
        lv = None
    try:
        yield lv
    finally:
        if lv is not None:
            lv.close()


def gone_for_good(record: dict) -> bool:
    """The VM ran under a uid of its own that was given back: it is gone, whatever its socket answers now."""
    user = VmUser.from_json(record.get("vmUser"))
    return user is not None and not vmuser.holds(user)


def own_libvirt(uri: str, user: VmUser) -> Libvirt:
    """A connection to a VM's own daemon, which is started again if it is killed under the VM, and
    whose VM is gone for good once its uid is given back (stopped, and maybe given to another VM)."""
    return Libvirt(uri, restart=lambda: sessiond.ensure(uri, user), gone=lambda: not vmuser.holds(user))


def record_of(cache: Cache, name: str) -> dict:
    """find_record, or NotFound naming the VM asked for."""
    record = find_record(cache, name)
    if record is None:
        raise NotFound(name, "no VM of this name was started from this cache (yet)")
    return record


def find_record(cache: Cache, name: str) -> dict | None:
    """A VM by domain name (NAMESPACE_NAME), NAMESPACE/NAME, or VMI name in any namespace if unique."""
    return match(cache.vm_records(), name)


def match(records: list[dict], name: str) -> dict | None:
    """The one of `records` (each with "domain", "vmi" and "namespace") that `name` names, as find_record
    finds a VM."""
    wanted = name.replace("/", "_", 1)
    namespace, _, plain = name.rpartition("/")
    # A name too long for libvirt has a shortened domain name: NAMESPACE/NAME still finds it.
    exact = [r for r in records if r["domain"] in (wanted, f"default_{name}")
             or (namespace and (r.get("namespace"), r.get("vmi")) == (namespace, plain))]
    if exact:
        return exact[0]
    by_name = [r for r in records if r["vmi"] == name]
    if len(by_name) > 1:
        raise DiskkitError(name, f"several VMs have this name ({', '.join(r['domain'] for r in by_name)}); give NAMESPACE/NAME")
    return by_name[0] if by_name else None


def state(record: dict, cache: Cache | None = None) -> str:
    """running, paused (by the user, or by an I/O error of a disk: error_policy stop), stopped (defined,
    not running), gone (no such domain) or unknown (libvirt unreachable)."""
    return state_and_why(record, cache)[0]


def state_and_why(record: dict, cache: Cache | None = None) -> tuple[str, Paused | None]:
    """The state, and for a paused VM KubeVirt's Paused condition: who paused it, and for an I/O
    error which disks and why (iopause.describe)."""
    if gone_for_good(record):
        return "gone", None
    try:
        lv = Libvirt(record["uri"]) if cache is None else connect(record)
    except DiskkitError:
        return "unknown", None
    try:
        domain = record["domain"]
        paused_by = lv.paused_by(domain)
        if paused_by is not None:
            errors = lv.disk_errors(domain)
            # A pause for a reason KubeVirt gives no condition (libvirt starting it, say) is no pause to report.
            condition = paused_condition(paused_by, None if errors is None else describe(errors))
            if condition is not None:
                return "paused", condition
        if lv.active(domain):
            return "running", None
        return ("stopped" if lv.exists(domain) else "gone"), None
    finally:
        lv.close()


def conditions(record: dict, cache: Cache, paused: Paused | None) -> list[dict]:
    """The VMI's conditions as virt-handler sets them for a running VM: Paused, AgentConnected,
    UnsupportedAgent, AccessCredentialsSynchronized (type, status, reason, message)."""
    from launcher.runtime import credsync  # here: its helper's volume writers are no business of a lookup's

    found = []
    if paused is not None:
        found.append({"type": "Paused", "status": "True", "reason": paused.reason, "message": paused.message})
    try:
        lv = connect(record)
    except DiskkitError:
        return found
    try:
        found += guestagent.conditions(lv, record["domain"], bool(record.get("accessCredentials")))
    finally:
        lv.close()
    synced = credsync.condition(Path(record["run_dir"]))
    if synced is not None:
        found.append(synced)
    return found

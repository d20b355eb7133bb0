"""spec.accessCredentials with propagationMethod qemuGuestAgent: each Secret's ssh keys written into the
guest through its agent, and kept in step with the Secret, as virt-launcher's access credential
manager does (pkg/virt-launcher/virtwrap/access-credentials/access_credentials.go):

- at once, then whenever a Secret changed (looked at every 15 s) and every 5 minutes anyway, each
  user's authorized_keys becomes the keys of every Secret naming the user (virDomainAuthorizedSSHKeysSet:
  the agent's guest-ssh-add-authorized-keys, resetting the file);
- while the agent is offline ("Guest agent is offline") or a write fails, it is tried again at the
  next look;
- each outcome is the VMI's AccessCredentialsSynchronized condition (True, or False with the
  message), kept in the run directory for `launcher status`.

virt-launcher watches the Secret where its pod mounts it; a helper process of the launcher does the
same here (`launcher sync-credentials`, started by `launcher run` before the domain, named in the
VM's record, ended with the VM), reading the Secret again from where the run read it: the
--manifests directory, the Kubernetes API, or the pod's mount (<secret>-access-cred).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from diskkit.errors import DiskkitError
from diskkit.streams.fsutil import write_atomic
from launcher.node.cache import Cache
from launcher.node.selfexec import launcher_argv
from launcher.runtime.agentinfo import ACCESS_CREDENTIALS_SYNCHRONIZED
from launcher.runtime.guestagent import ping
from launcher.runtime.runner import Libvirt
from launcher.spec import credentials
from launcher.spec.k8s import Objects
from launcher.volumes.gendisks import access_credential_mount, object_files
from launcher.volumes.storage import POD_CONFIG

CHECK_INTERVAL = 15.0  # access_credentials.go resyncCheckIntervalSeconds
RESYNC_INTERVAL = 300.0  # its forced resync, resyncInterval
STATE_FILE = "access-credentials.json"
LOG_FILE = "access-credentials.log"
COMMAND = "sync-credentials"
OFFLINE = "Guest agent is offline"
STOP_TIMEOUT = 5.0

SecretReader = Callable[[str], Mapping[str, bytes]]


@dataclass(frozen=True)
class Outcome:
    succeeded: bool
    message: str = ""


def record_entries(vmi_credentials) -> list[dict]:
    """The qemuGuestAgent credentials as the VM's record keeps them for the helper: secret and users."""
    return [{"secret": c.secret_name, "users": list(c.users)} for c in vmi_credentials
            if c.method == credentials.QEMU_GUEST_AGENT and c.secret_name]


def _as_credentials(entries: list[dict]) -> list[credentials.SSHPublicKey]:
    return [credentials.SSHPublicKey(e["secret"], credentials.QEMU_GUEST_AGENT, tuple(e["users"])) for e in entries]


def sync_once(lv: Libvirt, domain: str, entries: list[dict], secrets: Mapping[str, Mapping[str, bytes]],
              ping: Callable[[], bool]) -> Outcome:
    """reloadCredentialFiles: ping the agent, then set every user's keys; the first failure is the outcome."""
    if not ping():
        return Outcome(False, OFFLINE)
    for user, keys in credentials.agent_keys(_as_credentials(entries), secrets).items():
        try:
            lv.set_authorized_keys(domain, user, keys)
        except DiskkitError as err:
            return Outcome(False, f"Error encountered writing ssh pub key access credentials for user [{user}]: {err.rule}")
    return Outcome(True)


def write_state(run_dir: Path, outcome: Outcome) -> None:
    write_atomic(run_dir / STATE_FILE, json.dumps({"succeeded": outcome.succeeded, "message": outcome.message}).encode(), 0o600)


def condition(run_dir: Path) -> dict | None:
    """The AccessCredentialsSynchronized condition (virt-handler's updateAccessCredentialConditions),
    once the helper has reported."""
    try:
        state = json.loads((run_dir / STATE_FILE).read_bytes()[:4096])
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict):
        return None
    found = {"type": ACCESS_CREDENTIALS_SYNCHRONIZED, "status": "True" if state.get("succeeded") is True else "False"}
    if isinstance(state.get("message"), str) and state["message"]:
        found["message"] = state["message"]
    return found


def keep_in_step(lv: Libvirt, domain: str, entries: list[dict], read: SecretReader, run_dir: Path,
                 still_wanted: Callable[[], bool], ping: Callable[[], bool], sleep: Callable[[float], None] = time.sleep) -> None:
    """watchSecrets: sync at once, again when a Secret changed or the last try failed (looked at every
    CHECK_INTERVAL) and every RESYNC_INTERVAL; until `still_wanted` says the VM is gone."""
    applied: dict | None = None
    retry, last_sync = True, 0.0
    while still_wanted():
        try:
            current = {e["secret"]: dict(read(e["secret"])) for e in entries}
            changed = current != applied
        except DiskkitError as err:
            write_state(run_dir, Outcome(False, err.rule))
            current, changed, retry = None, False, True
        if current is not None and (changed or retry or time.monotonic() - last_sync >= RESYNC_INTERVAL):
            outcome = sync_once(lv, domain, entries, current, ping)
            write_state(run_dir, outcome)
            applied, retry, last_sync = current, not outcome.succeeded, time.monotonic()
        sleep(CHECK_INTERVAL)


def secret_reader(namespace: str, manifests: Path | None, kube_api: bool, pod_config: Path = POD_CONFIG) -> SecretReader:
    """A Secret's data, read afresh each time from where the run read it."""
    def read(name: str) -> Mapping[str, bytes]:
        objects = Objects.load(manifests) if manifests else None
        if kube_api:
            from launcher.spec.kubeapi import ClusterObjects

            objects = ClusterObjects()  # a new one: it remembers what it read
        return object_files(objects, namespace, "secret", name, access_credential_mount(pod_config, name), False,
                            f"spec.accessCredentials secret {name}")
    return read


def serve(lv: Libvirt, cache: Cache, domain: str, manifests: Path | None, kube_api: bool) -> None:
    """The helper's work for the VM `launcher run` recorded under `domain`, until it is gone."""
    record_path = cache.vm_record_path(domain)
    record = cache.read_json(record_path)
    if not record or not record.get("accessCredentials"):
        raise DiskkitError(domain, "no VM with qemuGuestAgent access credentials was started from this cache under this name")
    seen = False

    def still_wanted() -> bool:
        nonlocal seen
        active = lv.active(domain)
        seen = seen or active
        return record_path.exists() and (active or not seen)

    keep_in_step(lv, domain, record["accessCredentials"], secret_reader(record["namespace"], manifests, kube_api),
                 Path(record["run_dir"]), still_wanted, lambda: ping(lv, domain))


def secret_flags(manifests: Path | None, kube_api: bool) -> list[str]:
    """The helper's flags for where Secrets come from (the run's --manifests or --kube-api)."""
    return ["--manifests", str(manifests)] if manifests else ["--kube-api"] if kube_api else []


def start(cache: Cache, domain: str, run_dir: Path, flags: list[str]) -> dict:
    """The helper, detached (its own session: it outlives a --detach run), logging in the run
    directory; its entry for the VM's record."""
    command = [*launcher_argv(), COMMAND, "--cache-dir", str(cache.root), *flags, domain]
    with open(run_dir / LOG_FILE, "ab") as log:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    return {"pid": proc.pid, "domain": domain}


def _is_ours(entry: dict) -> bool:
    """The pid is still the helper we started for this domain (pids are reused)."""
    try:
        argv = Path(f"/proc/{entry['pid']}/cmdline").read_bytes().split(b"\0")
    except (OSError, KeyError, TypeError):
        return False
    return COMMAND.encode() in argv and str(entry.get("domain")).encode() in argv


def stop(entry: dict | None) -> None:
    """End the helper (TERM, then KILL) if it still runs."""
    if not entry or not _is_ours(entry):
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.kill(entry["pid"], sig)
        deadline = time.monotonic() + STOP_TIMEOUT
        while _is_ours(entry) and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(entry["pid"], os.WNOHANG)  # ours to reap when this process started it
            time.sleep(0.05)
        if not _is_ours(entry):
            return

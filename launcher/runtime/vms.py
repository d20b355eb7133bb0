"""Run, stop and list VMs: the imperative shell around the pure VMI -> domain converter.

Each VM started from a cache leaves a record (`vms/<domain>.json`) naming the libvirt URI, its run
directory (overlays, console log, domain XML) and the cache entries it uses, so `stop`, `ls` and
`gc` work from any later process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

from diskkit.errors import DiskkitError, GuestFailed, TimedOut
from diskkit.oci.image import Platform
from diskkit.registry.options import RegistryOptions
from diskkit.streams.fsutil import write_atomic
from launcher.diskserver.client import last_failure
from launcher.diskserver.qemuid import is_system_uri
from launcher.node import pins
from launcher.node.cache import Cache
from launcher.render.domain import Host, render, secret_xml
from launcher.render.interfaces import netdev_id
from launcher.runtime import accel, credsync, guestagent, hostcpus, rundir, sessiond, virtiofs
from launcher.runtime.conditions import Paused, paused_condition
from launcher.runtime.console import ConsoleLog, follow
from launcher.runtime.iopause import PauseWatch, describe
from launcher.runtime.portforward import Forward, Forwarder
from launcher.runtime.runner import Libvirt, default_uri
from launcher.spec.vmi import VMI
from launcher.volumes import vhostmd
from launcher.volumes.files import KUBEVIRT_QEMU, qemu_owner
from launcher.volumes.prepare import admit, prepare
from launcher.volumes.storage import Storage


@dataclass
class RunOptions:
    uri: str | None = None
    platform: Platform | None = None
    registry: RegistryOptions | None = None
    console: bool = False
    wait_for: str | None = None
    timeout: float | None = None
    storage: Storage | None = None
    lazy: str = "auto"  # containerDisks through the node's disk server: "on", "off", or "auto" for images marked lazy
    # After SIGTERM the guest has this long to power off before the domain is destroyed; None: the VMI's
    # terminationGracePeriodSeconds (see grace_period_of).
    grace_period: float | None = None
    # Return once the domain has started; the VM keeps running, as after --wait-for, and `launcher
    # console/logs/stop` reach it (virtctl start's habit: the command does not hold the VM).
    detach: bool = False
    # Where the interfaces' declared ports are published (KubeVirt's masquerade forwards them from the
    # pod's IP); None: nowhere, `launcher port-forward` reaches any port.
    publish_address: str | None = None
    # A VirtualMachine's containerDisk tags are resolved again instead of booting the digests its
    # earlier runs pinned (launcher.node.pins).
    update: bool = False
    # Where the pod mounts each containerDisk's image (KubeVirt's /var/run/kubevirt-image-volume):
    # the disks are used from there, nothing is pulled (launcher.volumes.imagevolume).
    container_disk_dir: Path | None = None
    kernel_boot_dir: Path | None = None  # likewise the kernelBoot container's (/var/run/kubevirt-kernel-boot)


# KubeVirt's default VMI terminationGracePeriodSeconds (staging/src/kubevirt.io/api/core/v1/types.go,
# DefaultGracePeriodSeconds); its launcher pod gets 15 s more (pkg/virt-controller/services/template.go).
DEFAULT_GRACE_PERIOD = 30
# virt-handler presses the power button again every 5 s of the grace period: "a booting OS can miss
# ACPI signals" (shutdownVMI in pkg/virt-handler/vm.go).
PRESS_AGAIN = 5


def grace_period_of(vmi: VMI, opts: RunOptions) -> float:
    """The option, else the VMI's own, else KubeVirt's default (gracePeriodInSeconds in
    pkg/virt-controller/services/template.go)."""
    if opts.grace_period is not None:
        return opts.grace_period
    return DEFAULT_GRACE_PERIOD if vmi.grace_period is None else vmi.grace_period


def _default_uri(cache: Cache, say: Callable[[str], None]) -> str:
    """libvirt's default for this user, except as root where no system daemon answers: then the VM
    runs as the launcher pod runs it, through the qemu user's session daemon of this cache."""
    if os.geteuid() != 0 or sessiond.system_daemon_answers():
        return default_uri()
    uri = sessiond.ensure(cache)
    say(f"no libvirt system daemon answers here ({sessiond.SYSTEM_SOCKETS[-1]}); running the VM as the qemu user"
        f" through its own session daemon, as the launcher pod does ({uri}; --connect chooses another)")
    return uri


def connect(cache: Cache, uri: str) -> Libvirt:
    """libvirt at a record's URI; the cache's own session daemon is started again if it has exited
    (idle, or killed: it finds the domains still running and their qemu processes)."""
    if sessiond.is_ours(cache, uri):
        sessiond.ensure(cache)
    return Libvirt(uri)


def plan(vmi: VMI, cache: Cache, opts: RunOptions, create: bool, domain_type: str | None = None, qemu: tuple[int, int] = KUBEVIRT_QEMU,
         dac: bool = False, qemu_uid: int | None = None, system_daemon: bool = False):
    """Pull what the VMI needs and render its domain; with `create`, the overlays are made too (and what
    qemu opens in claims is given to `qemu`). `system_daemon`: libvirt's system daemon runs it."""
    run_dir = cache.run_dir(vmi.domain_name)
    prepared = prepare(vmi, cache, run_dir, opts.registry, opts.platform, create=create, store=opts.storage, lazy=opts.lazy,
                       qemu=qemu, qemu_uid=qemu_uid, pins=pins.load(cache, vmi.domain_name) if vmi.from_vm else None,
                       update=opts.update, image_volumes=opts.container_disk_dir, kernel_boot_dir=opts.kernel_boot_dir)
    host = Host(
        domain_type=domain_type or accel.domain_type(cache.root),
        serial_log=str(rundir.console_log(run_dir)),
        kernel=prepared.kernel,
        initrd=prepared.initrd,
        virtiofs_sockets=virtiofs.sockets(vmi, run_dir),
        dac=dac,
        # A system daemon labels a socket it is given as root, by path, in a directory qemu's user
        # writes (and an unprivileged launcher's is no place qemu's user may write): there the
        # sockets are libvirt's own, in its directories.
        vnc_socket=None if system_daemon else rundir.qemu_socket(run_dir, rundir.VNC_SOCKET),
        agent_socket=None if system_daemon else rundir.qemu_socket(run_dir, rundir.AGENT_SOCKET),
    )
    if vmi.domain.cpu.dedicated_cpu_placement:
        host = replace(host, topology=hostcpus.read_topology(), cpuset=hostcpus.pod_cpuset())
    return prepared, render(vmi, prepared.disks, host)


def run(vmi: VMI, cache: Cache, opts: RunOptions, say: Callable[[str], None]) -> int:
    """Start the VM and stay with it: until --wait-for text, the guest's own stop, a timeout or a signal."""
    name = vmi.domain_name
    began = time.monotonic()  # --timeout counts from here: pulls, the disk server and libvirt's start included
    lv = Libvirt(opts.uri or _default_uri(cache, say))
    # As root, qemu must reach the run directory: it runs as the qemu user of the session daemon
    # connected to (107) or as qemu.conf's user under the system daemon, which chowns the disks it
    # opens but not the directories they are in (see rundir: it traverses root's, never writes them).
    owner = qemu_owner(lv.uri)
    with cache.lock(f"vm-{name}"):
        if lv.shut_off_with_uuid(name, vmi.uuid):
            cleanup(cache, lv, name)  # this VMI's own, left by a killed launcher: nothing runs in it
        if lv.exists(name):
            raise DiskkitError(name, f"a domain of this name already exists on {lv.uri}; stop it first (launcher stop {vmi.name})")
        _remove_run_dir(cache, name)  # leftovers of a launcher that was killed
        # The console log lives here even with no overlay. Root's alone until prepared (rundir).
        rundir.create(cache.run_dir(name))
        daemons: list[dict] = []
        alarm = _Alarm()
        try:
            virtiofs.check_runnable(vmi)
            admit(vmi, opts.storage or Storage())
            from launcher.datavolumes.control import ensure_ready

            ensure_ready(vmi, opts.storage or Storage(), opts.registry, opts.timeout, say)  # KubeVirt waits for them too
            if opts.timeout is not None:
                alarm.arm(opts.timeout - (time.monotonic() - began))
            with cache.lock("gc", shared=True):  # gc must not take the bases between pull and record
                # qemu on a session daemon runs as its user, which a root disk server's group socket does not admit.
                session_uid = owner[0] if os.geteuid() == 0 and not is_system_uri(lv.uri) else None
                # Nor may it open a /dev/kvm root can: then the domain is TCG's.
                tcg = session_uid is not None and not sessiond.kvm_for(lv.uri, cache)
                prepared, xml = plan(vmi, cache, opts, create=True, domain_type="qemu" if tcg else None, qemu=owner,
                                     dac=os.geteuid() == 0 and is_system_uri(lv.uri), qemu_uid=session_uid,
                                     system_daemon=is_system_uri(lv.uri))
                run_dir = cache.run_dir(name)
                rundir.open_to_qemu(run_dir, owner)
                write_atomic(run_dir / "domain.xml", xml.encode(), 0o600)  # root's: libvirt is given the XML, not the file
                daemons = virtiofs.start(vmi, prepared.shares, run_dir, owner)
                record = {
                    "domain": name,
                    "vmi": vmi.name,
                    "namespace": vmi.namespace,
                    "uri": lv.uri,
                    "run_dir": str(run_dir),
                    "images": sorted({p.image for p in prepared.pulled}),
                    "pins": {volume: pin.pinned for volume, pin in sorted(prepared.pins.items())},
                    # the disks it was pulled and the VM exports whose claims it writes (launcher.node.vmexport)
                    "entries": sorted({str(p.path.parent) for p in prepared.pulled} | _exports_used(cache, opts)),
                    "started": int(time.time()),
                    "pid": os.getpid(),
                    "secrets": [source.secret_usage for source, _ in prepared.secrets],
                    "virtiofsd": daemons,
                    # what `launcher port-forward` adds its forwards to
                    "network": [{"interface": i.name, "netdev": netdev_id(i), "cidr": i.cidr} for i in vmi.domain.devices.interfaces],
                    "livenessProbe": vmi.liveness_probe,  # what `launcher pause` checks, as virt-api does
                    # what launcher.runtime.credsync's helper keeps in the guest: [{secret, users}]
                    "accessCredentials": credsync.record_entries(vmi.access_credentials),
                }
                cache.write_json(cache.vm_record_path(name), record)
            for note in prepared.notes:
                say(f"note: {note}")
            for source, value in prepared.secrets:
                lv.define_secret(secret_xml(source), value, source.secret_usage)
            lv.start(name, xml)
            if record["accessCredentials"]:
                storage = opts.storage or Storage()
                record["credentialSync"] = credsync.start(cache, name, run_dir, credsync.secret_flags(storage.manifests, storage.kube_api))
                cache.write_json(cache.vm_record_path(name), record)
            if vmi.from_vm:  # booted: what its next runs boot. The kubelet resolved what the pod mounted: those pins stay.
                mounted = opts.container_disk_dir is not None or opts.kernel_boot_dir is not None
                pins.save(cache, name, {**(pins.load(cache, name) if mounted else {}), **prepared.pins})
            _publish(vmi, lv, opts.publish_address, say)
            alarm.disarm()
        except BaseException as exc:
            alarm.disarm()
            virtiofs.stop(daemons)  # started, maybe not recorded yet
            cleanup(cache, lv, name)
            if isinstance(exc, _OutOfTime):
                raise TimedOut(name, f"not started within --timeout {opts.timeout:g} s (pulling, serving or starting it); nothing was left") from None
            if isinstance(exc, OSError) and cache.vanished():
                raise DiskkitError(cache.root, "the cache directory disappeared while the VM was being prepared") from None
            raise
    if not opts.console:
        shown = vmi.name if vmi.namespace == "default" else f"{vmi.namespace}/{vmi.name}"
        say(f"{name} is running; its console: launcher console {shown} (detach with Ctrl-]); what it printed: launcher logs {shown}"
            f" ({rundir.console_log(run_dir)})")
        say(f"stop it with: launcher stop {shown}{'' if opts.wait_for or opts.detach else ', or Ctrl-C here'}")
    if opts.detach and not opts.wait_for:
        return 0
    console_log = ConsoleLog(rundir.console_log(run_dir))
    echo = Echo() if opts.console else None
    metrics = None
    try:
        try:
            metrics = _metrics_refresher(vmi, prepared, lv)
            with _signals_set(interrupted := threading.Event()):
                watch = PauseWatch(lv, name, say, lambda: last_failure(cache))
                left = None if opts.timeout is None else max(0.0, opts.timeout - (time.monotonic() - began))
                outcome = follow(console_log, watch.running, opts.wait_for, left, echo, interrupted)
        finally:
            if metrics is not None:
                metrics.stop()  # with --wait-for the VM outlives us; its metrics then stop changing
                if metrics.error is not None:
                    say(f"note: the downwardMetrics disk was not always refreshed: {metrics.error}")
    except BaseException:
        console_log.close()
        cleanup(cache, lv, name)
        raise
    if outcome == "interrupted":
        try:
            _shut_down(lv, name, grace_period_of(vmi, opts), say, console_log, echo)
        finally:
            console_log.close()
            cleanup(cache, lv, name)
        raise KeyboardInterrupt
    console_log.close()
    if outcome == "found":
        say(f"{name} is running (saw {opts.wait_for!r}); stop it with: launcher stop {vmi.name}")
        return 0
    cleanup(cache, lv, name)
    if outcome == "timeout":
        what = f"{opts.wait_for!r} did not appear on the console" if opts.wait_for else "the VM was still running"
        raise TimedOut(name, f"{what} after {opts.timeout:g} s; the domain was destroyed")
    if opts.wait_for:
        raise GuestFailed(name, f"the guest stopped before {opts.wait_for!r} appeared on the console")
    say(f"{name} stopped")
    return 0


def _publish(vmi: VMI, lv: Libvirt, address: str | None, say: Callable[[str], None]) -> None:
    """The declared ports from `address`, as KubeVirt's masquerade forwards them from the pod's IP; the
    rules live in qemu and go with it."""
    if address is None:
        return
    for iface in vmi.domain.devices.interfaces:
        forwarder = Forwarder(lambda command: lv.monitor(vmi.domain_name, command), netdev_id(iface), address)
        if not iface.ports:
            # KubeVirt forwards every port then; qemu's user-mode stack takes one rule per port.
            say(f"note: interface {iface.name} declares no ports; none is published (launcher port-forward reaches any)")
        for port in iface.ports:
            forwarder.add(Forward(port.protocol.lower(), port.port, port.port))
            say(f"{address}:{port.port}/{port.protocol} -> {iface.name} port {port.port}")


def _shut_down(lv: Libvirt, name: str, grace: float, say: Callable[[str], None], console_log: ConsoleLog, echo: Echo | None) -> None:
    """virt-launcher's graceful shutdown: the ACPI power button, then up to `grace` seconds for the
    guest to stop by itself, and what is still running is killed (pkg/virt-launcher/monitor.go,
    the graceful and final shutdown callbacks of cmd/virt-launcher/virt-launcher.go). The console
    stays on meanwhile: a guest's shutdown messages are what a pod's log should end with."""
    if grace <= 0 or not lv.shutdown(name):
        return
    say(f"{name}: shutting down (up to {grace:g} s)")
    deadline = time.monotonic() + grace
    with _signals_set(threading.Event()):  # a second SIGTERM must not cut the grace period short
        while True:
            left = deadline - time.monotonic()
            outcome = follow(console_log, lambda: lv.active(name), timeout=min(PRESS_AGAIN, left), echo=echo)
            if outcome == "stopped" or time.monotonic() >= deadline:
                break
            lv.shutdown(name)
    if outcome == "stopped":
        say(f"{name}: the guest powered off")
    else:
        say(f"{name}: still running after {grace:g} s; destroying it")



def _metrics_refresher(vmi: VMI, prepared, lv: Libvirt) -> vhostmd.Refresher | None:
    """virt-handler's job for a downwardMetrics disk: fresh host and VM metrics every few seconds."""
    volume = next((v for v in vmi.volumes if v.kind == "downwardMetrics"), None)
    if volume is None:
        return None
    name = vmi.domain_name

    def stats() -> vhostmd.VMStats | None:
        usage = lv.usage(name)
        return None if usage is None else vhostmd.VMStats(*usage)

    return vhostmd.Refresher(Path(prepared.disks[volume.name].path), stats, lv.hypervisor_version()).start()


@contextlib.contextmanager
def _signals_set(event: threading.Event) -> Iterator[None]:
    """While following the guest, SIGTERM and Ctrl-C only set `event`: raised at an arbitrary
    point (inside a libvirt callback, say) an exception can be swallowed and the VM kept."""
    handler = lambda signum, frame: event.set()  # noqa: E731
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class _OutOfTime(BaseException):
    """--timeout ran out while the VM was being prepared or started. A BaseException, as SIGALRM
    raises it wherever the run is, and an `except Exception` on the way must not swallow it."""


class _Alarm:
    """SIGALRM at the run's deadline: pulls, the disk server and libvirt's start block in calls
    that take no timeout of their own."""

    def __init__(self):
        self.previous = None

    def arm(self, seconds: float) -> None:
        def ring(signum, frame):
            raise _OutOfTime()

        self.previous = signal.signal(signal.SIGALRM, ring)
        signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))

    def disarm(self) -> None:
        if self.previous is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous)
            self.previous = None


class Echo:
    """The console to stdout."""

    def __call__(self, data: bytes) -> None:
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()


def _exports_used(cache: Cache, opts: RunOptions) -> set[str]:
    claims = (opts.storage or Storage()).pvcs.values()
    return {str(export) for claim in claims if (export := cache.export_of(claim.path))}


def _remove_run_dir(cache: Cache, name: str) -> None:
    rundir.remove(cache.run_dir(name))


def cleanup(cache: Cache, lv: Libvirt | None, name: str) -> bool:
    """Destroy and undefine the domain and its secrets, end its virtiofsd processes, remove its overlays and
    record; True if a domain was there."""
    had = lv.destroy(name) if lv is not None else False
    record = cache.read_json(cache.vm_record_path(name)) or {}
    if lv is not None:
        for usage in record.get("secrets", []):
            lv.undefine_secret(usage)
    virtiofs.stop(record.get("virtiofsd", []))
    credsync.stop(record.get("credentialSync"))
    _remove_run_dir(cache, name)
    cache.vm_record_path(name).unlink(missing_ok=True)
    return had


def find_record(cache: Cache, name: str) -> dict | None:
    """A VM by domain name (NAMESPACE_NAME), NAMESPACE/NAME, or VMI name in any namespace if unique."""
    records = cache.vm_records()
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


def stop(cache: Cache, name: str) -> str | None:
    """Destroy the VM and remove its files; its domain name, or None when no VM of this name runs
    from this cache (never started, stopped already, or its guest powered off)."""
    record = find_record(cache, name)
    if record is None:
        return None
    try:
        lv = connect(cache, record["uri"])
    except DiskkitError:
        lv = None  # the daemon is gone, and the domain with it; still remove the files
    # A domain defined and never started (its launcher killed in between) or powered off is no running VM.
    was_running = lv is not None and lv.active(record["domain"])
    cleanup(cache, lv, record["domain"])
    return record["domain"] if was_running or lv is None else None


def state(record: dict, cache: Cache | None = None) -> str:
    """running, paused (by the user, or by an I/O error of a disk: error_policy stop), stopped (defined,
    not running), gone (no such domain) or unknown (libvirt unreachable)."""
    return state_and_why(record, cache)[0]


def state_and_why(record: dict, cache: Cache | None = None) -> tuple[str, Paused | None]:
    """The state, and for a paused VM KubeVirt's Paused condition: who paused it, and for an I/O
    error which disks and why (iopause.describe)."""
    try:
        lv = Libvirt(record["uri"]) if cache is None else connect(cache, record["uri"])
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
    found = []
    if paused is not None:
        found.append({"type": "Paused", "status": "True", "reason": paused.reason, "message": paused.message})
    try:
        lv = connect(cache, record["uri"])
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

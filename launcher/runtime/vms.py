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
from launcher.network import backend as network
from launcher.network import linuxbridge
from launcher.node import pins
from launcher.node.cache import QEMU_ID, Cache
from launcher.render.domain import Host, network_queues, notes, read_only_volumes, render, secret_xml
from launcher.render.interfaces import socket_path
from launcher.runtime import accel, credsync, diskfds, hooks, hostcpus, rundir, sessiond, swtpm, virtiofs, vmuser
from launcher.runtime.console import ConsoleLog, follow
from launcher.runtime.iopause import PATIENCE, PauseWatch
from launcher.runtime.lookup import find_record, gone_for_good, own_libvirt, reachable, state
from launcher.runtime.runner import Libvirt, default_uri
from launcher.runtime.stopping import DEFAULT_GRACE_PERIOD, NOT_RUNNING, UNREACHABLE, Stopped, shut_down
from launcher.runtime.vmuser import VmUser
from launcher.spec.hooks import sidecars
from launcher.spec.vmi import VMI
from launcher.volumes import vhostmd, vmstate
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
    # When the VM is stopped (SIGTERM, Ctrl-C, `launcher stop`) the guest has this long to power off before
    # the domain is destroyed; None: the VMI's terminationGracePeriodSeconds (see grace_period_of).
    grace_period: float | None = None
    # Return once the domain has started; the VM keeps running, as after --wait-for, and `launcher
    # console/logs/stop` reach it (virtctl start's habit: the command does not hold the VM).
    detach: bool = False
    # Where the interfaces' declared ports are published (KubeVirt's masquerade and passt forward them
    # from the pod's IP); None: nowhere, `launcher port-forward` reaches any port.
    publish_address: str | None = None
    # A VirtualMachine's containerDisk tags are resolved again instead of booting the digests its
    # earlier runs pinned (launcher.node.pins).
    update: bool = False
    # Where the pod mounts each containerDisk's image (KubeVirt's /var/run/kubevirt-image-volume):
    # the disks are used from there, nothing is pulled (launcher.volumes.imagevolume).
    container_disk_dir: Path | None = None
    kernel_boot_dir: Path | None = None  # likewise the kernelBoot container's (/var/run/kubevirt-kernel-boot)
    accel: str | None = None  # --accel: "kvm", "qemu" or "tcg"; None or "auto": launcher.runtime.accel chooses
    # --pull-policy: every containerDisk's and kernelBoot container's imagePullPolicy for this run, in place of the spec's
    pull_policy: str | None = None
    # A VirtualMachine's pins (launcher.node.pins) are read and saved under its name; False for an
    # export's own VirtualMachine, whose name may be one of the user's VMs'.
    pinned: bool = True
    # --record-trace: a token the node's disk server records the boot's reads of each lazy containerDisk
    # under (launcher.diskserver.recording); the caller takes the traces once the boot is over.
    trace: str | None = None
    # --io-error-patience: over how many seconds a VM that keeps pausing on I/O errors (a lazy disk's
    # registry away) is resumed before it is given up on (launcher.runtime.iopause).
    io_error_patience: float = PATIENCE


def grace_period_of(vmi: VMI, opts: RunOptions) -> float:
    """The option, else the VMI's own, else KubeVirt's default (gracePeriodInSeconds in
    pkg/virt-controller/services/template.go)."""
    if opts.grace_period is not None:
        return opts.grace_period
    return DEFAULT_GRACE_PERIOD if vmi.grace_period is None else vmi.grace_period


def _own_daemon(opts: RunOptions) -> bool:
    """As root where no system daemon answers (and no --connect chooses one), each VM runs as the
    launcher pod runs it: through a session daemon of the qemu user of its own (launcher.runtime.sessiond),
    under a uid of its own (launcher.runtime.vmuser)."""
    return opts.uri is None and os.geteuid() == 0 and not sessiond.system_daemon_answers()


def plan(vmi: VMI, cache: Cache, opts: RunOptions, create: bool, say: Callable[[str], None], qemu: tuple[int, int] = KUBEVIRT_QEMU,
         dac: bool = False, qemu_uid: int | None = None, qemu_cannot_open: str | None = None, by_fd: bool = False,
         dac_label: tuple[int, int] | None = None, system_daemon: bool = False, taps: tuple[tuple[str, str, str], ...] = ()):
    """Pull what the VMI needs, choose the accelerator (said in one line) and render the domain:
    (prepared volumes, domain XML, accelerator, handed files). With `create`, the overlays are made too
    (and what qemu opens in claims is given to `qemu`); `qemu_cannot_open`: see accel.choose. With
    `by_fd` (a root launcher's run) every disk and kernel from outside the run directory reaches qemu
    as an open file or a copy of its own (launcher.runtime.diskfds): the fourth value holds the open
    files, for the domain's start. `system_daemon`: libvirt's system daemon runs it. `taps`: each Multus
    bridge NIC's tap and MAC (launcher.network.linuxbridge.plan)."""
    run_dir = cache.run_dir(vmi.domain_name)
    prepared = prepare(vmi, cache, run_dir, opts.registry, opts.platform, create=create, store=opts.storage, lazy=opts.lazy,
                       qemu=qemu, qemu_uid=qemu_uid, pins=pins.load(cache, vmi.domain_name) if vmi.from_vm and opts.pinned else None,
                       update=opts.update, image_volumes=opts.container_disk_dir, kernel_boot_dir=opts.kernel_boot_dir,
                       pull_policy=opts.pull_policy, trace=opts.trace)
    chosen = accel.choose(cache.root, opts.accel, qemu_cannot_open=qemu_cannot_open)  # after the pulls: a refused image costs no probe
    say(chosen.line())
    handed = diskfds.Handed(prepared.disks, kernel=prepared.kernel, initrd=prepared.initrd)
    if by_fd:
        handed = diskfds.hand_over(prepared.disks, run_dir, prepared.kernel, prepared.initrd, read_only_volumes(vmi, prepared.disks))
    try:
        host = Host(
            domain_type=chosen.domain_type,
            serial_log=str(rundir.console_log(run_dir)),
            kernel=handed.kernel,
            initrd=handed.initrd,
            virtiofs_sockets=virtiofs.sockets(vmi, run_dir),
            net_dir=str(rundir.sockets_dir(run_dir, network.NET_DIR, network.LONGEST_SOCKET)),
            taps=taps,
            dac=dac,
            dac_label=dac_label,
            # A system daemon labels a socket it is given as root, by path, in a directory qemu's user
            # writes (and an unprivileged launcher's is no place qemu's user may write): there the
            # sockets are libvirt's own, in its directories.
            vnc_socket=None if system_daemon else rundir.qemu_socket(run_dir, rundir.VNC_SOCKET),
            agent_socket=None if system_daemon else rundir.qemu_socket(run_dir, rundir.AGENT_SOCKET),
            tpm_socket=swtpm.socket_path(run_dir) if vmstate.launcher_runs_tpm(vmi) else None,
            **(dict(zip(("efi_code", "efi_vars", "nvram"), prepared.efi)) if prepared.efi else {}),
        )
        if vmi.domain.cpu.dedicated_cpu_placement:
            host = replace(host, topology=hostcpus.read_topology(), cpuset=hostcpus.pod_cpuset())
        xml = render(vmi, handed.disks, host)
    except BaseException:
        handed.close()
        raise
    prepared.notes.extend(notes(vmi, host))  # what the guest goes without here (emulation)
    return prepared, xml, chosen, handed


@dataclass(frozen=True)
class Ran:
    code: int
    accel: accel.Accel  # what the domain ran on, and why


def run(vmi: VMI, cache: Cache, opts: RunOptions, say: Callable[[str], None]) -> Ran:
    """Start the VM and stay with it: until --wait-for text, the guest's own stop, a timeout or a signal."""
    name = vmi.domain_name
    began = time.monotonic()  # --timeout counts from here: pulls, the disk server and libvirt's start included
    own = _own_daemon(opts)
    lv = None if own else Libvirt(opts.uri or default_uri())
    # Claims (and what a root launcher gives qemu in them) belong to the qemu user of the daemon: 107 on
    # a session daemon, KubeVirt's owner of a claim's files, or qemu.conf's user under the system daemon.
    owner = qemu_owner(lv.uri if lv is not None else "qemu:///session")
    with cache.lock(f"vm-{name}"):
        if lv is not None and lv.shut_off_with_uuid(name, vmi.uuid):
            cleanup(cache, lv, name, drop_tpm_state=vmstate.drops_tpm_state(vmi))  # this VMI's own, left by a killed launcher: nothing runs in it
        if lv is not None and lv.exists(name):
            raise DiskkitError(name, f"a domain of this name already exists on {lv.uri}; stop it first (launcher stop {vmi.name})")
        if own:
            _clear_last_run(cache, vmi)
        _remove_run_dir(cache, name)  # leftovers of a launcher that was killed
        # The console log lives here even with no overlay. Root's alone until prepared (rundir).
        rundir.create(cache.run_dir(name))
        daemons: list[dict] = []
        nets = network.Started()
        alarm = _Alarm()
        allocation = None
        handed = diskfds.Handed({})
        try:
            # Under the system daemon a root launcher's VM gets its own uid too, as a static DAC label.
            labelled = lv is not None and os.geteuid() == 0 and is_system_uri(lv.uri)
            if own or labelled:
                allocation = vmuser.allocate(name, cache.root)
            if own:
                say(f"no libvirt system daemon answers here ({sessiond.SYSTEM_SOCKETS[-1]}); running the VM as the launcher pod"
                    f" does, through a session daemon of the qemu user ({QEMU_ID}) of its own, in a user namespace that is"
                    f" uid {allocation.user.uid} on this host ({sessiond.uri(allocation.user)}; --connect chooses another)")
            uri = sessiond.uri(allocation.user) if own else lv.uri
            # qemu's own identity: what it opens in the run directory, the virtiofs sockets and its NBD
            # socket are given to it; a VM's own uid, or the qemu user of the daemon --connect named.
            vm_ids = allocation.user.ids if allocation is not None else owner
            virtiofs.check_runnable(vmi)
            network.check(vmi)
            linuxbridge.check(vmi, allocation is not None, session=own)
            taps = linuxbridge.plan(vmi, vm_ids[0]) if allocation is not None else ()
            nics = network.plan(vmi, opts.publish_address)
            admit(vmi, opts.storage or Storage())
            from launcher.datavolumes.control import ensure_ready

            ensure_ready(vmi, opts.storage or Storage(), opts.registry, opts.timeout, say)  # KubeVirt waits for them too
            if opts.timeout is not None:
                alarm.arm(opts.timeout - (time.monotonic() - began))
            with cache.lock("gc", shared=True):  # gc must not take the bases between pull and record
                # qemu as a VM's own uid, or a session daemon's user, is outside the group a root disk
                # server's shared NBD socket is open to: it gets a socket of its uid's own.
                qemu_uid = vm_ids[0] if os.geteuid() == 0 and (allocation is not None or not is_system_uri(uri)) else None
                # Nor may qemu on a session daemon open a /dev/kvm root can: then the domain is TCG's.
                tcg = os.geteuid() == 0 and not is_system_uri(uri) and not sessiond.kvm_for(uri)
                prepared, xml, chosen, handed = plan(vmi, cache, opts, create=True, say=say, qemu=owner,
                                                     dac=os.geteuid() == 0 and is_system_uri(uri), qemu_uid=qemu_uid,
                                                     qemu_cannot_open=f"qemu's user (uid {qemu_uid}) on {uri}" if tcg else None,
                                                     by_fd=os.geteuid() == 0, dac_label=vm_ids if labelled else None,
                                                     system_daemon=is_system_uri(uri), taps=taps)
                storage = opts.storage or Storage()
                # Before anything of the VM's uid runs: the hook runs as that uid, and nothing it starts outlives it.
                xml = hooks.on_define_domain(sidecars(vmi.annotations, storage.gates, vmi.from_vm), vmi, xml, storage.objects,
                                             vm_ids if os.geteuid() == 0 else None, say)
                run_dir = cache.run_dir(name)
                if vmstate.launcher_runs_tpm(vmi):
                    swtpm.manufacture(run_dir, vmi)  # a new TPM's state, unless a kept one was put there
                rundir.open_to_qemu(run_dir, vm_ids)
                write_atomic(run_dir / "domain.xml", xml.encode(), 0o600)  # root's: libvirt is given the XML, not the file
                daemons = virtiofs.start(vmi, prepared.shares, run_dir, vm_ids, owner)
                if nics:
                    # The VM's pod switch runs as qemu itself (the VM's own uid as root), whose socket it serves.
                    rundir.traversable_dir(run_dir / network.NET_DIR, vm_ids)
                    net_dir = rundir.link_sockets_dir(run_dir, network.NET_DIR, network.LONGEST_SOCKET)
                    nets = network.start(nics, [Path(socket_path(str(net_dir), i)) for i in range(len(nics))], vm_ids)
                record = {
                    "domain": name,
                    "vmi": vmi.name,
                    "namespace": vmi.namespace,
                    "uri": uri,
                    **({"vmUser": allocation.user.to_json()} if allocation is not None else {}),
                    "run_dir": str(run_dir),
                    "images": sorted({p.image for p in prepared.pulled}),
                    "pins": {volume: pin.pinned for volume, pin in sorted(prepared.pins.items())},
                    # the disks it was pulled and the VM exports whose claims it writes (launcher.node.vmexport)
                    "entries": sorted({str(p.path.parent) for p in prepared.pulled} | _exports_used(cache, opts)),
                    "started": int(time.time()),
                    "pid": os.getpid(),
                    "secrets": [source.secret_usage for source, _ in prepared.secrets],
                    "virtiofsd": daemons,
                    # each NIC's pod switch: what `launcher port-forward` asks for forwards, what stop ends
                    "network": nets.entries,
                    # each Multus bridge NIC's tap, which goes with the VM's uid (launcher.network.linuxbridge)
                    "bridgeTaps": [{"interface": interface, "tap": tap, "mac": mac} for interface, tap, mac in taps],
                    "livenessProbe": vmi.liveness_probe,  # what `launcher pause` checks, as virt-api does
                    "gracePeriod": grace_period_of(vmi, opts),  # what `launcher stop` gives the guest
                    "accel": chosen.to_json(),
                    "dropTPMState": vmstate.drops_tpm_state(vmi),  # a bare VMI's persistent TPM goes with it
                    # what the run's end keeps of its run directory for the next run (launcher.volumes.vmstate)
                    "keptState": vmstate.kept_state(vmi),
                    # whom the swtpm the launcher runs for the VM's TPM runs as
                    **({"swtpm": list(vm_ids)} if vmstate.launcher_runs_tpm(vmi) else {}),
                    # what launcher.runtime.credsync's helper keeps in the guest: [{secret, users}]
                    "accessCredentials": credsync.record_entries(vmi.access_credentials),
                }
                cache.write_json(cache.vm_record_path(name), record)
            for note in prepared.notes:
                say(f"note: {note}")
            if taps:
                linuxbridge.make(vmi, taps, vm_ids[0], network_queues(vmi))  # recorded first: a stop or the uid's next VM removes them
            if own:
                lv = own_libvirt(sessiond.start(allocation.user), allocation.user)
            for source, value in prepared.secrets:
                lv.define_secret(secret_xml(source), value, source.secret_usage)
            if vmstate.launcher_runs_tpm(vmi):
                swtpm.start(run_dir, vm_ids)
            try:
                lv.start(name, xml, handed.fds, defined=(lambda: sessiond.keep_capabilities(allocation.user)) if own else None)
            except DiskkitError:
                nets.wait()  # a switch that did not start is why qemu could not connect: its line first
                raise
            handed.close()
            if allocation is not None:
                allocation.close()  # from now on the VM's own processes hold its uid
            nets.wait()  # started alongside libvirt's start: what they publish is bound, or the run ends here
            if record["accessCredentials"]:
                storage = opts.storage or Storage()
                record["credentialSync"] = credsync.start(cache, name, run_dir, credsync.secret_flags(storage.manifests, storage.kube_api))
                cache.write_json(cache.vm_record_path(name), record)
            if vmi.from_vm and opts.pinned:  # booted: what its next runs boot. The kubelet resolved what the pod mounted: those pins stay.
                mounted = opts.container_disk_dir is not None or opts.kernel_boot_dir is not None
                pins.save(cache, name, {**(pins.load(cache, name) if mounted else {}), **prepared.pins})
            _say_published(nics, say)
            alarm.disarm()
        except BaseException as exc:
            alarm.disarm()
            handed.close()
            virtiofs.stop(daemons)  # started, maybe not recorded yet
            nets.close()
            network.stop(nets.entries)
            if allocation is not None:
                allocation.close()
            cleanup(cache, lv, name, user=allocation.user if allocation is not None else None, drop_tpm_state=vmstate.drops_tpm_state(vmi))
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
        return Ran(0, chosen)
    console_log = ConsoleLog(rundir.console_log(run_dir))
    echo = Echo() if opts.console else None
    metrics = None
    try:
        try:
            metrics = _metrics_refresher(vmi, prepared, lv)
            with _signals_set(interrupted := threading.Event()):
                watch = PauseWatch(lv, name, say, lambda: last_failure(cache), opts.io_error_patience)
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
        # The console stays on meanwhile: a guest's shutdown messages are what a pod's log should end
        # with (virt-launcher's graceful and final shutdown callbacks, cmd/virt-launcher/virt-launcher.go).
        def powered_off(seconds: float) -> bool:
            return follow(console_log, lambda: lv.active(name), timeout=seconds, echo=echo) == "stopped"

        try:
            with _signals_set(threading.Event()):  # a second SIGTERM must not cut the grace period short
                cleanup(cache, lv, name, grace_period_of(vmi, opts), powered_off, say)
        except BaseException:
            cleanup(cache, lv, name)  # whatever failed while it shut down, nothing of the VM is left running
            raise
        finally:
            console_log.close()
        raise KeyboardInterrupt
    console_log.close()
    if outcome == "found":
        say(f"{name} is running (saw {opts.wait_for!r}); stop it with: launcher stop {vmi.name}")
        return Ran(0, chosen)
    cleanup(cache, lv, name, say=say)
    if outcome == "timeout":
        what = f"{opts.wait_for!r} did not appear on the console" if opts.wait_for else "the VM was still running"
        raise TimedOut(name, f"{what} after {opts.timeout:g} s; the domain was destroyed")
    if opts.wait_for:
        raise GuestFailed(name, f"the guest stopped before {opts.wait_for!r} appeared on the console")
    say(f"{name} stopped")
    return Ran(0, chosen)


def _say_published(nics: list, say: Callable[[str], None]) -> None:
    """What each NIC's stack publishes on the pod's side (launcher.network.bindings, --publish-address)."""
    for nic in nics:
        if nic.publish_address is not None and not nic.publish:
            # KubeVirt forwards every port then; a host's own ports are not all the guest's to take.
            say(f"note: interface {nic.interface} declares no ports; none is published (launcher port-forward reaches any)")
        for address, port, protocol in nic.publish:
            say(f"{address}:{port}/{protocol} -> {nic.interface} port {port}")


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


def cleanup(cache: Cache, lv: Libvirt | None, name: str, grace: float = 0, wait: Callable[[float], bool] | None = None,
            say: Callable[[str], None] = lambda _: None, user: VmUser | None = None, drop_tpm_state: bool | None = None) -> Stopped | None:
    """End the domain (launcher.runtime.stopping: the power button and up to `grace` seconds, else
    destroyed at once), undefine it and its secrets, end its virtiofsd processes, remove its overlays
    and record, and give back the VM's own uid (`user`, else the record's) with its session daemon;
    how the domain ended, None with no libvirt to ask. A persistent TPM's state stays unless
    `drop_tpm_state` (None: as the record says)."""
    record = cache.read_json(cache.vm_record_path(name)) or {}
    if drop_tpm_state is None:
        drop_tpm_state = bool(record.get("dropTPMState"))
    stopped = shut_down(lv, name, grace, wait, say, drop_tpm_state) if lv is not None else None
    if lv is not None:
        for usage in record.get("secrets", []):
            lv.undefine_secret(usage)
    virtiofs.stop(record.get("virtiofsd", []))
    network.stop([entry for entry in record.get("network", []) if "pid" in entry])
    credsync.stop(record.get("credentialSync"))
    user = user or VmUser.from_json(record.get("vmUser"))
    if isinstance(record.get("swtpm"), list) and len(record["swtpm"]) == 2:
        swtpm.stop(cache.run_dir(name), tuple(record["swtpm"]))
    _keep_state(cache, name, record, user, say)
    _remove_run_dir(cache, name)
    cache.vm_record_path(name).unlink(missing_ok=True)
    if user is not None:
        vmuser.release(user)  # its daemon ends with the uid's other processes
    return stopped


def _keep_state(cache: Cache, name: str, record: dict, user: VmUser | None, say: Callable[[str], None]) -> None:
    """What the run leaves in its run directory for the VM's next run becomes its kept state
    (launcher.volumes.vmstate), once qemu and its swtpm have ended; from a VM's own uid only while the uid
    is still this VM's, and with no uid given out or back meanwhile: a later VM of the uid could have
    written its copy."""
    kept = record.get("keptState")
    if not isinstance(kept, dict) or not kept:
        return
    with contextlib.ExitStack() as held:
        if user is not None and not held.enter_context(vmuser.kept(user)):
            say(f"note: {name}: its uid was given to another VM before its state was kept; the state kept before this run stays")
            return
        for line in vmstate.keep(cache.root, name, cache.run_dir(name), kept):
            say(f"note: {line}")


def _clear_last_run(cache: Cache, vmi: VMI) -> None:
    """Before a VM of this name gets a daemon of its own: one recorded still running is refused, as a
    domain of the name on a shared daemon is; what one that has stopped left (its daemon, its uid) goes."""
    record = cache.read_json(cache.vm_record_path(vmi.domain_name))
    if record is None:
        return
    if state(record, cache) in ("running", "paused", "unknown"):
        raise DiskkitError(vmi.domain_name, f"a domain of this name already exists on {record['uri']}; stop it first (launcher stop {vmi.name})")
    with reachable(record) as lv:
        cleanup(cache, lv, vmi.domain_name)


def stop(cache: Cache, name: str, grace: float | None = None, say: Callable[[str], None] = lambda _: None) -> tuple[str, Stopped] | None:
    """Stop the VM as `virtctl stop` does (launcher.runtime.stopping) and remove its files: the
    power button and the grace period its run recorded (the VMI's terminationGracePeriodSeconds, or
    `launcher run --grace-period`), or `grace`. Its domain name and how it ended, or None when no VM of
    this name runs from this cache (never started, stopped already, or its guest powered off)."""
    record = find_record(cache, name)
    if record is None:
        return None
    if gone_for_good(record):
        cleanup(cache, None, record["domain"])
        return None
    period = record.get("gracePeriod", DEFAULT_GRACE_PERIOD) if grace is None else grace
    with reachable(record) as lv:
        stopped = cleanup(cache, lv, record["domain"], period, say=say)
    if stopped is None:
        say(f"{record['domain']}: libvirt at {record['uri']} cannot be reached; only the VM's files were removed")
        return record["domain"], Stopped(UNREACHABLE, period)
    # A domain defined and never started (its launcher killed in between) or powered off is no running VM.
    return None if stopped.how == NOT_RUNNING else (record["domain"], stopped)

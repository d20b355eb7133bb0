"""The `launcher` command line: pull containerDisks into the node cache and boot KubeVirt VMIs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from diskkit import __version__
from diskkit.cli.shell import platform as platform_of
from diskkit.cli.shell import EXIT_EPILOG, LazyGroup, registry_options, run_main
from diskkit.registry.options import RegistryOptions
from launcher.cli.exportsource import is_export, spec_option
from launcher.cli.exportsource import vm_file as export_vm_file
from launcher.cli.options import cache_option, ignore_unsupported_option, load_vmi_file, node_cache, parse_size, say, storage_options, trust_options, warn_if_open
from launcher.cli.imagesource import PULL_POLICIES, accel_option, container_disk_dir_option, pull_policy_option, update_option
from launcher.node.pins import every as pins_listing
from launcher.node.cache import Cache, tree_size
from launcher.node.imagehints import ImageHints


# Commands of their own modules load when named: `launcher pull` does not import what `launcher test` boots with.
LAZY = {"dv": "launcher.cli.dv:dv", "console": "launcher.cli.consoles:console", "logs": "launcher.cli.consoles:logs",
        "port-forward": "launcher.cli.portforward:port_forward", "ssh": "launcher.cli.ssh:ssh", "test": "launcher.cli.smoketest:smoke_test",
        "pause": "launcher.cli.pausecmd:pause", "unpause": "launcher.cli.pausecmd:unpause",
        "vnc": "launcher.cli.vnccmd:vnc", "guestosinfo": "launcher.cli.agentcmds:guestosinfo",
        "userlist": "launcher.cli.agentcmds:userlist", "fslist": "launcher.cli.agentcmds:fslist",
        "sync-credentials": "launcher.cli.credsynccmd:sync_credentials", "memory-dump": "launcher.cli.memorydumpcmd:memory_dump"}


@click.group(cls=LazyGroup, lazy=LAZY, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}, epilog=EXIT_EPILOG)
@click.version_option(__version__, prog_name="launcher")
def cli() -> None:
    """Boot KubeVirt-style VMs from containerDisk images, locally or as a pod's sidecar.

    Images are referenced in the containers-transports syntax (docker://, bare HOST/REPO:TAG, oci:,
    oci-archive:, docker-archive:), so a local layout boots with no registry at all.
    """


@cli.command(epilog="""\b
Examples:
  launcher pull quay.io/containerdisks/fedora:40
  launcher pull --path /images/root.qcow2 oci:./layout:custom
  launcher pull --tls-verify=false --json localhost:5000/disks/test:v1
""")
@click.argument("ref")
@click.option("--path", "image_path", metavar="/DIR/NAME", help="containerDisk.path: the disk's path in the image (default: the one file in /disk).")
@click.option("--platform", help="OS/ARCH to pick from a multi-platform index (default: this host's).")
@click.option("--pull-policy", type=click.Choice(PULL_POLICIES), help="As imagePullPolicy (default: Always for :latest, else IfNotPresent); a tag answered from the cache is said with its digest.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@cache_option
@registry_options
@trust_options
def pull(ref, image_path, platform, pull_policy, as_json, cache_dir, registry: RegistryOptions) -> None:
    """Pull REF into the node cache and print the path of its extracted disk.

    Layers stream through once, digests and diffIDs verified; only the disk is written (sparse),
    after KubeVirt's checks (qemu-img info under limits, raw or qcow2, no backing or data file).
    Concurrent pulls of one image on a node download it once.
    """
    from diskkit.progress import reporter_for
    from launcher.node.pull import pull as do_pull

    pulled = do_pull(node_cache(cache_dir), ref, image_path, platform_of(platform), registry, pull_policy, reporter=reporter_for(as_json))
    click.echo(json.dumps(pulled.to_json(), indent=2) if as_json else str(pulled.path))


@cli.command(epilog="""\b
Examples:
  launcher domain examples/vmi-containerdisk.yaml
  launcher domain --accel kvm vmi.yaml > domain.xml
  launcher domain --lazy vmi.yaml                  # the NBD export `launcher run --lazy` would boot from
  launcher domain oci-archive:vm.oci.tar           # a KubeVirt VM export: its claims made from its disks first
""")
@click.argument("vmi_file", metavar="VMI_FILE|EXPORT|-")
@click.option("--platform", help="OS/ARCH of the images (default: this host's).")
@accel_option
@click.option("--lazy/--no-lazy", default=None, help="As `launcher run --lazy`: lazy containerDisks show the NBD export the VM would read.")
@update_option
@pull_policy_option
@container_disk_dir_option
@spec_option
@ignore_unsupported_option
@cache_option
@click.option("--json", "as_json", is_flag=True, help='Print {"domain": NAME, "accel": {...}, "xml": XML} instead of the XML.')
@storage_options
@registry_options
@trust_options
def domain(vmi_file, platform, accel, lazy, update, pull_policy, container_disk_dir, kernel_boot_dir, own_spec, ignore_unsupported, as_json, cache_dir, store,
           registry: RegistryOptions) -> None:
    """Print the libvirt domain XML `launcher run` would start (a dry run: images are pulled or, lazy, opened on the node's disk server; nothing started).

    VMI_FILE `-` reads the VMI (or VM) from stdin, as `kubectl apply -f -`."""
    # An export's own VirtualMachine may not read nor replace the pins of a VM of the user's that it names.
    pinned = own_spec is not None or not is_export(vmi_file)
    vmi_file = export_vm_file(vmi_file, cache_dir, store, registry, platform_of(platform), own_spec)
    vmi = load_vmi_file(vmi_file, ignore_unsupported, ImageHints(store.objects, registry, platform_of(platform)))
    from launcher.runtime.vms import RunOptions, plan  # after the spec is admitted: a refusal needs none of it

    opts = RunOptions(platform=platform_of(platform), registry=registry, storage=store, lazy={None: "auto", True: "on", False: "off"}[lazy],
                      update=update, container_disk_dir=container_disk_dir, kernel_boot_dir=kernel_boot_dir, accel=accel, pull_policy=pull_policy,
                      pinned=pinned)
    prepared, xml, chosen, _ = plan(vmi, node_cache(cache_dir), opts, create=False, say=say)  # nothing handed: no start
    for note in prepared.notes:
        say(f"note: {note}")
    if as_json:
        click.echo(json.dumps({"domain": vmi.domain_name, "accel": chosen.to_json(), "xml": xml}, indent=2))
    else:
        click.echo(xml, nl=not xml.endswith("\n"))


def _not_nan(ctx, param, value: float) -> float:
    """A FloatRange lets `nan` through (it compares false to both bounds)."""
    if value != value:
        raise click.BadParameter("nan is not a number of seconds")
    return value


@cli.command(epilog="""\b
Examples:
  launcher run vmi.yaml --console
  launcher run vmi.yaml --detach                                     # returns once it runs: launcher console/logs/stop NAME
  launcher run vmi.yaml --console --wait-for 'login:' --timeout 300
  launcher run --connect qemu:///system --tls-verify=false vmi.yaml
  launcher run vmi.yaml --pvc data=/srv/vm-data:10Gi --console      # filesystem claim: /srv/vm-data/disk.img
  launcher run vmi.yaml --manifests ./k8s --console                  # claims bound to iSCSI/RBD PVs, ConfigMaps, Secrets
  launcher run --lazy vmi.yaml --console                             # boot while the image streams in
  launcher run vmi.yaml --pvc shared=/srv/shared --console           # a claim shared as a virtiofs filesystem
  launcher run vmi.yaml --feature-gates HostDisk --host-disk-dir /srv/vm-disks   # hostDisk volumes, only under that directory
  launcher run vmi.yaml --publish-address 0.0.0.0                    # in a pod: the pod's IP on each declared port reaches the guest
  launcher run vm.yaml --update --console                            # a VirtualMachine: boot what its tags name now, and pin that
  launcher run vmi.yaml --container-disk-dir /var/run/kubevirt-image-volume   # the pod's image volumes: no pull
  launcher run oci-archive:vm.oci.tar --console                      # a KubeVirt VM export (virtctl vmexport download --format=oci)
  launcher run oci-archive:vm.oci.tar --spec my-vm.yaml              # its disks under a spec of your own
  kubectl get vm myvm -o yaml | launcher run - --console             # the spec on stdin
  launcher run vmi.yaml --pull-policy Always --console                # ask the registry where each tag is now
""")
@click.argument("vmi_file", metavar="VMI_FILE|EXPORT|-")
@click.option("--connect", "uri", metavar="URI", help="libvirt URI (default: qemu:///system as root, else qemu:///session; as root where no system daemon answers, the qemu user's own session daemon for this cache, started on demand).")
@click.option("--console", is_flag=True, help="Stream the guest's serial console to stdout.")
@click.option("-d", "--detach", is_flag=True, help="Return once the VM has started (after --wait-for TEXT, if given); it keeps running.")
@click.option("--wait-for", metavar="TEXT", help="Exit 0 as soon as TEXT appears on the console (the VM keeps running).")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), metavar="SECONDS", help="Give up (and destroy the VM) after this long.")
@click.option("--platform", help="OS/ARCH of the images (default: this host's).")
@click.option("--lazy/--no-lazy", default=None, help="Boot containerDisks before they have arrived, through the node's disk server (default: for images built with --lazy).")
@click.option("--grace-period", type=click.FloatRange(min=0), metavar="SECONDS", help="When the VM is stopped (SIGTERM, Ctrl-C, launcher stop), how long the guest has to power off (ACPI) before it is destroyed; 0: at once.  [default: the VMI's terminationGracePeriodSeconds, else 30]")
@click.option("--publish-address", metavar="ADDRESS", help="Forward ADDRESS:PORT to the guest for every port the interfaces declare (KubeVirt's masquerade; 0.0.0.0 in a pod).")
@click.option("--io-error-patience", type=click.FloatRange(min=0, max=86400), default=45, show_default=True, metavar="SECONDS", callback=_not_nan,
              help="A VM that keeps pausing on I/O errors (a lazy disk's registry away) is resumed six times over this long"
                   " (1, 2, 4, 8, 15 and 15 s at the default), then destroyed. A pause for want of space is waited out however long.")
@click.option("--json", "as_json", is_flag=True, help='When the command returns, print {"vmi": NAMESPACE/NAME, "domain": ..., "accel": {...}, "exitCode": 0}; not with --console.')
@accel_option
@update_option
@pull_policy_option
@container_disk_dir_option
@spec_option
@ignore_unsupported_option
@cache_option
@storage_options
@registry_options
@trust_options
def run(vmi_file, uri, console, detach, wait_for, timeout, platform, lazy, grace_period, publish_address, io_error_patience, accel, update, pull_policy, container_disk_dir,
        kernel_boot_dir, own_spec, as_json, ignore_unsupported, cache_dir, store, registry: RegistryOptions) -> None:
    """Prepare every volume of a VirtualMachineInstance, define and start its domain, stay with it.

    Each containerDisk is pulled once per node and gets a qcow2 overlay of its own, so the VM
    starts clean every time. The command returns when the guest stops, when --wait-for text
    appears, once it runs with --detach, or at --timeout; Ctrl-C or SIGTERM shuts the guest down (destroyed after --grace-period)
    and removes its overlays, as `launcher stop` does.

    A VirtualMachine's first run pins each containerDisk tag to the digest it resolved to; its later
    runs boot those digests, however the tags move, until --update (`launcher ls` shows the pins).

    EXPORT (oci-archive:FILE, oci:DIR, docker://REF) is a KubeVirt VM export: its VirtualMachine
    runs with each claim its volumes name made from the export's disk of that name, decompressed
    and digest-checked into the cache once (kept, as a claim keeps what the VM writes). It may use
    only those disks; --spec FILE runs them under a VM or VMI of your own instead.

    VMI_FILE `-` reads the VMI (or VM) from stdin, as `kubectl apply -f -`.
    """
    if detach and console:
        raise click.UsageError("--detach and --console exclude each other: attach later with `launcher console NAME`")
    if as_json and console:
        raise click.UsageError("--json and --console exclude each other: the console is what stdout carries")
    # An export's own VirtualMachine may not read nor replace the pins of a VM of the user's that it names.
    pinned = own_spec is not None or not is_export(vmi_file)
    vmi_file = export_vm_file(vmi_file, cache_dir, store, registry, platform_of(platform), own_spec)
    vmi = load_vmi_file(vmi_file, ignore_unsupported, ImageHints(store.objects, registry, platform_of(platform)))
    if lazy and not container_disk_dir and any(volume.kind == "containerDisk" for volume in vmi.volumes):
        from launcher.diskserver.spawn import start_server

        # --lazy will need the node's disk server: started now, its start overlaps the run's own.
        start_server(node_cache(cache_dir), registry)
    from launcher.runtime.vms import RunOptions
    from launcher.runtime.vms import run as do_run

    opts = RunOptions(uri=uri, platform=platform_of(platform), registry=registry, console=console, wait_for=wait_for, timeout=timeout, storage=store,
                      lazy={None: "auto", True: "on", False: "off"}[lazy], grace_period=grace_period, detach=detach,
                      publish_address=publish_address, update=update, container_disk_dir=container_disk_dir,
                      kernel_boot_dir=kernel_boot_dir, accel=accel, pull_policy=pull_policy, io_error_patience=io_error_patience,
                      pinned=pinned)
    ran = do_run(vmi, node_cache(cache_dir), opts, say)
    if as_json:
        click.echo(json.dumps({"vmi": f"{vmi.namespace}/{vmi.name}", "domain": vmi.domain_name, "accel": ran.accel.to_json(), "exitCode": ran.code}, indent=2))
    sys.exit(ran.code)


@cli.command(epilog="""\b
Examples:
  launcher serve                                   # the node's disk server, until SIGTERM
  launcher serve --strict --prefetch-rate 50M      # serve verified bytes only; spare the network
  launcher serve --status --json                   # ask the running server what it exports
  launcher serve --upload-listen 0.0.0.0:8443 --manifests ./k8s --pvc fedora=/srv/claims/fedora
  launcher serve --no-disks --upload-listen :8443 --upload-tls-cert tls.crt --upload-tls-key tls.key --manifests ./k8s
""")
@click.option("--disks/--no-disks", default=True, show_default=True, help="Run the disk server (lazy images over NBD).")
@click.option("--socket-dir", type=click.Path(file_okay=False), help="Where nbd.sock and control.sock live (default: <cache>/serve).")
@click.option("--socket-group", metavar="NAME", help="Run as root: the group whose members may send the disk server requests (default: the group of user qemu, KubeVirt's; else 107 where it is named qemu or kvm; else none).")
@click.option("--strict", is_flag=True, help="Serve only verified bytes: images without chunk digests are read once the whole blob is verified.")
@click.option("--prefetch-rate", metavar="SIZE", help="Prefetch at most SIZE bytes a second (e.g. 50M); reads a VM waits for are never held back.")
@click.option("--prefetch-threads", type=click.IntRange(1, 16), default=2, show_default=True, help="Parallel range requests prefetching the rest of each disk.")
@click.option("--fetch-timeout", type=click.FloatRange(min=1), default=300, show_default=True, metavar="SECONDS", help="How long a VM's read waits through registry outages before it gets an I/O error.")
@click.option("--exit-when-idle", type=click.FloatRange(min=0), metavar="SECONDS", help="Exit once no VM has been connected and nothing was left to fetch for this long (at most 5 s once the VMs it served, or the runs that asked for them, are gone).")
@click.option("--status", "show_status", is_flag=True, help="Print what the running disk server exports instead of serving.")
@click.option("--json", "as_json", is_flag=True, help="With --status: one JSON object.")
@click.option("--upload-listen", metavar="HOST:PORT", help="Also serve the upload endpoint of upload DataVolumes here (diskkit upload sends to it).")
@click.option("--upload-tls-cert", type=click.Path(dir_okay=False, exists=True), help="Serve uploads over HTTPS with this certificate (PEM).")
@click.option("--upload-tls-key", type=click.Path(dir_okay=False, exists=True), help="The private key of --upload-tls-cert.")
@click.option("--vmi", "vmi_files", multiple=True, type=click.Path(dir_okay=False, exists=True), metavar="FILE", help="Also serve the upload dataVolumeTemplates of this VM/VMI (repeatable).")
@cache_option
@storage_options
@registry_options
@trust_options
def serve(cache_dir, registry: RegistryOptions, disks, upload_listen, upload_tls_cert, upload_tls_key, vmi_files, store, **options) -> None:
    """Serve this node's endpoints until SIGTERM or Ctrl-C: the disk server, and uploads.

    Disks: each seekable image's disk (diskkit build --lazy, or any single uncompressed layer) is
    exported read-only over NBD on <cache>/serve/nbd.sock, one export per disk for every VM on the
    node. Reads fetch the chunks they need from the registry with range requests; the rest is
    prefetched, checked chunk by chunk against the image's table of contents, and once the blob
    digest verifies the disk joins the cache, where `launcher pull` finds it. `launcher run` starts
    a disk server itself when none is running.

    Uploads (--upload-listen): every upload DataVolume of --manifests (and --vmi) accepts a disk from
    `diskkit upload` with a token from `launcher dv token`; dropped uploads resume where they
    stopped, and the disk is checked and converted to raw in its claim as an import is.
    """
    if options["show_status"]:
        _serve_status(node_cache(cache_dir), options["socket_dir"], options["as_json"])
        return
    if not disks and not upload_listen:
        raise click.UsageError("nothing to serve: --no-disks without --upload-listen")
    uploads = None
    if upload_listen:
        from launcher.cli.dv import start_uploads

        uploads = start_uploads(upload_listen, upload_tls_cert, upload_tls_key, vmi_files, cache_dir, store)
    try:
        if disks:
            _serve_disks(node_cache(cache_dir), registry, **options)
        else:
            uploads.wait()
    finally:
        if uploads is not None:
            uploads.close()


def _serve_disks(cache: Cache, registry: RegistryOptions, socket_dir, socket_group, strict, prefetch_rate, prefetch_threads, fetch_timeout,
                 exit_when_idle, show_status, as_json) -> None:
    from launcher.diskserver.lazydisk import Options
    from launcher.diskserver.server import ServeOptions, serve

    rate = parse_size(prefetch_rate, f"--prefetch-rate {prefetch_rate}") if prefetch_rate else 0
    lazy = Options(strict=strict, prefetch_threads=prefetch_threads, fetch_timeout=fetch_timeout, prefetch_rate=rate)
    serve(cache, ServeOptions(Path(socket_dir) if socket_dir else None, registry, lazy, exit_when_idle, socket_group))


def _serve_status(cache: Cache, socket_dir: str | None, as_json: bool) -> None:
    from diskkit.errors import DiskkitError
    from launcher.diskserver.control import (
        CONTROL_SOCKET,
        request,
        serve_dir,
        socket_path,
    )

    control = socket_path(serve_dir(cache, socket_dir), CONTROL_SOCKET)
    try:
        answer = request(control, {"op": "status"}, timeout=30)
    except OSError as exc:
        raise DiskkitError(control, f"no disk server answers here ({exc.strerror or exc})") from None
    if as_json:
        click.echo(json.dumps(answer, indent=2))
        return
    click.echo(f"disk server pid {answer['pid']} on {answer['socket']}, {answer['connections']} connections")
    for export in answer["exports"]:
        done = f"{export['present']}/{export['chunks']} chunks" if "chunks" in export else "complete"
        state = f"failed: {export['failed']}" if export.get("failed") else ("verified" if export.get("verified") else "fetching")
        stats = export.get("stats") or {}
        moved = f"  fetched {stats['fetched_bytes']} bytes, reused {stats['reused_bytes']} bytes" if "reused_bytes" in stats else ""
        click.echo(f"  {export['export']}  {done}  {state}{moved}  {export['description']}")


@cli.command(epilog="""\b
Examples:
  launcher stop testvm
  launcher stop default/testvm other/vm2
  launcher stop --force --grace-period=0 testvm      # destroy it at once, as virtctl stop --force --grace-period=0
""")
@click.argument("names", nargs=-1, required=True, metavar="NAME...")
@click.option("--force", is_flag=True, help="With --grace-period: give the guest that long instead of its VMI's grace period (0: destroy it at once, no power button).")
@click.option("--grace-period", type=click.IntRange(min=0), metavar="SECONDS", help="With --force: how long the guest has to power off after the power button before it is destroyed.")
@click.option("--json", "as_json", is_flag=True, help='Print {"vms": [{"name", "stopped", "domain", "message", "how", "gracePeriod", "seconds"}]};'
              ' how: "shut down" (by its guest, after the power button), "destroyed" (still running when the grace period ended, or none was given),'
              ' "unreachable" (libvirt could not be asked) or null.')
@cache_option
def stop(names, force, grace_period, as_json, cache_dir) -> None:
    """Stop VMs started by `launcher run` as `virtctl stop` does, and remove their overlays (NAME,
    NAMESPACE/NAME or domain name).

    The guest's ACPI power button is pressed (again every 5 s) and the guest given its grace period to
    power off, as a pod's termination gives it: the VMI's terminationGracePeriodSeconds, or `launcher
    run --grace-period` (30 s when neither is set); what still runs then is destroyed. Which of the two
    happened is said on stderr (and in --json). A VM that is not running (stopped already, or never
    started from this cache) is said so, and is no error: exit 0, so a cleanup step can always run.
    """
    from launcher.runtime.vms import stop as do_stop

    # virtctl's rule and words (pkg/virtctl/vm/stop.go): the grace period is the VMI's unless forced.
    if force != (grace_period is not None):
        raise click.UsageError("Must both use --force=true and set --grace-period.")
    cache = node_cache(cache_dir)
    done = []
    for name in names:
        stopped = do_stop(cache, name, grace_period, say)
        domain, how = stopped if stopped else (None, None)
        # KubeVirt's words: "VM is not running" (its stop subresource's conflict, pkg/virt-api/rest/lifecycle.go),
        # "VM NAME was scheduled to stop" (virtctl, pkg/virtctl/vm/stop.go).
        message = f"VM {name} was stopped" if domain else f"VM {name} is not running"
        done.append({"name": name, "stopped": bool(domain), "domain": domain, "message": message, "how": how and how.how,
                     "gracePeriod": how and how.grace, "seconds": how and round(how.seconds, 1)})
        if not as_json:
            click.echo(message)
    if as_json:
        click.echo(json.dumps({"vms": done}, indent=2))


@cli.command(epilog="""\b
Examples:
  launcher status testguest
  (a pod's probe)  exec: {command: [launcher, status, testguest]}
""")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help='Print {"name", "domain", "state", "reason", "message", "conditions", "memoryDumpRequest"}: reason and message KubeVirt\'s Paused condition\'s, or null; conditions as the VMI\'s status has them; memoryDumpRequest as the VM\'s (`launcher memory-dump`), or null.')
@cache_option
def status(name, as_json, cache_dir) -> None:
    """Print a VM's state (running, paused, stopped, gone, unknown), then its conditions one a line;
    exit 0 only while it runs or is paused by the user.

    paused: said with KubeVirt's reason, PausedByUser (`launcher pause`) or PausedIOError (a disk's
    I/O error stopped the guest: errorPolicy stop), the latter with the disk, the error and its
    file: `paused (PausedIOError): vda: no space left on device (FILE)`.

    Conditions, as virt-handler sets them on the VMI: `AgentConnected: True` while the qemu guest
    agent is connected, `UnsupportedAgent: True: REASON` when it lacks commands KubeVirt needs,
    `AccessCredentialsSynchronized: True|False[: MESSAGE]` once qemuGuestAgent access credentials
    were written (or failed to be).

    Made for a pod's exec readiness and liveness probes: the answer comes from libvirt, so a
    launcher that is alive with a dead guest is reported as not running. A pause the user asked for
    is healthy, as KubeVirt keeps such a VMI's phase Running and excuses it from its probe
    (virt-launcher's isPausedButHealthy): the pod is not restarted under a paused VM.

    A VM stopped since it had its memory dumped is `stopped`, with its memoryDumpRequest: the
    association outlives its runs, as a VirtualMachine's status keeps it.
    """
    from launcher.runtime import memorydump
    from launcher.runtime.conditions import PAUSED_BY_USER
    from launcher.runtime.lookup import conditions, find_record, record_of, state_and_why

    cache = node_cache(cache_dir)
    record = find_record(cache, name)
    if record is None:
        kept = memorydump.find(cache, name)
        if kept is None:
            record_of(cache, name)  # not found, in its words
        # Stopped and gone, but its memory dump association lives on, as on a stopped VirtualMachine.
        if as_json:
            click.echo(json.dumps({"name": name, "domain": kept["domain"], "state": "stopped", "reason": None, "message": None,
                                   "conditions": [], "memoryDumpRequest": kept["request"]}, indent=2))
        else:
            click.echo("stopped")
        sys.exit(1)
    now, paused = state_and_why(record, cache)
    found = conditions(record, cache, paused) if now in ("running", "paused") else []
    if as_json:
        click.echo(json.dumps({"name": name, "domain": record["domain"], "state": now, "reason": paused and paused.reason,
                               "message": paused and paused.message, "conditions": found,
                               "memoryDumpRequest": memorydump.request(cache, record["domain"])}, indent=2))
    else:
        click.echo(f"{now} ({paused.reason}): {paused.message}" if paused else now)
        for condition in found:
            if condition["type"] != "Paused":  # said on the first line
                click.echo(": ".join([f"{condition['type']}: {condition['status']}", *(condition[k] for k in ("reason", "message") if condition.get(k))]))
    if now != "running" and not (paused and paused.reason == PAUSED_BY_USER):
        sys.exit(1)


@cli.command("ls", epilog="""\b
Examples:
  launcher ls
  launcher ls --json | jq '.disks[].size'
""")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@cache_option
def ls(as_json, cache_dir) -> None:
    """List the VMs started from this cache and the disks and VM exports it holds."""
    from launcher.node.vmexport import listing as export_listing
    from launcher.runtime.lookup import state

    cache = node_cache(cache_dir)
    warn_if_open(cache)
    vms = [{**record, "state": state(record, cache)} for record in cache.vm_records()]
    disks = []
    images = cache.images_by_disk()
    for entry in cache.disks():
        meta = cache.read_json(entry / "meta.json") or {}
        users = [vm["domain"] for vm in vms if str(entry) in vm.get("entries", [])]
        disks.append({"path": str(entry / "disk.img"), "images": images.get(str(entry), []), "size": tree_size(entry),
                      "format": meta.get("format"), "layer": meta.get("layer"), "usedBy": users})
    exports = export_listing(cache, vms)
    pinned = pins_listing(cache)
    if as_json:
        click.echo(json.dumps({"vms": vms, "disks": disks, "exports": exports, "pins": pinned}, indent=2))
        return
    click.echo(f"{'VM':32} {'STATE':8} IMAGES")
    for vm in vms:
        click.echo(f"{vm['domain']:32} {vm['state']:8} {' '.join(vm['images'])}")
    click.echo(f"\n{'IMAGE':56} {'SIZE':>10}  USED BY")
    for disk in disks:
        # The image a disk came from is what users know it by; a disk no pull names any more (its
        # reference was pulled again elsewhere) shows its layer. Paths are in --json.
        shown = ",".join(disk["images"]) or f"(layer {(disk['layer'] or '?')[:19]})"
        click.echo(f"{shown:56} {disk['size'] / (1 << 20):>8.1f}Mi  {','.join(disk['usedBy']) or '-'}")
    if exports:
        click.echo(f"\n{'VM EXPORT (its claims)':56} {'SIZE':>10}  USED BY")
        for export in exports:
            shown = f"{export['vm'] or '?'} {export['manifest'][:19]}"
            click.echo(f"{shown:56} {export['size'] / (1 << 20):>8.1f}Mi  {','.join(export['usedBy']) or '-'}")
    if pinned:
        click.echo(f"\n{'PINNED (launcher run --update moves them)':56} DIGEST")
        for pin in pinned:
            click.echo(f"{pin['vm'] + ' ' + pin['volume'] + ' ' + pin['image']:56} {pin['digest']}")


@cli.command(epilog="""\b
Examples:
  launcher gc
  launcher gc --max-size 20G
""")
@click.option("--max-size", metavar="SIZE", help="Keep the cache under SIZE (e.g. 20G), removing least recently used disks first.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@cache_option
def gc(max_size, as_json, cache_dir) -> None:
    """Remove cached disks and VM exports no running VM uses (all of them, or the oldest until under --max-size)."""
    from launcher.runtime.gc import collect

    cache = node_cache(cache_dir)
    warn_if_open(cache)
    result = collect(cache, parse_size(max_size, f"--max-size {max_size}") if max_size else None)
    if as_json:
        click.echo(json.dumps(result.__dict__, indent=2))
        return
    for domain_name in result.vms_cleaned:
        click.echo(f"cleaned up stopped VM {domain_name}")
    for entry in result.removed:
        click.echo(f"removed {entry}")
    if result.locks_removed:
        click.echo(f"removed {len(result.locks_removed)} stale VM lock files")
    click.echo(f"freed {result.freed / (1 << 20):.1f} MiB; cache holds {result.kept / (1 << 20):.1f} MiB of disks")




def main() -> None:
    from launcher.runtime.reaper import init_if_pid1

    init_if_pid1()  # a pod's container without shareProcessNamespace makes the launcher PID 1
    run_main(cli, "launcher")

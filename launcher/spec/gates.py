"""Feature gates: what a cluster admin turns on in KubeVirt's CR, given here with --feature-gates.

KubeVirt admits a hostDisk volume only with its HostDisk gate on (off by default:
pkg/virt-api/webhooks/validating-webhook/admitters/vmi-create-admitter.go, validateVolumes, "HostDisk
feature gate is not enabled"), because the disk is any file on the node, chowned to qemu by libvirt
and written by the guest. Here the gate alone is not enough: a node user's VMI could still name
/etc/shadow, so a hostDisk must also lie under a directory the node's admin allowed
(--host-disk-dir), checked here on the path as written and by launcher.volumes.localdisks on the
filesystem (no symlink anywhere below the allowed directory).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Iterable

from launcher.spec.fields import SpecError

HOST_DISK = "HostDisk"
SIDECAR = "Sidecar"  # hook sidecars (launcher.spec.hooks)
DOWNWARD_METRICS = "DownwardMetrics"  # the node's and the VM's load shown to the guest
# SCSI persistent reservations on a lun: KubeVirt's legacy gate name, which still turns them on where the
# KubeVirt CR sets no persistentReservationConfiguration (pkg/virt-config/virt-config.go PersistentReservationEnabled)
PERSISTENT_RESERVATION = "PersistentReservation"
KNOWN = (HOST_DISK, SIDECAR, DOWNWARD_METRICS, PERSISTENT_RESERVATION)


@dataclass(frozen=True)
class FeatureGates:
    enabled: frozenset[str] = frozenset()
    host_disk_dirs: tuple[str, ...] = ()  # absolute, normalised; a hostDisk must lie below one of them

    def on(self, gate: str) -> bool:
        return gate in self.enabled


def parse_gates(gates: Iterable[str], host_disk_dirs: Iterable[str] = ()) -> FeatureGates:
    """--feature-gates values (repeatable, comma-separated, KubeVirt's names) and --host-disk-dir values."""
    enabled = set()
    for value in gates:
        for name in filter(None, (part.strip() for part in value.split(","))):
            if name not in KNOWN:
                raise SpecError(f"--feature-gates {name}", f"unknown feature gate (this launcher knows {', '.join(KNOWN)})")
            enabled.add(name)
    dirs = []
    for value in host_disk_dirs:
        if not value.startswith("/") or _clean(value) != value.rstrip("/") or value == "/":
            raise SpecError(f"--host-disk-dir {value}", "must be an absolute, clean path to a directory other than /")
        dirs.append(value.rstrip("/"))
    if dirs and HOST_DISK not in enabled:
        raise SpecError("--host-disk-dir", f"allows hostDisk paths, which need --feature-gates {HOST_DISK}")
    return FeatureGates(frozenset(enabled), tuple(dirs))


def _clean(path: str) -> str:
    return posixpath.normpath(path) if path else path


def admit_host_disks(volumes, gates: FeatureGates) -> None:
    """Refuse, before anything is pulled or made, a hostDisk the gates do not let this node attach."""
    for volume in volumes:
        if volume.kind != "hostDisk":
            continue
        at = f"spec.volumes[{volume.index}]"
        if not gates.on(HOST_DISK):
            raise SpecError(at, f"{HOST_DISK} feature gate is not enabled")
        path = volume.source.path
        if not path.startswith("/") or _clean(path) != path:
            raise SpecError(f"{at}.hostDisk.path", "must be an absolute path without relative components (., .., //)")
        if allowed_dir(path, gates) is None:
            shown = ", ".join(gates.host_disk_dirs) or "none given"
            raise SpecError(f"{at}.hostDisk.path", f"{path} is not under a directory allowed for hostDisks (--host-disk-dir: {shown})")


def allowed_dir(path: str, gates: FeatureGates) -> str | None:
    """The allowed directory `path` lies strictly below, if any."""
    for directory in gates.host_disk_dirs:
        if path.startswith(directory + "/"):
            return directory
    return None


def admit_downward_metrics(vmi, gates: FeatureGates) -> None:
    """vmi-create-admitter.go validateVolumes and validateDownwardMetrics: the metrics disk and the
    virtio-serial port behind KubeVirt's DownwardMetrics gate (off by default), in its words. With the
    gate on, the disk is made and refreshed (launcher.volumes.vhostmd); the port is refused, since
    nothing here answers it as virt-handler does (pkg/downwardmetrics/virtio-serial/server.go) and a
    guest's vm-dump-metrics would wait on it for ever."""
    at = "spec.template.spec" if vmi.from_vm else "spec"
    if not gates.on(DOWNWARD_METRICS):
        for volume in vmi.volumes:
            if volume.kind == "downwardMetrics":
                raise SpecError(f"{at}.volumes[{volume.index}]", "downwardMetrics disks are not allowed: DownwardMetrics feature gate is not enabled.")
    if vmi.domain.devices.downward_metrics:
        if not gates.on(DOWNWARD_METRICS):
            raise SpecError(f"{at}.domain.devices.downwardMetrics", "downwardMetrics virtio serial is not allowed: DownwardMetrics feature gate is not enabled")
        raise SpecError(f"{at}.domain.devices.downwardMetrics", "its virtio-serial port needs virt-handler's metrics server, which the launcher does not"
                                                                " run: not supported by the launcher (a downwardMetrics volume gives the guest the same metrics)")


def admit_persistent_reservation(vmi, gates: FeatureGates) -> None:
    """vmi-create-admitter.go validatePersistentReservation: any lun with `reservation: true` needs the
    cluster to have persistent reservations on (off by default), refused in KubeVirt's words and at its
    field path (sic: `luns`, no index). Which luns can have one here is the domain's concern
    (launcher.render.domain: an iSCSI lun on bus scsi only)."""
    if gates.on(PERSISTENT_RESERVATION) or not any(d.reservation for d in vmi.domain.devices.disks):
        return
    at = "spec.template.spec" if vmi.from_vm else "spec"
    raise SpecError(f"{at}.domain.devices.disks.luns.reservation", "persistent reservation is not enabled in kubevirt config")

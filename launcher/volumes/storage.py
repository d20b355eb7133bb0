"""Where a VM's claims and config objects live on this node: `--pvc`, manifests, or virt-launcher's mounts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from launcher.spec.gates import FeatureGates
from launcher.spec.k8s import Claim, Objects
from launcher.volumes import sizing

POD_DISKS = Path("/var/run/kubevirt-private/vmi-disks")  # virt-launcher's mounts, by volume name
POD_CONFIG = Path("/var/run/kubevirt-private")  # where virt-launcher finds config volumes, by kind and name
SERVICE_ACCOUNT_MOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class LocalClaim:
    """`--pvc CLAIM=PATH[:SIZE]`: a directory (filesystem mode) or a block device for a claim."""

    path: Path
    size: int | None = None


@dataclass
class Storage:
    pvcs: dict[str, LocalClaim] = field(default_factory=dict)
    objects: Objects | None = None
    tolerance: int = sizing.TOLERANCE
    pod_disks: Path = POD_DISKS
    pod_config: Path = POD_CONFIG  # config volumes as mounted in virt-launcher's pod
    service_account_dir: Path = SERVICE_ACCOUNT_MOUNT
    gates: FeatureGates = field(default_factory=FeatureGates)  # --feature-gates, --host-disk-dir
    # Where `objects` came from, for a helper that reads them again (launcher.runtime.credsync):
    # the --manifests directory, or the API (--kube-api); neither: the pod's mounts.
    manifests: Path | None = None
    kube_api: bool = False


def pv_path(claim: Claim) -> LocalClaim | None:
    """hostPath and local PVs name a directory on this node: the claim's disk.img lives there."""
    spec = (claim.pv or {}).get("spec") or {}
    for key in ("hostPath", "local"):
        path = (spec.get(key) or {}).get("path")
        if path:
            return LocalClaim(Path(path))
    return None

"""Where a VM's claims and config objects live on this node: `--pvc`, manifests, or virt-launcher's mounts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from launcher.spec.gates import FeatureGates
from launcher.spec.k8s import Claim, Objects
from launcher.volumes import gendisks, sizing

POD_DISKS = Path("/var/run/kubevirt-private/vmi-disks")  # virt-launcher's mounts, by volume name


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
    pod_config: Path = gendisks.POD_CONFIG  # config volumes as mounted in virt-launcher's pod
    service_account_dir: Path = gendisks.Sources.service_account_dir
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

"""What every volume kind is prepared with: the VM, where its files go, and what has been made so far."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from diskkit.oci.image import Platform
from diskkit.registry.options import RegistryOptions
from launcher.node.cache import QEMU_ID, Cache
from launcher.node.pins import Pin
from launcher.node.pull import Pulled
from launcher.render.domain import ResolvedDisk
from launcher.spec.k8s import NetworkSource
from launcher.spec.vmi import VMI
from launcher.volumes.storage import Storage


@dataclass(frozen=True)
class Share:
    """The directory a filesystem's virtiofsd serves; read_only as the kubelet mounts config volumes."""

    path: Path
    read_only: bool = False


@dataclass
class Prepared:
    disks: dict[str, ResolvedDisk] = field(default_factory=dict)
    shares: dict[str, Share] = field(default_factory=dict)  # filesystem name -> what its virtiofsd serves
    kernel: str | None = None
    initrd: str | None = None
    pulled: list[Pulled] = field(default_factory=list)
    secrets: list[tuple[NetworkSource, bytes]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    pins: dict[str, Pin] = field(default_factory=dict)  # volume -> the digest its tag resolved to (a VirtualMachine's)
    efi: tuple[str, str, str] | None = None  # EFI's code, its variable-store template, the VM's store (launcher.volumes.vmstate)


@dataclass
class Context:
    vmi: VMI
    cache: Cache
    run_dir: Path
    registry: RegistryOptions | None
    platform: Platform | None
    create: bool  # False for the dry run of `launcher domain`: paths are planned, not made
    store: Storage
    lazy: str = "off"
    qemu_uid: int | None = None  # a root launcher's qemu on a session daemon runs as this user
    qemu: tuple[int, int] = (QEMU_ID, QEMU_ID)  # whom qemu runs as: what the launcher gives it is that user's
    pins: dict[str, Pin] | None = None  # a VirtualMachine's pins from its last run; None: a VMI, nothing is pinned
    update: bool = False  # resolve the tags again instead of booting the pinned digests
    image_volumes: Path | None = None  # where the pod mounts each containerDisk's image (launcher.volumes.imagevolume)
    kernel_boot_dir: Path | None = None  # where the pod mounts the kernelBoot container's image
    pull_policy: str | None = None  # --pull-policy: every image's imagePullPolicy, whatever the spec says
    trace: str | None = None  # --record-trace: the token the disk server records each lazy containerDisk's reads under
    out: Prepared = field(default_factory=Prepared)

    def note(self, text: str | None) -> None:
        if text and text not in self.out.notes:  # a kernel and an initrd of one cached image: said once
            self.out.notes.append(text)

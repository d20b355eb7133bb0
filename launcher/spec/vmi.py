"""Typed KubeVirt VirtualMachineInstance specs: parsing, KubeVirt's defaulting and its validation (pure).

`parse_vmi` returns the VMI as KubeVirt's mutating webhook would leave it (disk buses, device types,
cdrom readOnly/tray, a disk for every volume no filesystem shares, CPU request from the limit) and
rejects what its validating webhook would reject, with its wording where it has one
(pkg/defaults, pkg/virt-api/webhooks/validating-webhook/admitters, pkg/storage/admitters).

Errors are `SpecError(field_path, rule)`. When KubeVirt's message starts with the field path, the path
becomes the subject and the rest of the message the rule; otherwise the rule is its message whole.
"""

from __future__ import annotations

import base64
import binascii
import re
import uuid as uuidlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

from diskkit.disk.containerdisk import path_problem
from launcher.spec import coverage, credentials, hostdevices, hyperv
from launcher.spec.clock import Clock, parse_clock
from launcher.spec.datavolume import templates
from launcher.spec.dns import check_dns
from launcher.spec.fields import (
    SpecError,
    as_list,
    as_map,
    check_dns_label,
    check_one_of,
    did_you_mean,
    dns_label_problems,
    dns_subdomain_problems,
    field_error,
    get_bool,
    get_int,
    get_quantity,
    get_str,
    to_bytes,
    to_millis,
)
from launcher.spec.instancetype import ObjectSource, expand
from launcher.spec.meta import (
    check_annotations,
    check_labels,
    check_namespace,
    check_subdomain,
    check_xml_text,
    domain_name,
    load_documents,
    shown_path,
)
from launcher.spec.network import Interface, parse_interfaces

API_VERSION = "kubevirt.io/v1"
# v1alpha3 is deprecated but still served, with the same schema (CDI's examples use it).
API_VERSIONS = (API_VERSION, "kubevirt.io/v1alpha3")
DEFAULT_NAMESPACE = "default"
DEFAULT_MACHINE = "q35"
# pkg/virt-config: DefaultAMD64EmulatedMachines
EMULATED_MACHINES = ("q35*", "pc-q35*")
# staging/src/kubevirt.io/api/core/v1/schema.go: DefaultCPUModel
DEFAULT_CPU_MODEL = "host-model"
# pkg/virt-controller/watch/vm/firmware.go: the namespace of KubeVirt's legacy firmware UUIDs
FIRMWARE_UUID_NAMESPACE = uuidlib.UUID("6a1a24a1-4061-4607-8bf4-a3963d0c5895")

# pkg/defaults/amd64.go setDefaultAmd64DisksBus: SATA for disk, cdrom AND lun when bus is unset
# ("typically supported out of the box by guest operating systems"; q35 has no IDE). The older
# virtio default for disks is gone from KubeVirt; arm64/s390x default to virtio, amd64 does not.
DEFAULT_BUS = "sata"
BUSES = ("virtio", "scsi", "sata", "usb")
DEVICES = ("disk", "cdrom", "lun")
CACHE_MODES = ("none", "writethrough", "writeback")
IO_MODES = ("native", "threads")
ERROR_POLICIES = ("stop", "ignore", "report", "enospace")
IO_THREADS_POLICIES = ("shared", "auto")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
TRAY_STATES = ("open", "closed")
# staging/src/kubevirt.io/api/core/v1/schema.go InputBus; a tablet is the one type the admitter takes
INPUT_BUSES = ("virtio", "usb")
# pkg/virt-api/webhooks/amd64.go validateVideoTypeAmd64
VIDEO_TYPES = ("vga", "cirrus", "virtio", "ramfb", "bochs")

VOLUME_KINDS = (
    "containerDisk", "persistentVolumeClaim", "dataVolume", "emptyDisk", "hostDisk", "ephemeral",
    "cloudInitNoCloud", "cloudInitConfigDrive", "configMap", "secret", "serviceAccount", "downwardAPI",
    "downwardMetrics", "sysprep", "memoryDump",
)

# Contents of cloud-init files, never in the domain XML or a file name (keys of cloudInitNoCloud/ConfigDrive).
CLOUD_INIT_CONTENT = frozenset({"userData", "networkData"})
_SERIAL = re.compile(r"[A-Za-z0-9_.+-]+")
_PCI_ADDRESS = re.compile(r"([0-9a-fA-F]{4}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])")


# ---------------------------------------------------------------- models

@dataclass(frozen=True)
class ContainerDiskSource:
    image: str
    path: str | None = None
    image_pull_policy: str | None = None  # as written; see pull_policy for the effective one
    image_pull_secret: str | None = None  # a kubernetes.io/dockerconfigjson or dockercfg Secret's name

    @property
    def pull_policy(self) -> str:
        """pkg/defaults setDefaultPullPoliciesOnContainerDisks."""
        if self.image_pull_policy:
            return self.image_pull_policy
        if self.image.endswith(":latest") or not any(c in self.image for c in ":@"):
            return "Always"
        return "IfNotPresent"


@dataclass(frozen=True)
class PersistentVolumeClaimSource:
    claim_name: str
    read_only: bool = False
    hotpluggable: bool = False


@dataclass(frozen=True)
class DataVolumeSource:
    name: str
    hotpluggable: bool = False


@dataclass(frozen=True)
class EphemeralSource:
    claim_name: str
    read_only: bool = False


@dataclass(frozen=True)
class EmptyDiskSource:
    capacity: int  # bytes


@dataclass(frozen=True)
class HostDiskSource:
    path: str
    type: str  # "Disk" | "DiskOrCreate"
    capacity: int | None = None  # bytes
    shared: bool = False


@dataclass(frozen=True)
class ConfigMapSource:
    name: str
    optional: bool = False
    volume_label: str | None = None


@dataclass(frozen=True)
class SecretSource:
    secret_name: str
    optional: bool = False
    volume_label: str | None = None


@dataclass(frozen=True)
class ServiceAccountSource:
    service_account_name: str


@dataclass(frozen=True)
class CloudInitSource:
    """cloudInitNoCloud / cloudInitConfigDrive: inline data already decoded (base64 checked here, as
    KubeVirt's admitter does), or the name of a Secret holding `userdata` / `networkdata`."""

    user_data: bytes | None = None
    user_data_secret: str | None = None
    network_data: bytes | None = None
    network_data_secret: str | None = None


@dataclass(frozen=True)
class DownwardAPIFile:
    path: str
    field_path: str  # metadata.name, metadata.labels, metadata.labels['key'], ...
    mode: int | None = None


@dataclass(frozen=True)
class DownwardAPISource:
    fields: tuple[DownwardAPIFile, ...] = ()
    volume_label: str | None = None


@dataclass(frozen=True)
class DownwardMetricsSource:
    pass


@dataclass(frozen=True)
class SysprepSource:
    """A Windows answer file (autounattend.xml or unattend.xml) from a ConfigMap or a Secret, on a CD-ROM."""

    config_map: str | None = None
    secret: str | None = None  # wins over config_map, as virt-controller mounts it (sysprepVolumeSource)


VolumeSource = (ContainerDiskSource | PersistentVolumeClaimSource | DataVolumeSource | EphemeralSource
                | EmptyDiskSource | HostDiskSource | ConfigMapSource | SecretSource | ServiceAccountSource
                | CloudInitSource | DownwardAPISource | DownwardMetricsSource | SysprepSource)


@dataclass(frozen=True)
class Volume:
    name: str
    kind: str  # the KubeVirt key, one of VOLUME_KINDS
    source: VolumeSource
    index: int = 0  # position in spec.volumes (KubeVirt numbers containerDisk files by it)


@dataclass(frozen=True)
class Disk:
    name: str
    device: str = "disk"  # "disk" | "cdrom" | "lun"
    bus: str | None = DEFAULT_BUS  # always set after parse_vmi (KubeVirt's defaulting)
    boot_order: int | None = None
    serial: str | None = None
    read_only: bool = False  # cdrom: True unless readOnly: false
    cache: str | None = None  # None = decided by the direct I/O probe
    io: str | None = None
    dedicated_io_thread: bool = False
    shareable: bool = False
    error_policy: str = "stop"
    tag: str | None = None
    tray: str | None = None  # cdrom only: "open" | "closed"
    pci_address: str | None = None
    index: int | None = None  # position in spec.domain.devices.disks, defaulted disks after the given ones
    defaulted: bool = False  # added for a volume without a disk (util.SetDefaultVolumeDisk)
    block_size: tuple[int, int, int | None] | None = None  # blockSize.custom: (logical, physical, discardGranularity)
    match_volume_block_size: bool = False  # blockSize.matchVolume: the backend's sizes, found when it is opened
    reservation: bool = False  # lun.reservation: SCSI persistent reservations (launcher.spec.gates, launcher.render.domain)


@dataclass(frozen=True)
class Filesystem:
    """spec.domain.devices.filesystems[]: a volume shared with the guest (virtiofs, the only type
    KubeVirt has), mounted in the guest by its name as the tag."""

    name: str
    index: int = 0  # position in spec.domain.devices.filesystems


@dataclass(frozen=True)
class Input:
    """spec.domain.devices.inputs[]: a tablet, on usb unless virtio is asked for (api SetDefaults_Input)."""

    name: str
    bus: str = "usb"
    type: str = "tablet"


@dataclass(frozen=True)
class CPU:
    cores: int | None = None
    sockets: int | None = None
    threads: int | None = None
    model: str | None = None
    dedicated_cpu_placement: bool = False
    isolate_emulator_thread: bool = False
    # (name, policy) KubeVirt's defaults add: vmx, required, for an enabled evmcs (launcher.spec.hyperv)
    features: tuple[tuple[str, str], ...] = ()
    max_sockets: int | None = None  # the sockets CPU hotplug may fill (launcher.render.domain renders them)


@dataclass(frozen=True)
class Resources:
    requests_memory: int | None = None  # bytes
    limits_memory: int | None = None
    requests_cpu: int | None = None  # millicores; defaults to the limit, as KubeVirt does
    limits_cpu: int | None = None


@dataclass(frozen=True)
class KernelBootContainer:
    image: str
    kernel_path: str | None = None
    initrd_path: str | None = None
    image_pull_policy: str | None = None
    image_pull_secret: str | None = None


@dataclass(frozen=True)
class KernelBoot:
    kernel_args: str | None = None
    container: KernelBootContainer | None = None


@dataclass(frozen=True)
class Firmware:
    uuid: str | None = None
    serial: str | None = None
    bootloader: str | None = None  # "bios" | "efi" | None
    secure_boot: bool = False  # EFI only; KubeVirt defaults it to true
    bios_use_serial: bool = False
    kernel_boot: KernelBoot | None = None
    efi_persistent: bool = False  # bootloader.efi.persistent: the variable store outlives the VM's runs


@dataclass(frozen=True)
class Features:
    acpi: bool = True  # KubeVirt enables ACPI unless features.acpi.enabled is false
    apic: bool = False
    smm: bool = False
    hyperv: hyperv.Hyperv | None = None  # features.hyperv, its requirements turned on
    hyperv_passthrough: bool = False  # features.hypervPassthrough.enabled
    kvm_hidden: bool | None = None  # features.kvm.hidden; None: no features.kvm
    pvspinlock: bool | None = None  # features.pvspinlock.enabled; None: not given


@dataclass(frozen=True)
class TPM:
    """devices.tpm: a TPM 2.0 emulated by swtpm; `persistent` keeps its state from one run to the next."""

    persistent: bool = False


@dataclass(frozen=True)
class Devices:
    disks: tuple[Disk, ...] = ()
    autoattach_serial_console: bool = True
    block_multi_queue: bool = False
    use_virtio_transitional: bool = False
    disable_hotplug: bool = False  # KubeVirt adds a SCSI controller for hotplugged volumes unless this is set
    filesystems: tuple[Filesystem, ...] = ()
    rng: bool = False  # devices.rng: {} gives the guest a virtio RNG fed by the host's /dev/urandom
    tpm: TPM | None = None  # pkg/tpm HasDevice: given and not disabled
    interfaces: tuple[Interface, ...] = ()  # launcher.spec.network: the NICs, defaulted (pod and Multus bridge networks)
    autoattach_graphics: bool = True  # the VNC display and its video card
    autoattach_mem_balloon: bool = True
    inputs: tuple[Input, ...] = ()
    video: str | None = None  # devices.video.type; None: the architecture's default card
    network_multiqueue: bool = False  # networkInterfaceMultiqueue: a queue per vCPU on virtio NICs
    downward_metrics: bool = False  # devices.downwardMetrics: vhostmd's virtio-serial port (launcher.spec.gates)


@dataclass(frozen=True)
class DomainSpec:
    cpu: CPU = CPU()
    memory: int | None = None  # spec.domain.memory.guest, bytes
    resources: Resources = Resources()
    machine_type: str = DEFAULT_MACHINE
    firmware: Firmware = Firmware()
    features: Features = Features()
    devices: Devices = Devices()
    io_threads_policy: str | None = None
    clock: Clock | None = None  # spec.domain.clock (launcher.spec.clock)

    @property
    def guest_memory(self) -> int:
        """vcpu.GetVirtualMemory: guest, else the request (parse_vmi ensures one is there)."""
        if self.memory is not None:
            return self.memory
        return self.resources.requests_memory or 0

    @property
    def topology(self) -> tuple[int, int, int]:
        """(sockets, cores, threads) as vcpu.GetCPUTopology: unset counts are 1; with none set, the
        CPU limit (else request), rounded up, becomes the socket count."""
        cpu = self.cpu
        if not (cpu.sockets or cpu.cores or cpu.threads):
            millis = self.resources.limits_cpu if self.resources.limits_cpu is not None else self.resources.requests_cpu
            return (max(1, -(-millis // 1000)) if millis is not None else 1), 1, 1  # integers: no float overflow
        return cpu.sockets or 1, cpu.cores or 1, cpu.threads or 1

    @property
    def vcpus(self) -> int:
        sockets, cores, threads = self.topology
        return sockets * cores * threads


@dataclass(frozen=True)
class VMI:
    name: str
    namespace: str
    uid: str | None
    labels: dict = field(hash=False)
    annotations: dict = field(hash=False)
    domain: DomainSpec
    volumes: tuple[Volume, ...]
    hostname: str | None = None  # spec.hostname
    # spec.terminationGracePeriodSeconds: how long a stopping guest has to power off (None: KubeVirt's default)
    grace_period: int | None = None
    data_volume_templates: tuple = ()  # launcher.datavolume.DataVolume, from spec.dataVolumeTemplates
    ignored: tuple[tuple[str, str], ...] = ()  # (field, why) dropped because the user asked to go on without them
    access_credentials: tuple[credentials.SSHPublicKey, ...] = ()  # spec.accessCredentials
    from_vm: bool = False  # a VirtualMachine's: its restarts boot the digests its tags were pinned to
    # spec.livenessProbe's handler (exec, httpGet, tcpSocket, guestAgentPing), or None: not run here, but
    # KubeVirt refuses to pause a VMI whose probe a frozen guest would fail (launcher.runtime.conditions)
    liveness_probe: str | None = None
    # The spec as given (a VirtualMachine's template spec), for what hands the VMI on whole (hook sidecars)
    spec_document: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def domain_name(self) -> str:
        return domain_name(self.namespace, self.name)

    @property
    def uuid(self) -> str:
        """firmware.uuid, else stable across restarts: uuid5 of namespace/name (KubeVirt's own default
        for bare VMIs is random; VMs get uuid5 of the name in the same namespace UUID)."""
        if self.domain.firmware.uuid:
            return self.domain.firmware.uuid
        return str(uuidlib.uuid5(FIRMWARE_UUID_NAMESPACE, f"{self.namespace}/{self.name}"))

    def volume(self, name: str) -> Volume:
        for volume in self.volumes:
            if volume.name == name:
                return volume
        raise SpecError("spec.volumes", f"no volume named {name}")

    def disk(self, name: str) -> Disk:
        for disk in self.domain.devices.disks:
            if disk.name == name:
                return disk
        raise SpecError("spec.domain.devices.disks", f"no disk named {name}")


def _path(value: str, at: str) -> None:
    problem = path_problem(value)
    if problem:
        raise SpecError(at, problem)


# ---------------------------------------------------------------- volumes

def _volume_source(kind: str, doc: dict, at: str) -> VolumeSource:
    if kind == "containerDisk":
        image = get_str(doc, "image", at, required=True)
        path = get_str(doc, "path", at)
        if path is not None:
            _path(path, f"{at}.path")
        policy = get_str(doc, "imagePullPolicy", at)
        check_one_of(policy, PULL_POLICIES, f"{at}.imagePullPolicy")
        return ContainerDiskSource(image, path, policy, get_str(doc, "imagePullSecret", at) or None)
    if kind == "persistentVolumeClaim":
        return PersistentVolumeClaimSource(get_str(doc, "claimName", at, required=True),
                                           get_bool(doc, "readOnly", at), get_bool(doc, "hotpluggable", at))
    if kind == "dataVolume":
        if not doc.get("name"):
            raise SpecError(f"{at}.name", "DataVolume 'name' must be set")
        return DataVolumeSource(get_str(doc, "name", at), get_bool(doc, "hotpluggable", at))
    if kind == "ephemeral":
        claim = as_map(doc.get("persistentVolumeClaim"), f"{at}.persistentVolumeClaim")
        return EphemeralSource(get_str(claim, "claimName", f"{at}.persistentVolumeClaim", required=True),
                               get_bool(claim, "readOnly", f"{at}.persistentVolumeClaim"))
    if kind == "emptyDisk":
        capacity = get_quantity(doc, "capacity", at)
        if capacity is None:
            raise SpecError(f"{at}.capacity", "required")
        return EmptyDiskSource(to_bytes(capacity))
    if kind == "hostDisk":
        path = get_str(doc, "path", at)
        if path is None:
            raise field_error(f"{at}.path", f"{at}.path is required for hostDisk volume")
        disk_type = get_str(doc, "type", at)
        if disk_type not in ("Disk", "DiskOrCreate"):
            raise field_error(f"{at}.type", f"{at}.type has invalid value '{disk_type or ''}', allowed are 'Disk' or 'DiskOrCreate'")
        capacity = get_quantity(doc, "capacity", at)
        if capacity and disk_type != "DiskOrCreate":  # !Capacity.IsZero(): a zero capacity passes
            raise field_error(f"{at}.capacity", f"{at}.capacity is allowed to pass only with {at}.type equal to 'DiskOrCreate'")
        return HostDiskSource(path, disk_type, None if capacity is None else to_bytes(capacity), get_bool(doc, "shared", at))
    if kind == "configMap":
        return ConfigMapSource(get_str(doc, "name", at, required=True), get_bool(doc, "optional", at), get_str(doc, "volumeLabel", at))
    if kind == "secret":
        return SecretSource(get_str(doc, "secretName", at, required=True), get_bool(doc, "optional", at), get_str(doc, "volumeLabel", at))
    if kind == "serviceAccount":
        return ServiceAccountSource(get_str(doc, "serviceAccountName", at, required=True))
    if kind in ("cloudInitNoCloud", "cloudInitConfigDrive"):
        return _cloud_init(doc, at)
    if kind == "downwardAPI":
        items = as_list(doc.get("fields"), f"{at}.fields")
        files = tuple(_downward_api_file(as_map(item, f"{at}.fields[{i}]"), f"{at}.fields[{i}]") for i, item in enumerate(items))
        seen: dict[str, int] = {}
        for i, item in enumerate(files):
            if item.path in seen:
                raise SpecError(f"{at}.fields[{i}].path", f'Duplicate value: "{item.path}"')
            seen[item.path] = i
        return DownwardAPISource(files, get_str(doc, "volumeLabel", at))
    if kind == "downwardMetrics":
        return DownwardMetricsSource()
    if kind == "sysprep":
        refs = {key: get_str(as_map(doc.get(key), f"{at}.{key}"), "name", f"{at}.{key}") for key in ("configMap", "secret")}
        if refs["configMap"] is None and refs["secret"] is None:
            # pkg/virt-controller/services/template.go sysprepVolumeSource, when it renders the pod
            raise SpecError(at, "Sysprep must have Secret or ConfigMap reference set")
        return SysprepSource(refs["configMap"], refs["secret"])
    raise SpecError(at, "this volume type is not supported by the launcher")


# pkg/virt-api/webhooks/validating-webhook/admitters: cloudInitUserMaxLen, cloudInitNetworkMaxLen
CLOUD_INIT_USER_MAX = 2048
CLOUD_INIT_NETWORK_MAX = 2048


def _base64(text: str, at: str) -> bytes:
    # Go's base64.StdEncoding: padding required, line breaks skipped.
    try:
        return base64.b64decode(text.replace("\r", "").replace("\n", ""), validate=True)
    except (binascii.Error, ValueError):
        # KubeVirt's message repeats the child path after the field path (a slip); the field once is enough.
        raise SpecError(at, "is not a valid base64 value.") from None


def _cloud_init(doc: dict, at: str) -> CloudInitSource:
    """The admitter's checks on cloud-init data: one source each for user and network data, valid
    base64, the 2 KiB limits for inline data, at least one of the two."""
    found = {}
    # api core/v1 schema.go: the user data's Secret is `secretRef`, the network data's `networkDataSecretRef`.
    for what, key, limit, name in (("userData", "secretRef", CLOUD_INIT_USER_MAX, "UserDataSecretRef"),
                                   ("networkData", "networkDataSecretRef", CLOUD_INIT_NETWORK_MAX, "NetworkDataSecretRef")):
        ref = as_map(doc.get(key), f"{at}.{key}")
        secret = get_str(ref, "name", f"{at}.{key}")
        encoded = get_str(doc, f"{what}Base64", at)
        plain = doc.get(what)
        if plain is not None and not isinstance(plain, str):
            raise SpecError(f"{at}.{what}", "must be a string")
        count = sum(1 for v in (secret, encoded, plain or None) if v)
        data = _base64(encoded, f"{at}.{what}Base64") if encoded else None
        if plain:
            data = plain.encode()
        if count > 1:
            noun = "userdatasource" if what == "userData" else "networkdata source"
            raise field_error(at, f"{at} must have only one {noun} set.")
        if data is not None and len(data) > limit:
            raise field_error(at, f"{at} {what.lower()} exceeds {limit} byte limit. Should use {name} for larger data.")
        found[what] = (data, secret)
    (user, user_secret), (network, network_secret) = found["userData"], found["networkData"]
    if not (user_secret or user is not None or network_secret or network is not None):
        raise field_error(at, f"{at} must have at least one userdatasource or one networkdatasource set.")
    return CloudInitSource(user, user_secret, network, network_secret)


# k8s.io/kubernetes pkg/apis/core/validation: validVolumeDownwardAPIFieldPathExpressions
DOWNWARD_API_FIELDS = ("metadata.annotations", "metadata.labels", "metadata.name", "metadata.namespace", "metadata.uid")
_SUBSCRIPTED = re.compile(r"metadata\.(labels|annotations)\['([^']*)'\]")


def _downward_api_file(doc: dict, at: str) -> DownwardAPIFile:
    path = get_str(doc, "path", at, required=True)
    # validateLocalDescendingPath
    if path.startswith("/"):
        raise SpecError(f"{at}.path", "must be a relative path")
    if ".." in path.split("/"):
        raise SpecError(f"{at}.path", "must not contain '..'")
    if path.startswith(".."):
        raise SpecError(f"{at}.path", "must not start with '..'")
    if doc.get("resourceFieldRef") is not None:
        raise SpecError(f"{at}.resourceFieldRef", "container resources are not supported by the launcher (a VMI has no containers)")
    ref = doc.get("fieldRef")
    if ref is None:
        raise SpecError(at, "must specify one of: `fieldRef` or `resourceFieldRef`")
    ref = as_map(ref, f"{at}.fieldRef")
    field_path = get_str(ref, "fieldPath", f"{at}.fieldRef", required=True)
    version = get_str(ref, "apiVersion", f"{at}.fieldRef") or "v1"
    if version != "v1":
        raise SpecError(f"{at}.fieldRef.apiVersion", f'Unsupported value: "{version}": supported values: "v1"')
    if field_path not in DOWNWARD_API_FIELDS and not _SUBSCRIPTED.fullmatch(field_path):
        check_one_of(field_path, DOWNWARD_API_FIELDS, f"{at}.fieldRef.fieldPath")
    mode = doc.get("mode")
    if mode is not None and (isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777):
        raise SpecError(f"{at}.mode", "must be a number between 0 and 0777 (octal), both inclusive")
    return DownwardAPIFile(path, field_path, mode)


def _named(items: list, at: str) -> Iterator[tuple[int, str, dict, str]]:
    """(index, where, item, name) of a list whose items carry unique DNS-label names, as KubeVirt's admitter
    checks volumes and filesystems."""
    seen: dict[str, int] = {}
    for idx, item in enumerate(items):
        where = f"{at}[{idx}]"
        doc = as_map(item, where)
        name = get_str(doc, "name", where, required=True)
        check_dns_label(name, f"{where}.name")
        if name in seen:
            raise field_error(f"{where}.name", f"{where} and {at}[{seen[name]}] must not have the same Name.")
        seen[name] = idx
        yield idx, where, doc, name


def _volumes(items: list, at: str) -> tuple[Volume, ...]:
    volumes, dumps = [], []
    counts = {"serviceAccount": 0, "downwardMetrics": 0, "memoryDump": 0}
    for idx, vat, doc, name in _named(items, at):
        kinds = [k for k in VOLUME_KINDS if doc.get(k) is not None]
        if len(kinds) != 1:
            raise field_error(vat, f"{vat} must have exactly one source type set")
        kind = kinds[0]
        if kind in counts:
            counts[kind] += 1
            if counts[kind] > 1:
                what = "memory dump" if kind == "memoryDump" else kind.removesuffix("s")
                raise field_error(at, f"{at} must have max one {what} volume set")
        if kind == "memoryDump":
            dumps.append(vat)
            continue
        source = _volume_source(kind, as_map(doc[kind], f"{vat}.{kind}"), f"{vat}.{kind}")
        volumes.append(Volume(name, kind, source, idx))
    for vat in dumps:
        # Admitted as KubeVirt admits it (one at most, no disk), but it is the VM controller's: it adds
        # the volume to a running VM for a dump request, and virt-handler dumps once it is mounted.
        raise field_error(f"{vat}.memoryDump", "memory dumps are taken from a running VM: `launcher memory-dump get NAME --claim-name CLAIM`"
                                               " (virtctl memory-dump get) adds this volume; not supported by the launcher in a spec")
    return tuple(volumes)


# ---------------------------------------------------------------- disks

def _disk(doc: dict, idx: int, at: str) -> Disk:
    dat = f"{at}[{idx}]"
    name = get_str(doc, "name", dat, required=True)
    check_dns_label(name, f"{dat}.name")
    if doc.get("floppy") is not None:
        # Rejected since KubeVirt v0.16 (commit 627216db1), dropped from the API in 205a38f90.
        raise SpecError(f"{dat}.floppy", "Floppy disks are deprecated and will be removed from the API soon.")
    devices = [d for d in DEVICES if doc.get(d) is not None]
    if len(devices) > 1:
        raise field_error(dat, f"{dat} can only have a single target type defined")
    device = devices[0] if devices else "disk"  # api SetDefaults_DiskDevice
    target = as_map(doc.get(device), f"{dat}.{device}")
    tat = f"{dat}.{device}"

    bus = get_str(target, "bus", tat)
    if bus == "ide":
        raise SpecError(f"{tat}.bus", "IDE bus is not supported")
    if bus is not None and bus not in BUSES:
        raise field_error(f"{tat}.bus", f"{dat} is set with an unrecognized bus {bus}, must be one of: [{' '.join(BUSES)}]{did_you_mean(bus, BUSES)}")
    if device == "cdrom" and bus == "virtio":
        raise SpecError(f"{tat}.bus", "Bus type virtio is invalid for CD-ROM device")

    read_only = get_bool(target, "readonly", tat, default=None)  # the schema spells it "readonly"
    if device == "cdrom" and read_only is None:
        read_only = True  # api SetDefaults_CDRomTarget
    tray = None
    if device == "cdrom":
        tray = get_str(target, "tray", tat) or "closed"
        check_one_of(tray, TRAY_STATES, f"{tat}.tray")
    pci_address = get_str(target, "pciAddress", tat) if device == "disk" else None
    reservation = get_bool(target, "reservation", tat) if device == "lun" else False
    if pci_address is not None:
        if bus != "virtio":
            raise field_error(f"{tat}.pciAddress", f"disk {dat}.name - setting a PCI address is only possible with bus type virtio.")
        if not _PCI_ADDRESS.fullmatch(pci_address):
            raise field_error(f"{tat}.pciAddress", f"disk {dat}.name has malformed PCI address ({pci_address}).")

    boot_order = doc.get("bootOrder")
    if boot_order is not None and (isinstance(boot_order, bool) or not isinstance(boot_order, int) or boot_order < 1):
        raise field_error(f"{dat}.bootOrder", f"{dat} must have a boot order > 0, if supplied")
    serial = get_str(doc, "serial", dat)
    if serial is not None:
        if not _SERIAL.fullmatch(serial):
            raise field_error(f"{dat}.serial", f"{dat} must be made up of the following characters [A-Za-z0-9_.+-], if specified")
        if len(serial) > 256:
            raise field_error(f"{dat}.serial", f"{dat} must be less than or equal to 256 in length, if specified")
    cache = get_str(doc, "cache", dat)
    if cache is not None and cache not in CACHE_MODES:
        raise SpecError(f"{dat}.cache", f"has invalid value {cache}")
    io = get_str(doc, "io", dat)
    if io is not None and io not in IO_MODES:
        # pkg/storage/admitters/disks.go validateIOMode names the disk list, not the disk
        raise SpecError(f"{dat}.io", f"Disk IO mode for {at} is not supported. Supported modes are: native, threads.")
    # validateErrorPolicy checks any value that is set, the empty string too.
    error_policy = doc.get("errorPolicy")
    if error_policy is not None and error_policy not in ERROR_POLICIES:
        raise SpecError(f"{dat}.errorPolicy", f'has invalid value "{error_policy}"')
    block_size, match_volume = _block_size(as_map(doc.get("blockSize"), f"{dat}.blockSize"), bus, f"{dat}.blockSize")
    return Disk(
        name=name, device=device, bus=bus, boot_order=boot_order, serial=serial, read_only=bool(read_only),
        cache=cache, io=io, dedicated_io_thread=get_bool(doc, "dedicatedIOThread", dat),
        shareable=get_bool(doc, "shareable", dat), error_policy=error_policy or "stop", tag=get_str(doc, "tag", dat),
        tray=tray, pci_address=pci_address, index=idx, block_size=block_size, match_volume_block_size=match_volume,
        reservation=reservation,
    )


# pkg/storage/admitters/disks.go: minCustomBlockSize, maxCustomBlockSize
MIN_BLOCK_SIZE = 512
MAX_BLOCK_SIZE = 2 * 1024 * 1024


def _block_size(doc: dict, bus: str | None, at: str) -> tuple[tuple[int, int, int | None] | None, bool]:
    """validateBlockSize, in its order: matchVolume with custom, logical over physical, SATA's 512-byte
    logical size, discard granularity, then each size's bounds."""
    match = doc.get("matchVolume")
    match_on = match is not None and get_bool(as_map(match, f"{at}.matchVolume"), "enabled", f"{at}.matchVolume", default=True)
    custom = doc.get("custom")
    if custom is None:
        return None, bool(match_on)
    if match_on:
        raise SpecError(at, "Block size matching can't be enabled together with a custom value")
    cat = f"{at}.custom"
    custom = as_map(custom, cat)
    logical, physical = get_int(custom, "logical", cat) or 0, get_int(custom, "physical", cat) or 0
    discard = get_int(custom, "discardGranularity", cat)
    if logical > physical:
        raise SpecError(f"{cat}.logical", f"Logical size {logical} must be the same or less than the physical size of {physical}")
    # Default bus on amd64 is sata (the mutating webhook runs before the admitter).
    if (bus or DEFAULT_BUS) == "sata" and logical != MIN_BLOCK_SIZE:
        raise SpecError(f"{cat}.logical", f"Logical size {logical} must be {MIN_BLOCK_SIZE} for SATA devices")
    if discard is not None and logical and discard % logical:
        raise SpecError(f"{cat}.discardGranularity", f"Discard granularity {discard} must be multiples of logical size {logical}")
    for key, size in (("logical", logical), ("physical", physical)):
        if size < MIN_BLOCK_SIZE:
            raise SpecError(f"{cat}.{key}", f"Provided size of {size} is less than the supported minimum size of {MIN_BLOCK_SIZE}")
        if size > MAX_BLOCK_SIZE:
            raise SpecError(f"{cat}.{key}", f"Provided size of {size} is greater than the supported maximum size of {MAX_BLOCK_SIZE}")
        if size & (size - 1):
            raise SpecError(f"{cat}.{key}", f"Provided size of {size} is not a power of 2")
    return (logical, physical, discard), False


def _with_bus(disk: Disk) -> Disk:
    # pkg/defaults/amd64.go: every disk without a bus gets sata, a downwardMetrics disk too, which the
    # admitter then refuses (it must be on virtio): KubeVirt's own examples name the bus.
    return disk if disk.bus is not None else replace(disk, bus=DEFAULT_BUS)


def _check_disk(disk: Disk, volume: Volume | None, boot_orders: dict, at: str) -> None:
    dat = f"{at}[{disk.index}]"
    tat = f"{dat}.{disk.device}"
    if volume is None:
        if disk.device == "cdrom":
            raise SpecError(f"{dat}.name", "DeclarativeHotplugVolumes feature gate not enabled, cannot define an empty CD-ROM disk")
        raise SpecError(f"{dat}.name", f"{dat}.Name '{disk.name}' not found.")
    if disk.device == "lun" and volume.kind not in ("persistentVolumeClaim", "dataVolume"):
        raise field_error(f"{dat}.lun", f"{dat}.lun can only be mapped to a DataVolume or PersistentVolumeClaim volume.")
    if disk.device == "lun" and disk.bus not in ("scsi", "virtio"):
        # KubeVirt lets this through to libvirt, which refuses device='lun' on other buses.
        raise SpecError(f"{tat}.bus", f"a lun needs bus scsi or virtio, not {disk.bus}")
    if volume.kind == "downwardMetrics":
        if disk.device != "disk":
            raise SpecError(f"{dat}.disk", f"DownwardMetrics volume must be mapped to a disk, but disk is not set on {dat}.disk.")
        if disk.bus != "virtio":
            raise SpecError(f"{dat}.disk.bus", f"DownwardMetrics volume must be mapped to virtio bus, but {dat}.disk.bus is set to {disk.bus}")
    if disk.device == "disk" and disk.bus == "sata" and disk.read_only:
        raise SpecError(f"{tat}.bus", "sata hard-disks do not support read-only.")
    if disk.dedicated_io_thread and disk.bus != "virtio":
        raise SpecError(dat, f"IOThreads are not supported for disks on a {disk.bus} bus")
    if disk.shareable and disk.cache not in (None, "none"):
        # converter storage/disk.go
        raise SpecError(f"{dat}.cache", f"a sharable disk requires cache = none got: {disk.cache}")
    if disk.boot_order is not None:
        if disk.boot_order in boot_orders:
            raise SpecError(f"{dat}.bootOrder", f"Boot order for {dat}.bootOrder already set for a different device.")
        boot_orders[disk.boot_order] = disk.name


def _disks(items: list, volumes: tuple[Volume, ...], at: str, shared: frozenset = frozenset()) -> tuple[Disk, ...]:
    disks, seen = [], {}
    for idx, item in enumerate(items):
        disk = _disk(as_map(item, f"{at}[{idx}]"), idx, at)
        if disk.name in seen:
            raise field_error(f"{at}[{idx}].name", f"{at}[{idx}] and {at}[{seen[disk.name]}] must not have the same Name.")
        seen[disk.name] = idx
        disks.append(disk)
    by_name = {v.name: v for v in volumes}
    # util.SetDefaultVolumeDisk (mutating webhook): a volume without a disk or filesystem gets a plain disk.
    bare = [v for v in volumes if v.name not in seen and v.name not in shared]
    disks += [Disk(v.name, bus=None, index=len(disks) + k, defaulted=True) for k, v in enumerate(bare)]
    disks = [_with_bus(d) for d in disks]
    boot_orders: dict[int, str] = {}
    for disk in disks:
        _check_disk(disk, by_name.get(disk.name), boot_orders, at)
    return tuple(disks)


# ---------------------------------------------------------------- filesystems

# The kinds KubeVirt starts a virtiofsd container for (pkg/virt-controller/services/virtiofs.go
# virtioFSMountPoint: the claim's mount, or the config volume's source directory). containerPath
# volumes are shared too there, but the launcher has no pod to take the path from.
FILESYSTEM_KINDS = ("persistentVolumeClaim", "dataVolume", "configMap", "secret", "serviceAccount", "downwardAPI")


def _filesystems(items: list, volumes: tuple[Volume, ...], disk_items: list, disks_at: str, at: str) -> tuple[Filesystem, ...]:
    by_name = {v.name: v for v in volumes}
    disk_names = {get_str(as_map(d, f"{disks_at}[{i}]"), "name", f"{disks_at}[{i}]"): i for i, d in enumerate(disk_items)}
    found = []
    for idx, fat, doc, name in _named(items, at):
        if doc.get("virtiofs") is None:
            # The converter (converter/storage/virtiofs.go) skips such an entry: the guest would miss it.
            raise SpecError(f"{fat}.virtiofs", "required: virtiofs is the only filesystem type")
        as_map(doc["virtiofs"], f"{fat}.virtiofs")
        volume = by_name.get(name)
        if volume is None:
            raise SpecError(f"{fat}.name", f"{fat}.Name '{name}' not found.")
        if name in disk_names:
            # storage/admitters/storagehotplug.go validateExpectedDisksAndFilesystems: one volume, one device.
            raise SpecError(f"{fat}.name", f"volume {name} is already used by {disks_at}[{disk_names[name]}]:"
                                           " a volume backs one disk or one filesystem")
        if volume.kind not in FILESYSTEM_KINDS:
            raise SpecError(f"{fat}.name", f"{volume.kind} volumes cannot be shared as a filesystem"
                                           f" (only {', '.join(FILESYSTEM_KINDS)})")
        found.append(Filesystem(name, idx))
    return tuple(found)


# ---------------------------------------------------------------- domain

def _resources(doc: dict, at: str) -> Resources:
    requests = as_map(doc.get("requests"), f"{at}.requests")
    limits = as_map(doc.get("limits"), f"{at}.limits")
    rmem = get_quantity(requests, "memory", f"{at}.requests")
    lmem = get_quantity(limits, "memory", f"{at}.limits")
    rcpu = get_quantity(requests, "cpu", f"{at}.requests")
    lcpu = get_quantity(limits, "cpu", f"{at}.limits")
    if rmem is not None and 0 < rmem < 10**6:
        raise field_error(f"{at}.requests.memory", f"{at}.requests.memory '{requests['memory']}': must be greater than or equal to 1M.")
    if lmem and rmem is not None and rmem > lmem:
        raise field_error(f"{at}.requests.memory",
                    f"{at}.requests.memory '{requests['memory']}' is greater than {at}.limits.memory '{limits['memory']}'")
    if lcpu is not None and rcpu is not None and rcpu > lcpu:
        raise field_error(f"{at}.requests.cpu",
                    f"{at}.requests.cpu '{requests['cpu']}' is greater than {at}.limits.cpu '{limits['cpu']}'")
    if rcpu is None:
        rcpu = lcpu  # pkg/defaults setDefaultResourceRequests
    return Resources(
        requests_memory=None if rmem is None else to_bytes(rmem), limits_memory=None if lmem is None else to_bytes(lmem),
        requests_cpu=None if rcpu is None else to_millis(rcpu), limits_cpu=None if lcpu is None else to_millis(lcpu),
    )


def _check_dedicated(cpu: CPU, resources: Resources, guest_memory, doc: dict, at: str) -> None:
    """KubeVirt's webhook rules for dedicatedCpuPlacement (validateCpuPinning), in its order and words."""
    if cpu.isolate_emulator_thread and not cpu.dedicated_cpu_placement:
        raise SpecError(f"{at}.cpu.isolateEmulatorThread", "IsolateEmulatorThread should be only set in combination with DedicatedCPUPlacement")
    if not cpu.dedicated_cpu_placement:
        return
    r = f"{at}.resources"
    dedicated = f"{at}.cpu.dedicatedCpuPlacement"
    if not resources.requests_memory and not resources.limits_memory and not guest_memory:
        # validateMemoryIsProvided: memory.guest alone is enough (examples/vmi-fedora-isolated.yaml)
        raise SpecError(f"{r}.limits.memory", f"{r}.requests.memory, {r}.limits.memory, {at}.memory.hugepages"
                                               f" or {at}.memory.guest should be provided")
    requested = as_map(doc.get("requests"), f"{r}.requests").get("cpu")
    for side, millis in (("requests", requested is not None and resources.requests_cpu), ("limits", resources.limits_cpu)):
        if millis and millis % 1000:
            raise SpecError(f"{r}.{side}.cpu", f"provided resources CPU {side} must be an interger")  # sic, KubeVirt's spelling
    if resources.requests_memory and resources.limits_memory and resources.requests_memory != resources.limits_memory:
        raise SpecError(f"{r}.requests.memory", f"{r}.requests.memory must be equal to {r}.limits.memory")
    vcpus = (cpu.sockets or 1) * (cpu.cores or 1) * (cpu.threads or 1) if (cpu.sockets or cpu.cores or cpu.threads) else 0
    request = resources.requests_cpu if requested is not None else None
    if not request and not resources.limits_cpu and not vcpus:
        raise SpecError(dedicated, f"either {r}.requests.cpu or {r}.limits.cpu or {at}.cpu.cores must be provided when DedicatedCPUPlacement is true")
    if request and resources.limits_cpu and request != resources.limits_cpu:
        raise SpecError(dedicated, f"{r}.requests.cpu or {r}.limits.cpu must be equal when DedicatedCPUPlacement is true")
    if (request or resources.limits_cpu) and vcpus and request != vcpus * 1000 and resources.limits_cpu != vcpus * 1000:
        raise SpecError(dedicated, f"{r}.requests.cpu or {r}.limits.cpu must not be provided at the same time with {at}.cpu.cores when DedicatedCPUPlacement is true")
    if (cpu.threads or 0) > 2:
        raise SpecError(dedicated, f"Not more than two threads must be provided at {at}.cpu.threads (got {cpu.threads}) when DedicatedCPUPlacement is true")


def _kernel_boot(doc: dict, at: str) -> KernelBoot:
    args = get_str(doc, "kernelArgs", at)
    if doc.get("container") is None:
        if args:
            raise SpecError(f"{at}.kernelArgs", "kernel arguments cannot be provided without an external kernel")
        return KernelBoot(args, None)
    cat = f"{at}.container"
    container = as_map(doc["container"], cat)
    image = get_str(container, "image", cat)
    if image is None:
        raise field_error(f"{cat}.image", f"{cat} must be defined with an image")
    kernel = get_str(container, "kernelPath", cat)
    initrd = get_str(container, "initrdPath", cat)
    if kernel is None and initrd is None:
        raise field_error(cat, f"{cat} must be defined with at least one of the following: kernelPath, initrdPath")
    for key, value in (("kernelPath", kernel), ("initrdPath", initrd)):
        if value is not None:
            _path(value, f"{cat}.{key}")
    policy = get_str(container, "imagePullPolicy", cat)
    check_one_of(policy, PULL_POLICIES, f"{cat}.imagePullPolicy")
    secret = get_str(container, "imagePullSecret", cat)
    return KernelBoot(args, KernelBootContainer(image, kernel, initrd, policy, secret))


def _firmware(doc: dict, at: str) -> Firmware:
    loader = as_map(doc.get("bootloader"), f"{at}.bootloader")
    if loader.get("efi") is not None and loader.get("bios") is not None:
        raise field_error(f"{at}.bootloader", f"{at}.bootloader has both EFI and BIOS configured, but they are mutually exclusive.")
    bootloader, secure_boot, use_serial, persistent = None, False, False, False
    if loader.get("efi") is not None:
        bootloader = "efi"
        efi = as_map(loader["efi"], f"{at}.bootloader.efi")
        secure_boot = get_bool(efi, "secureBoot", f"{at}.bootloader.efi", default=True)
        persistent = get_bool(efi, "persistent", f"{at}.bootloader.efi")
    elif loader.get("bios") is not None:
        bootloader = "bios"
        use_serial = get_bool(as_map(loader["bios"], f"{at}.bootloader.bios"), "useSerial", f"{at}.bootloader.bios")
    uuid = get_str(doc, "uuid", at)
    if uuid is not None:
        try:
            uuid = str(uuidlib.UUID(uuid))
        except ValueError:
            raise SpecError(f"{at}.uuid", "must be a UUID") from None
    kernel_boot = None
    if doc.get("kernelBoot") is not None:
        kernel_boot = _kernel_boot(as_map(doc["kernelBoot"], f"{at}.kernelBoot"), f"{at}.kernelBoot")
    return Firmware(uuid, get_str(doc, "serial", at), bootloader, secure_boot, use_serial, kernel_boot, persistent)


def _feature(doc: dict, key: str, at: str, absent: bool) -> bool:
    if key not in doc:
        return absent
    value = as_map(doc[key], f"{at}.{key}")
    return get_bool(value, "enabled", f"{at}.{key}", default=True)  # api SetDefaults_FeatureState


def _domain(doc: dict, root: str, volumes: tuple[Volume, ...]) -> DomainSpec:
    at = f"{root}.domain"
    cpu_doc = as_map(doc.get("cpu"), f"{at}.cpu")
    cpu = CPU(get_int(cpu_doc, "cores", f"{at}.cpu"), get_int(cpu_doc, "sockets", f"{at}.cpu"), get_int(cpu_doc, "threads", f"{at}.cpu"),
              get_str(cpu_doc, "model", f"{at}.cpu"), get_bool(cpu_doc, "dedicatedCpuPlacement", f"{at}.cpu"),
              get_bool(cpu_doc, "isolateEmulatorThread", f"{at}.cpu"), max_sockets=get_int(cpu_doc, "maxSockets", f"{at}.cpu") or None)
    resources = _resources(as_map(doc.get("resources"), f"{at}.resources"), f"{at}.resources")
    memory_doc = as_map(doc.get("memory"), f"{at}.memory")
    guest = get_quantity(memory_doc, "guest", f"{at}.memory")
    _check_dedicated(cpu, resources, guest, as_map(doc.get("resources"), f"{at}.resources"), at)
    if guest is None and not resources.requests_memory:
        raise SpecError(f"{at}.memory", f"no memory requested, at least one of '{at}.memory.guest', "
                                        f"'{at}.memory.hugepages.pageSize' or '{at}.resources.requests.memory' must be set")
    if guest is not None and resources.limits_memory and resources.limits_memory < guest:
        raise field_error(f"{at}.memory.guest", f"{at}.memory.guest '{memory_doc['guest']}' must be equal to or less than the memory limit "
                                          f"{at}.resources.limits.memory '{doc['resources']['limits']['memory']}'")

    machine = get_str(as_map(doc.get("machine"), f"{at}.machine"), "type", f"{at}.machine") or DEFAULT_MACHINE
    if not any(re.fullmatch(p.replace("*", ".*"), machine) for p in EMULATED_MACHINES):
        raise field_error(f"{at}.machine.type", f"{at}.machine.type is not supported: {machine} (allowed values: [{' '.join(EMULATED_MACHINES)}])")

    firmware = _firmware(as_map(doc.get("firmware"), f"{at}.firmware"), f"{at}.firmware")
    features = _features(as_map(doc.get("features"), f"{at}.features"), f"{at}.features")
    cpu = replace(cpu, features=hyperv.with_evmcs_cpu_feature(features.hyperv, cpu.features))
    if firmware.bootloader == "efi" and not features.acpi:
        # KubeVirt passes this on; libvirt refuses it with these words.
        raise SpecError(f"{at}.features.acpi", "UEFI requires ACPI on this architecture")
    if firmware.bootloader == "efi" and firmware.secure_boot and not features.smm:
        raise SpecError(at, "has EFI SecureBoot enabled. SecureBoot requires SMM, which is currently disabled.")

    policy = get_str(doc, "ioThreadsPolicy", at)
    if policy == "supplementalPool":
        # vmi-create-admitter.go validateIOThreadsPolicy: KubeVirt's own refusal comes first
        threads = as_map(doc.get("ioThreads"), f"{at}.ioThreads").get("supplementalPoolThreadCount")
        if not isinstance(threads, int) or isinstance(threads, bool) or threads <= 0:
            raise SpecError(f"{at}.ioThreads.count", "the number of iothreads needs to be set and positive for the dedicated policy")
        # storage/configurator.go (iothreads.BuildSupplementalPoolIOThreads) maps each virtio disk's queues
        # onto the whole pool, <driver><iothreads>: libvirt 10.0's and qemu 9.0's iothread-vq-mapping,
        # which Debian 12's libvirt 9.0 and qemu 7.2 neither parse nor run.
        raise SpecError(f"{at}.ioThreadsPolicy", "supplementalPool maps every virtio disk onto the whole pool of iothreads"
                                                 " (<driver><iothreads>), which needs libvirt 10.0 and qemu 9.0, newer than"
                                                 " this launcher's: use shared or auto")
    if policy is not None and policy not in IO_THREADS_POLICIES:
        raise SpecError(f"{at}.ioThreadsPolicy", f"Invalid IOThreadsPolicy ({policy})")

    dat = f"{at}.devices"
    devices_doc = as_map(doc.get("devices"), dat)
    disk_items = as_list(devices_doc.get("disks"), f"{dat}.disks")
    filesystems = _filesystems(as_list(devices_doc.get("filesystems"), f"{dat}.filesystems"), volumes, disk_items, f"{dat}.disks", f"{dat}.filesystems")
    disks = _disks(disk_items, volumes, f"{dat}.disks", frozenset(f.name for f in filesystems))
    # Queues follow the vCPU topology, one at least (storage/configurator.go), so no CPU request is needed.
    block_mq = get_bool(devices_doc, "blockMultiQueue", dat)
    graphics = get_bool(devices_doc, "autoattachGraphicsDevice", dat, default=True)
    devices = Devices(disks, get_bool(devices_doc, "autoattachSerialConsole", dat, default=True), block_mq,
                      get_bool(devices_doc, "useVirtioTransitional", dat), get_bool(devices_doc, "disableHotplug", dat),
                      filesystems, "rng" in devices_doc and as_map(devices_doc["rng"], f"{dat}.rng") is not None,
                      tpm=_tpm(devices_doc, dat),
                      autoattach_graphics=graphics,
                      autoattach_mem_balloon=get_bool(devices_doc, "autoattachMemBalloon", dat, default=True),
                      inputs=_inputs(as_list(devices_doc.get("inputs"), f"{dat}.inputs"), f"{dat}.inputs"),
                      video=_video(devices_doc, graphics, dat),
                      network_multiqueue=get_bool(devices_doc, "networkInterfaceMultiqueue", dat),
                      downward_metrics=_object_given(devices_doc, "downwardMetrics", dat))
    clock = parse_clock(as_map(doc["clock"], f"{at}.clock"), f"{at}.clock") if doc.get("clock") is not None else None
    spec = DomainSpec(cpu, None if guest is None else to_bytes(guest), resources, machine, firmware, features, devices, policy, clock)
    _check_cpu_hotplug(spec, at)
    return spec


MAX_VCPUS = 512  # pkg/defaults/defaults.go setupCPUHotplug: KubeVirt's upper bound for a hotplug topology


def _check_cpu_hotplug(spec: DomainSpec, at: str) -> None:
    """vmi-create-admitter.go validateCPUHotplug, on the sockets as KubeVirt's defaults leave them
    (SetDefaultGuestCPUTopology: the CPU limit or request's count when no topology is given); and the
    vCPUs maxSockets makes each become an element of the domain, so their count is bounded first."""
    if not spec.cpu.max_sockets:
        return
    sockets, cores, threads = spec.topology
    if sockets > spec.cpu.max_sockets:
        raise SpecError(f"{at}.cpu.sockets", "Number of sockets in CPU topology is greater than the maximum sockets allowed")
    if spec.cpu.max_sockets * cores * threads > MAX_VCPUS:
        raise SpecError(f"{at}.cpu.maxSockets", f"{spec.cpu.max_sockets} sockets of {cores} cores and {threads} threads are"
                                                f" {spec.cpu.max_sockets * cores * threads} vCPUs, more than the {MAX_VCPUS} a domain may have")


def _features(doc: dict, at: str) -> Features:
    hyperv_doc = doc.get("hyperv")
    custom = hyperv.parse_hyperv(as_map(hyperv_doc, f"{at}.hyperv"), f"{at}.hyperv") if hyperv_doc is not None else None
    if hyperv_doc is not None and doc.get("hypervPassthrough") is not None:
        # webhooks.ValidateVirtualMachineInstanceHypervMode, after the dependencies' causes
        raise SpecError(f"{at}.hyperv", hyperv.PASSTHROUGH_AND_CUSTOM)
    passthrough = False
    if doc.get("hypervPassthrough") is not None:
        passthrough = hyperv.parse_passthrough(as_map(doc["hypervPassthrough"], f"{at}.hypervPassthrough"), f"{at}.hypervPassthrough")
    kvm_hidden = None
    if doc.get("kvm") is not None:
        kvm_hidden = get_bool(as_map(doc["kvm"], f"{at}.kvm"), "hidden", f"{at}.kvm")
    pvspinlock = _feature(doc, "pvspinlock", at, None) if doc.get("pvspinlock") is not None else None
    return Features(_feature(doc, "acpi", at, True), _feature(doc, "apic", at, False), _feature(doc, "smm", at, False),
                    custom, passthrough, kvm_hidden, pvspinlock)


def _object_given(doc: dict, key: str, at: str) -> bool:
    """An object field set (a Go pointer that is not nil): null or absent is not."""
    as_map(doc.get(key), f"{at}.{key}")
    return doc.get(key) is not None


def _tpm(devices: dict, at: str) -> TPM | None:
    """pkg/tpm: a device unless `enabled: false` (a preference's TPM can be turned off so)."""
    if devices.get("tpm") is None:
        return None
    doc = as_map(devices["tpm"], f"{at}.tpm")
    if not get_bool(doc, "enabled", f"{at}.tpm", default=True):
        return None
    return TPM(get_bool(doc, "persistent", f"{at}.tpm"))


def _inputs(items: list, at: str) -> tuple[Input, ...]:
    """vmi-create-admitter.go validateInputDevices, after api SetDefaults_Input (usb, tablet)."""
    found = []
    for idx, item in enumerate(items):
        iat = f"{at}[{idx}]"
        doc = as_map(item, iat)
        name = get_str(doc, "name", iat, required=True)  # the schema requires it: the device's alias
        bus = get_str(doc, "bus", iat) or "usb"
        if bus not in INPUT_BUSES:
            raise SpecError(f"{iat}.bus", "Input device can have only virtio or usb bus.")
        if (get_str(doc, "type", iat) or "tablet") != "tablet":
            raise SpecError(f"{iat}.type", "Input device can have only tablet type.")
        found.append(Input(name, bus))
    return tuple(found)


def _video(devices: dict, graphics: bool, at: str) -> str | None:
    """vmi-create-admitter.go validateVideoConfig and webhooks/amd64.go validateVideoTypeAmd64."""
    if devices.get("video") is None:
        return None
    if not graphics:
        raise SpecError(f"{at}.video", "Video configuration is not allowed when autoattachGraphicsDevice is set to false")
    kind = get_str(as_map(devices["video"], f"{at}.video"), "type", f"{at}.video") or ""
    if kind not in VIDEO_TYPES:
        raise SpecError(f"{at}.video.type", f"video model '{kind}' is not supported on amd64 architecture")
    return kind


def _check_names(spec: dict, volumes: tuple[Volume, ...], root: str) -> str | None:
    """vmi-create-admitter.go: hostname a DNS label, subdomain a DNS subdomain, serviceAccountName a DNS
    subdomain naming the same account as a serviceAccount volume (validateServiceAccountName). The
    hostname is returned; the other two only schedule and name the pod, but KubeVirt refuses them."""
    hostname = get_str(spec, "hostname", root)
    problems = dns_label_problems(hostname) if hostname is not None else []
    if problems:
        raise SpecError(f"{root}.hostname", f"does not conform to the kubernetes DNS_LABEL rules : {', '.join(problems)}")
    subdomain = get_str(spec, "subdomain", root)
    problems = dns_subdomain_problems(subdomain) if subdomain is not None else []
    if problems:
        raise SpecError(f"{root}.subdomain", f"does not conform to the kubernetes DNS_SUBDOMAIN rules : {', '.join(problems)}")
    account = get_str(spec, "serviceAccountName", root)
    if account is not None:
        problems = dns_subdomain_problems(account)
        if problems:
            raise SpecError(f"{root}.serviceAccountName", f"is not a valid service account name: {'; '.join(problems)}")
        for volume in volumes:
            if volume.kind == "serviceAccount" and volume.source.service_account_name != account:
                raise SpecError(f"{root}.serviceAccountName", f'spec.serviceAccountName "{account}" and serviceAccount volume'
                                                              f' "{volume.source.service_account_name}" must reference the same service account')
    return hostname


# ---------------------------------------------------------------- entry points

def parse_vmi(doc: dict, ignore_unsupported: bool = False, *, objects: ObjectSource | None = None) -> VMI:
    """A VirtualMachineInstance (or a VirtualMachine's template), defaulted and validated as KubeVirt does.

    `objects` holds a VirtualMachine's instance type and preference (and the volumes they are inferred
    from). A field the launcher would not honour (launcher.spec.coverage) is refused; with
    `ignore_unsupported` it is dropped instead and named in the VMI's `ignored`."""
    doc = as_map(doc, "document")
    # The kind first: a replica set's or pool's fields are not a VMI's, and naming them as unknown
    # VMI fields would hide that the whole object is of another kind.
    kind = doc.get("kind")
    if kind not in ("VirtualMachineInstance", "VirtualMachine"):
        raise SpecError("kind", f"must be VirtualMachineInstance or VirtualMachine, not {kind!r}")
    if doc.get("apiVersion") not in API_VERSIONS:
        raise SpecError("apiVersion", f"must be {API_VERSION}, not {doc.get('apiVersion')!r}")
    if kind == "VirtualMachine":
        # Before anything judges the template, as KubeVirt's VM admitter applies them first.
        doc = expand(doc, objects)
    unsupported = coverage.unsupported_fields(doc)
    if unsupported and not ignore_unsupported:
        raise SpecError(*unsupported[0])
    if unsupported:
        doc = coverage.without(doc, [path for path, _ in unsupported])
    metadata = as_map(doc.get("metadata"), "metadata")
    spec = as_map(doc.get("spec"), "spec")
    root = "spec"
    labels, annotations = metadata.get("labels"), metadata.get("annotations")
    # A VirtualMachine's field; on a VMI the launcher reads it too, so one file can carry its disks.
    templates_doc = spec.get("dataVolumeTemplates")
    if kind == "VirtualMachine":
        root = "spec.template.spec"
        template = as_map(spec.get("template"), "spec.template")
        if not template:
            raise SpecError("spec.template", "required")
        tmeta = as_map(template.get("metadata"), "spec.template.metadata")
        labels, annotations = tmeta.get("labels"), tmeta.get("annotations")
        spec = as_map(template.get("spec"), root)
    name = get_str(metadata, "name", "metadata", required=True)
    check_subdomain(name, "metadata.name")
    namespace = get_str(metadata, "namespace", "metadata") or DEFAULT_NAMESPACE
    check_namespace(namespace, "metadata.namespace")
    meta_at = "metadata" if kind == "VirtualMachineInstance" else "spec.template.metadata"
    # Strings reach the domain XML, file names and the generated disks' files; cloud-init data only
    # the latter, as file contents.
    check_xml_text(doc, "", skip=CLOUD_INIT_CONTENT)
    labels = check_labels(labels, f"{meta_at}.labels")
    annotations = check_annotations(annotations, f"{meta_at}.annotations")
    if kind == "VirtualMachine":
        check_labels(metadata.get("labels"), "metadata.labels")
        check_annotations(metadata.get("annotations"), "metadata.annotations")
    architecture = get_str(spec, "architecture", root)
    if architecture not in (None, "amd64"):
        raise SpecError(f"{root}.architecture", f"{architecture} is not supported by the launcher (amd64 only)")
    volumes = _volumes(as_list(spec.get("volumes"), f"{root}.volumes"), f"{root}.volumes")
    domain = _domain(as_map(spec.get("domain"), f"{root}.domain"), root, volumes)
    devices_doc = as_map(as_map(spec.get("domain"), f"{root}.domain").get("devices"), f"{root}.domain.devices")
    boot_orders = frozenset(d.boot_order for d in domain.devices.disks if d.boot_order is not None)
    interfaces = parse_interfaces(spec, devices_doc, root, boot_orders, namespace=namespace, objects=objects)
    hostdevices.admit(spec, root)
    domain = replace(domain, devices=replace(domain.devices, interfaces=interfaces))
    hostname = _check_names(spec, volumes, root)
    check_dns(spec, root)
    data_volumes = templates(templates_doc, "spec.dataVolumeTemplates", namespace)
    claims = {v.source.claim_name if v.kind == "persistentVolumeClaim" else v.source.name
              for v in volumes if v.kind in ("persistentVolumeClaim", "dataVolume")}
    for i, dv in enumerate(data_volumes):
        if dv.name not in claims:  # storage/admitters/data-volume-template.go ValidateDataVolumeTemplate
            raise SpecError(f"spec.dataVolumeTemplates[{i}]", f"DataVolumeTemplate entry spec.dataVolumeTemplates[{i}] must be"
                                                              " referenced in the VMI template's 'volumes' list")
    access = credentials.parse(spec.get("accessCredentials"), (v.kind for v in volumes), f"{root}.accessCredentials")
    return VMI(name, namespace, get_str(metadata, "uid", "metadata"), labels, annotations, domain, volumes,
               hostname, get_int(spec, "terminationGracePeriodSeconds", root), data_volumes, tuple(unsupported), access,
               from_vm=kind == "VirtualMachine", liveness_probe=_probe_handler(spec, root), spec_document=spec)


def _probe_handler(spec: dict, root: str) -> str | None:
    probe = as_map(spec.get("livenessProbe"), f"{root}.livenessProbe")
    if not probe:
        return None
    handlers = sorted(k for k in ("exec", "httpGet", "tcpSocket", "guestAgentPing") if probe.get(k) is not None)
    return handlers[0] if len(handlers) == 1 else "other"


def load_vmi(path: str | Path, ignore_unsupported: bool = False, *, objects: ObjectSource | None = None) -> VMI:
    """Read one YAML document from `path` (`-`: stdin; within the API server's limits) and parse it (`objects`: see parse_vmi)."""
    docs = [doc for doc in load_documents(path) if doc is not None]
    if len(docs) != 1:
        raise SpecError(shown_path(path), f"must hold one VirtualMachineInstance or VirtualMachine document, not {len(docs)}")
    return parse_vmi(docs[0], ignore_unsupported, objects=objects)

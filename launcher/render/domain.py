"""A parsed VMI plus its resolved volume files -> libvirt domain XML, as KubeVirt's converter builds it (pure).

Follows pkg/virt-launcher/virtwrap/converter (storage/, compute/, iothreads/, converter.go) for disks,
cache and io modes, iothreads, queues and CPU topology; launcher.render.compute adds the display,
inputs, balloon, guest-agent channel and SMBIOS entries every KubeVirt domain has. Deliberate
differences, all for a launcher that runs outside a pod: the serial console is a pty logged to a
file, the pod network's NIC is served by the VM's pod switch (launcher.render.interfaces), the VNC
socket is in the VM's run directory, and the caller probes KVM and O_DIRECT and passes the results in.
iSCSI and RBD PersistentVolumes become network disks qemu connects to itself (launcher.k8s resolves
them), as KubeVirt's 2017 proposal for PV-backed disks had it. A lazily pulled containerDisk is an
overlay whose backing store is an NBD export of the node's disk server, on a unix socket.
"""

from __future__ import annotations

import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from launcher.render import clock, compute, cpupin, features, interfaces
from launcher.render.cpupin import Topology
from launcher.spec.k8s import NetworkSource
from launcher.spec.vmi import DEFAULT_CPU_MODEL, VMI, Disk, SpecError, Volume

# Volume kinds whose libvirt driver gets discard='unmap' even on a cdrom (storage/volume.go setDiskDriver).
_DISCARD_KINDS = ("containerDisk", "emptyDisk", "persistentVolumeClaim", "dataVolume", "ephemeral")
_SCSI_CONTROLLER = 0
HOTPLUG_ARCHES = ("x86_64", "s390x")  # converter/arch SupportCPUHotplug


@dataclass(frozen=True)
class ResolvedDisk:
    path: str  # file path or block device; for a network disk only a name for messages
    format: str  # "qcow2" | "raw"
    type: str = "file"  # "file" | "block" | "network"
    backing: tuple[str, str] | None = None  # (path, format) of the read-only base under a qcow2 overlay
    direct_io: bool = True  # the caller's O_DIRECT probe of path (and backing); drives the cache mode
    read_only: bool = False
    preallocated: bool = False  # fully allocated file: io='native' is worth it, as for block devices
    backing_type: str = "file"  # "file" | "block" | "network" (an overlay over an NBD export, lazy containerDisks)
    network: NetworkSource | None = None  # what qemu connects to when type is "network" (iSCSI, RBD PVs)
    backing_network: NetworkSource | None = None  # the base qemu connects to when backing_type is "network"
    # (logical, physical, discard granularity) of the backend as the caller found them: ioctls for a block
    # device, the filesystem's block size for a file (storage/disk.go getOptimalBlockIO); blockSize.matchVolume
    block_io: tuple[int, int, int] | None = None
    # False for a file the launcher gave qemu itself, through its fd (a claim's disk.img): libvirt's DAC
    # driver would chown it by path, after the check, through whatever link the claim's owner swapped in.
    relabel: bool = True
    backing_relabel: bool = True
    # The fd group (virDomainFDAssociate) through which qemu gets the source, or the backing store, as an
    # open file rather than a name (a root launcher's, launcher.runtime.diskfds); None: qemu opens the path.
    fd_group: str | None = None
    backing_fd_group: str | None = None


@dataclass(frozen=True)
class Host:
    domain_type: str = "qemu"  # "kvm" or "qemu" (TCG), from the caller's probe
    arch: str = "x86_64"
    serial_log: str | None = None  # file the serial console is logged to
    kernel: str | None = None  # resolved kernelBoot files
    initrd: str | None = None
    emulator: str | None = None
    # dedicatedCpuPlacement only: the host's cells/cores/threads and the threads the pod owns
    topology: Topology = ()
    cpuset: tuple[int, ...] = ()
    # (filesystem name, vhost-user socket of the virtiofsd the caller starts for it)
    virtiofs_sockets: tuple[tuple[str, str], ...] = ()
    # where the caller's pod switch listens for each NIC (launcher.render.interfaces.socket_path)
    net_dir: str = "/run/launcher/net"
    # (interface, tap device, MAC) of each Multus bridge network's NIC, as the caller made them
    # (launcher.network.linuxbridge); a NIC not here renders with KubeVirt's in-pod tap name
    taps: tuple[tuple[str, str, str], ...] = ()
    # A system daemon's DAC driver would chown files for qemu, and a root launcher gives claim files to
    # qemu itself: their sources say relabel='no'. A session daemon has no DAC driver (it refuses the
    # seclabel), and an unprivileged launcher on the system daemon leaves the chown to libvirt.
    dac: bool = False
    # A VM's own uid and gid under the system daemon (launcher.runtime.vmuser): qemu runs as them, not as
    # qemu.conf's user every VM shares, and libvirt chowns nothing for it (the launcher gave it its files).
    dac_label: tuple[int, int] | None = None
    # EFI: the firmware's code and variable-store template the caller found (KubeVirt's efi.EFIEnvironment),
    # and this VM's variable store (a copy of the template, in the run directory or the VM's state)
    efi_code: str | None = None
    efi_vars: str | None = None
    nvram: str | None = None
    # Where qemu listens for VNC and for the guest agent; None: sockets libvirt names.
    vnc_socket: str | None = None
    agent_socket: str | None = None
    # The control socket of the swtpm a root launcher runs for the VM's TPM as the VM's own uid
    # (launcher.runtime.swtpm); None: libvirt runs it (KubeVirt's emulator backend).
    tpm_socket: str | None = None


def _file_source(parent: ET.Element, path: str, fd_group: str | None = None) -> ET.Element:
    # libvirt 9.0's fdgroup: the path stays, for messages; qemu gets the group's open file instead.
    return ET.SubElement(parent, "source", file=path, **({"fdgroup": fd_group} if fd_group else {}))


def _block_source(parent: ET.Element, path: str, fd_group: str | None = None) -> ET.Element:
    return ET.SubElement(parent, "source", dev=path)


def _no_relabel(source: ET.Element) -> None:
    # libvirt's src/security/security_dac.c (virSecurityDACSetImageLabelInternal and the restore): a DAC
    # seclabel with relabel='no' on the source and the image is neither chowned nor given back.
    ET.SubElement(source, "seclabel", model="dac", relabel="no")


_SOURCES = {"file": _file_source, "block": _block_source}
_PROTOCOLS = ("iscsi", "rbd", "nbd")
_SECRET_TYPES = {"iscsi": "iscsi", "rbd": "ceph"}


def _network_source(parent: ET.Element, network: NetworkSource) -> None:
    source = ET.SubElement(parent, "source", protocol=network.protocol, name=network.name)
    # libvirt and qemu's libiscsi driver take one portal per iSCSI disk: the target portal, first.
    # The other portals reach the same LUN (multipath), which qemu cannot use.
    for name, port in network.hosts[:1] if network.protocol == "iscsi" else network.hosts:
        ET.SubElement(source, "host", {"name": name, **({"port": str(port)} if port is not None else {})})
    if network.socket is not None:
        ET.SubElement(source, "host", transport="unix", socket=network.socket)
    if network.auth_username is not None:
        # Inside <source>, libvirt's current form; the password stays in a libvirt secret (secret_xml).
        auth = ET.SubElement(source, "auth", username=network.auth_username)
        ET.SubElement(auth, "secret", type=network.secret_type, usage=network.secret_usage)
    if network.initiator:
        ET.SubElement(ET.SubElement(source, "initiator"), "iqn", name=network.initiator)


def _network_problem(network: NetworkSource | None) -> str | None:
    if network is None:
        return "is a network disk without a network source"
    if network.protocol not in _PROTOCOLS:
        return f"uses the unsupported network protocol {network.protocol}"
    if not network.hosts and network.socket is None:
        return f"has no host for its {network.protocol} source"
    if network.socket is not None and (network.protocol != "nbd" or network.hosts):
        return f"has a unix socket for its {network.protocol} source; only NBD sources without hosts take one"
    if network.auth_username is not None and network.protocol not in _SECRET_TYPES:
        return f"has {network.protocol} credentials, which the disk server does not take"
    if network.auth_username is not None and (network.secret_type != _SECRET_TYPES[network.protocol] or not network.secret_usage):
        return f"has {network.protocol} credentials but no {_SECRET_TYPES[network.protocol]} secret usage"
    return None


def secret_xml(source: NetworkSource) -> str:
    """The libvirt secret that `source`'s <auth> names by usage; the caller then sets its value.

    The UUID derives from the usage, so defining it again updates the secret instead of colliding with
    the one already defined for that usage."""
    if source.secret_type not in ("iscsi", "ceph") or not source.secret_usage:
        raise ValueError(f"{source.protocol} source {source.name} has no libvirt secret")
    secret = ET.Element("secret", ephemeral="no", private="yes")
    _text(secret, "uuid", str(uuid.uuid5(uuid.NAMESPACE_URL, f"libvirt-secret:{source.secret_type}/{source.secret_usage}")))
    _text(secret, "description", f"diskkit: {source.protocol} {source.name}")
    usage = ET.SubElement(secret, "usage", type=source.secret_type)
    # iSCSI secrets are looked up by <target>, ceph ones by <name>.
    _text(usage, "target" if source.secret_type == "iscsi" else "name", source.secret_usage)
    ET.indent(secret, "  ")
    return ET.tostring(secret, encoding="unicode") + "\n"


def _text(parent: ET.Element, tag: str, text: str, **attrs: str) -> ET.Element:
    element = ET.SubElement(parent, tag, attrs)
    element.text = text
    return element


def _disk_at(vmi: VMI, disk: Disk, child: str = "") -> str:
    """The field to blame; a disk added by defaulting for a bare volume is blamed on that volume."""
    if disk.defaulted:
        return f"spec.volumes[{vmi.volume(disk.name).index}]"
    return f"spec.domain.devices.disks[{disk.index}]{child}"


def _device_name(prefix: str, index: int) -> str:
    """vda..vdz, vdaa.. (the kernel's sd naming, which KubeVirt ports in formatDeviceName)."""
    name = ""
    while index >= 0:
        name = chr(ord("a") + index % 26) + name
        index = index // 26 - 1
    return prefix + name


def io_threads(vmi: VMI) -> tuple[int, int]:
    """(all iothreads, the shared pool) as iothreads.GetIOThreadsCountType; (0, 0) when none are used."""
    domain = vmi.domain
    disks = domain.devices.disks
    if domain.io_threads_policy is None and not any(d.dedicated_io_thread for d in disks):
        return 0, 0
    dedicated = sum(1 for d in disks if d.dedicated_io_thread)
    shared = len(disks) - dedicated  # every disk counts, virtio or not, as in KubeVirt
    if domain.io_threads_policy == "auto" and domain.cpu.dedicated_cpu_placement and domain.cpu.isolate_emulator_thread:
        limit = 1  # iothreads.go getThreadPoolLimit: the IOThread shares the emulator thread's dedicated pCPU
    elif domain.io_threads_policy == "auto":
        cpus = -(-domain.resources.requests_cpu // 1000) if domain.resources.requests_cpu is not None else 1
        limit = 2 * cpus
    else:
        limit = 1
    if shared + dedicated > limit:
        shared = max(1, limit - dedicated)  # at least one thread for the shared disks
    return shared + dedicated, shared


def _cache_mode(disk: Disk, resolved: ResolvedDisk, at: str) -> str:  # at: the disk's cache field
    """converter.go SetDriverCacheMode, with the O_DIRECT probe already done by the caller."""
    mode = disk.cache
    if disk.shareable and mode is None:
        mode = "none"
    if mode not in (None, "none"):
        return mode
    if mode == "none" and not resolved.direct_io:
        raise SpecError(at, f"Unable to use 'none' cache mode, file system where {resolved.path} is stored"
                                       " does not support direct I/O")
    return "none" if resolved.direct_io else "writethrough"


def _io_mode(disk: Disk, resolved: ResolvedDisk, cache: str, at: str) -> str | None:  # at: the io field
    """converter.go SetOptimalIOMode: native needs O_DIRECT and pays off on block devices and full files."""
    io = disk.io
    if io is None and cache == "none" and (resolved.type == "block" or resolved.preallocated):
        io = "native"
    if io == "native" and cache != "none":
        # KubeVirt passes this on and qemu refuses it: aio=native requires cache.direct=on.
        raise SpecError(at, f"io native needs cache none, but the cache mode is {cache}")
    return io


def guest_read_only(disk: Disk, volume: Volume, resolved: ResolvedDisk) -> bool:
    """Whether the guest gets the disk read-only (<readonly/>): qemu then opens it read-only too."""
    return disk.read_only or resolved.read_only or volume.kind == "downwardMetrics"


def read_only_volumes(vmi: VMI, resolved: dict[str, ResolvedDisk]) -> set[str]:
    """The volumes whose disks the guest gets read-only."""
    return {d.name for d in vmi.domain.devices.disks if d.name in resolved and guest_read_only(d, vmi.volume(d.name), resolved[d.name])}


def _disk(vmi: VMI, disk: Disk, volume: Volume, resolved: ResolvedDisk, target: str, unit: int,
          iothread: int | None, dac: bool) -> ET.Element:
    at = _disk_at(vmi, disk)
    if disk.device == "lun" and resolved.type == "file":
        raise SpecError(at, f"device {disk.name} is of type lun. Not compatible with a file based disk")
    if resolved.type == "network":
        problem = _network_problem(resolved.network)
        if problem:
            raise SpecError(at, f"volume {volume.name} {problem}")
        if disk.device == "lun" and resolved.network.protocol != "iscsi":
            # SCSI passthrough needs a SCSI target at the other end; libvirt allows it for iSCSI only.
            raise SpecError(at, f"device {disk.name} is of type lun. Not compatible with protocol {resolved.network.protocol}")
    elif resolved.type not in _SOURCES:
        raise SpecError(at, f"volume {volume.name} resolved to an unsupported disk type {resolved.type}")
    _check_reservation(vmi, disk, resolved)
    read_only = guest_read_only(disk, volume, resolved)
    if disk.device == "disk" and disk.bus == "sata" and read_only:
        raise SpecError(_disk_at(vmi, disk, ".disk.bus"), "sata hard-disks do not support read-only.")
    cache = _cache_mode(disk, resolved, _disk_at(vmi, disk, ".cache"))
    io = _io_mode(disk, resolved, cache, _disk_at(vmi, disk, ".io"))

    attrs = {"type": resolved.type, "device": disk.device}
    if disk.device == "disk" and disk.bus == "virtio":
        attrs["model"] = "virtio-transitional" if vmi.domain.devices.use_virtio_transitional else "virtio-non-transitional"
    element = ET.Element("disk", attrs)

    # storage/volume.go gives the downwardMetrics disk a fresh driver (name and type only): discard and
    # queues set before it are gone; the error policy (storage/configurator.go setErrorPolicy), cache, io
    # and iothread come after it.
    fresh = volume.kind == "downwardMetrics"
    driver = {"name": "qemu", "type": resolved.format, "cache": cache, "error_policy": disk.error_policy}
    if io:
        driver["io"] = io
    if (disk.device in ("disk", "lun") or volume.kind in _DISCARD_KINDS) and not fresh:
        driver["discard"] = "unmap"
    if iothread is not None:
        driver["iothread"] = str(iothread)
    if vmi.domain.devices.block_multi_queue and disk.bus == "virtio" and not fresh:
        driver["queues"] = str(max(1, vmi.domain.vcpus))
    ET.SubElement(element, "driver", driver)

    if resolved.type == "network":
        _network_source(element, resolved.network)
    else:
        source = _SOURCES[resolved.type](element, resolved.path, resolved.fd_group)
        if dac and (not resolved.relabel or resolved.fd_group):
            _no_relabel(source)
    if resolved.backing is not None:
        base, base_format = resolved.backing
        if resolved.backing_type == "network":
            problem = _network_problem(resolved.backing_network)
            if problem:
                raise SpecError(at, f"volume {volume.name}'s backing store {problem}")
        elif resolved.backing_type not in _SOURCES:
            raise SpecError(at, f"volume {volume.name} has an unsupported backing type {resolved.backing_type}")
        store = ET.SubElement(element, "backingStore", type=resolved.backing_type)
        ET.SubElement(store, "format", type=base_format)
        if resolved.backing_type == "network":
            _network_source(store, resolved.backing_network)
            # The chain ends at the export: nothing a header inside it names is ever opened.
            ET.SubElement(store, "backingStore")
        else:
            source = _SOURCES[resolved.backing_type](store, base, resolved.backing_fd_group)
            if dac and (not resolved.backing_relabel or resolved.backing_fd_group):
                _no_relabel(source)

    target_attrs = {"dev": target, "bus": disk.bus}
    if disk.device == "cdrom":
        target_attrs["tray"] = disk.tray or "closed"
    ET.SubElement(element, "target", target_attrs)
    if disk.boot_order is not None:
        ET.SubElement(element, "boot", order=str(disk.boot_order))
    if read_only:
        ET.SubElement(element, "readonly")
    if disk.shareable:
        ET.SubElement(element, "shareable")
    block_io = _block_io(disk, resolved, at)
    if block_io is not None:
        # The discard granularity KubeVirt adds is not in Debian 12's libvirt (9.0) schema: a custom one is
        # refused in _block_io; a detected one is left to qemu, which derives it from the block sizes.
        ET.SubElement(element, "blockio", logical_block_size=str(block_io[0]), physical_block_size=str(block_io[1]))
    if disk.serial and disk.device == "disk":  # KubeVirt sets serials on disk devices only
        _text(element, "serial", disk.serial)
    ET.SubElement(element, "alias", name=f"ua-{disk.name}")  # libvirt keeps user aliases only with "ua-"
    if disk.bus == "scsi" and disk.device in ("disk", "lun"):
        ET.SubElement(element, "address", type="drive", controller=str(_SCSI_CONTROLLER), bus="0", target="0", unit=str(unit))
    elif disk.pci_address:
        domain_, bus, rest = disk.pci_address.split(":")
        slot, function = rest.split(".")
        ET.SubElement(element, "address", type="pci", domain=f"0x{domain_}", bus=f"0x{bus}", slot=f"0x{slot}", function=f"0x{function}")
    return element


def _check_reservation(vmi: VMI, disk: Disk, resolved: ResolvedDisk) -> None:
    """lun.reservation, admitted with its gate (launcher.spec.gates), renders no `<reservations>`.

    KubeVirt (converter/storage/disk.go setReservation) points `<source><reservations>` at its pr-helper
    socket: its qemu runs unprivileged on a host SCSI device, whose kernel lets only a privileged
    process send PERSISTENT RESERVE, so the helper sends them for it. A lun on an iSCSI PV here is
    qemu's own iSCSI session to the target (libvirt's scsi-block on qemu's iSCSI driver), which carries
    the guest's PERSISTENT RESERVE commands to the target itself: the guest gets what the pr-helper
    gives it, and libvirt 9.0 would refuse `<reservations>` on a network disk anyway. Any other lun
    (a block device or file, bus virtio) would need the helper and a host SCSI device: refused."""
    if not disk.reservation:
        return
    iscsi = resolved.type == "network" and resolved.network.protocol == "iscsi"
    if disk.bus != "scsi" or not iscsi:
        what = f"on bus {disk.bus}" if disk.bus != "scsi" else f"a {resolved.type} disk"
        raise SpecError(_disk_at(vmi, disk, ".lun.reservation"),
                        f"works only on a lun on bus scsi backed by an iSCSI PersistentVolume (qemu's own initiator carries the"
                        f" guest's reservations to the target); this lun is {what}, which would need KubeVirt's pr-helper on a"
                        f" host SCSI device, which the launcher does not run")


def _block_io(disk: Disk, resolved: ResolvedDisk, at: str) -> tuple[int, int, int | None] | None:
    """storage/disk.go convert_v1_BlockSize_To_api_BlockIO: the custom sizes, or the backend's."""
    if disk.block_size is not None:
        if disk.block_size[2] is not None:
            raise SpecError(f"{at}.blockSize.custom.discardGranularity",
                            "needs a libvirt that sets discard_granularity (this one, 9.0, cannot); leave it out")
        return disk.block_size
    if not disk.match_volume_block_size:
        return None
    if resolved.block_io is None:
        raise SpecError(f"{at}.blockSize.matchVolume", "failed to configure disk with block size detection enabled:"
                                                        " disk is neither a block device nor a file")
    return resolved.block_io


def _disks(vmi: VMI, resolved: dict[str, ResolvedDisk], devices: ET.Element, dac: bool) -> None:
    total, shared = io_threads(vmi)
    next_shared, next_dedicated = 1, shared + 1
    counters = {"vd": 0, "sd": 0}
    for disk in vmi.domain.devices.disks:
        volume = vmi.volume(disk.name)
        if disk.name not in resolved:
            raise SpecError(f"spec.volumes[{volume.index}]", f"no resolved disk for volume {volume.name}")
        prefix = "vd" if disk.bus == "virtio" else "sd"
        unit = counters[prefix]
        counters[prefix] += 1
        iothread = None
        if total and disk.bus == "virtio":  # storage/disk.go assignDiskIOThread
            if disk.dedicated_io_thread:
                iothread, next_dedicated = next_dedicated, next_dedicated + 1
            else:
                iothread, next_shared = next_shared, next_shared % shared + 1
        devices.append(_disk(vmi, disk, volume, resolved[disk.name], _device_name(prefix, unit), unit, iothread, dac))


def _efi(os_: ET.Element, vmi: VMI, host: Host) -> None:
    """compute/os.go configureEFI without firmware auto-selection (an alpha gate): the code read-only
    from pflash, secure for secure boot, and the VM's own variable store made from the template."""
    secure = vmi.domain.firmware.secure_boot
    if not (host.efi_code and host.efi_vars and host.nvram):
        # virt-launcher's words (pkg/virt-launcher/virtwrap/manager.go) when efi.Bootable fails
        raise SpecError("spec.domain.firmware.bootloader.efi", f"EFI OVMF roms missing for booting in EFI mode with"
                                                               f" SecureBoot={str(secure).lower()}, SEV/SEV-ES=false, SEV-SNP=false, TDX=false")
    _text(os_, "loader", host.efi_code, readonly="yes", secure="yes" if secure else "no", type="pflash")
    _text(os_, "nvram", host.nvram, template=host.efi_vars)


def _os(vmi: VMI, host: Host) -> ET.Element:
    firmware = vmi.domain.firmware
    os_ = ET.Element("os")
    _text(os_, "type", "hvm", arch=host.arch, machine=vmi.domain.machine_type)
    if firmware.bootloader == "efi":
        _efi(os_, vmi, host)
    kernel_boot = firmware.kernel_boot
    if kernel_boot is not None and kernel_boot.container is not None:
        at = "spec.domain.firmware.kernelBoot.container"
        for key, wanted, got, tag in (("kernelPath", kernel_boot.container.kernel_path, host.kernel, "kernel"),
                                      ("initrdPath", kernel_boot.container.initrd_path, host.initrd, "initrd")):
            if wanted is None:
                continue
            if got is None:
                raise SpecError(f"{at}.{key}", f"{wanted} was not resolved to a file on the host")
            _text(os_, tag, got)
        if kernel_boot.kernel_args:
            _text(os_, "cmdline", kernel_boot.kernel_args)
    ET.SubElement(os_, "smbios", mode="sysinfo")
    if firmware.bios_use_serial:
        ET.SubElement(os_, "bios", useserial="yes")
    return os_


def _cpu(vmi: VMI, host: Host) -> ET.Element:
    model = vmi.domain.cpu.model
    if model == "host-passthrough" and host.domain_type != "kvm":
        # KubeVirt under useEmulation renders the mode as written (converter/compute/cpu.go
        # configureCPUModel; kvm/configurator.go makes the domain type qemu), and libvirt refuses
        # to start it, in these words: refused here before anything starts.
        raise SpecError("spec.domain.cpu.model", f"host-passthrough: CPU mode 'host-passthrough' for {host.arch} qemu domain on"
                                                 f" {host.arch} host is not supported by hypervisor (this VM runs under TCG, as"
                                                 " the accelerator line says); use host-model or a named model, or run under KVM")
    if model in ("host-model", "host-passthrough"):
        # As written, as KubeVirt renders it with useEmulation too: under TCG libvirt expands host-model
        # to what TCG emulates (its domcapabilities for virttype qemu, which KubeVirt's node labeller reads).
        cpu = ET.Element("cpu", mode=model)
    elif model is None:
        # KubeVirt's default is host-model (DefaultCPUModel); under TCG the mode is left out and QEMU
        # picks its default TCG model (docs/kubevirt.md, Differences).
        cpu = ET.Element("cpu", {"mode": DEFAULT_CPU_MODEL} if host.domain_type == "kvm" else {})
    else:
        cpu = ET.Element("cpu", mode="custom", match="exact")
        _text(cpu, "model", model, fallback="allow")
    sockets, cores, threads = vmi.domain.topology
    ET.SubElement(cpu, "topology", sockets=str(_hotplug_sockets(vmi, host) or sockets), cores=str(cores), threads=str(threads))
    # compute/cpu.go configureCPUFeatures; libvirt takes no feature without a model or a mode, which is
    # what TCG's default CPU has (evmcs' vmx is then moot: the guest has no Hyper-V, features.notes says so)
    if cpu.get("mode") or cpu.find("model") is not None:
        for name, policy in vmi.domain.cpu.features:
            ET.SubElement(cpu, "feature", name=name, policy=policy)
    return cpu


def _hotplug_sockets(vmi: VMI, host: Host) -> int | None:
    """cpu.maxSockets where the architecture hotplugs CPUs (converter/arch: amd64 and s390x, not arm64)."""
    return vmi.domain.cpu.max_sockets if host.arch in HOTPLUG_ARCHES else None


def _vcpu_count(vmi: VMI, host: Host) -> int:
    """<vcpu>: every vCPU the sockets can hold, enabled or not (compute/cpu.go configureCPUTopology)."""
    _, cores, threads = vmi.domain.topology
    max_sockets = _hotplug_sockets(vmi, host)
    return max_sockets * cores * threads if max_sockets else vmi.domain.vcpus


def _hotplug_vcpus(domain: ET.Element, vmi: VMI, host: Host) -> None:
    """compute/cpu.go configureCPUTopology: with maxSockets, the requested vCPUs enabled and the rest
    there to be plugged; the first socket's are never unplugged (libvirt takes the enabled as current)."""
    if not _hotplug_sockets(vmi, host):
        return
    _, cores, threads = vmi.domain.topology
    vcpus = ET.SubElement(domain, "vcpus")
    for vcpu in range(_vcpu_count(vmi, host)):
        ET.SubElement(vcpus, "vcpu", id=str(vcpu), enabled="yes" if vcpu < vmi.domain.vcpus else "no",
                      hotpluggable="yes" if vcpu >= cores * threads else "no")


def _cputune(domain: ET.Element, vmi: VMI, host: Host, iothreads: int) -> None:
    sockets, cores, threads = vmi.domain.topology
    tune = cpupin.fit(host.topology, host.cpuset, sockets, cores, threads, vmi.domain.cpu.isolate_emulator_thread, iothreads)
    cputune = ET.SubElement(domain, "cputune")
    for vcpu, thread in enumerate(tune.vcpupin):
        ET.SubElement(cputune, "vcpupin", vcpu=str(vcpu), cpuset=str(thread))
    if tune.emulatorpin is not None:
        ET.SubElement(cputune, "emulatorpin", cpuset=str(tune.emulatorpin))
    for iothread, cpuset in tune.iothreadpin:
        ET.SubElement(cputune, "iothreadpin", iothread=str(iothread), cpuset=cpuset)


def _filesystems(vmi: VMI, host: Host, devices: ET.Element) -> None:
    """converter/storage/virtiofs.go: libvirt connects to a virtiofsd started outside it (KubeVirt's
    runs in a container of its own); the filesystem's name is the tag the guest mounts."""
    sockets = dict(host.virtiofs_sockets)
    for fs in vmi.domain.devices.filesystems:
        if fs.name not in sockets:
            raise SpecError(f"spec.domain.devices.filesystems[{fs.index}]", f"no virtiofsd socket for filesystem {fs.name}")
        element = ET.SubElement(devices, "filesystem", type="mount", accessmode="passthrough")
        ET.SubElement(element, "driver", type="virtiofs", queue="1024")
        ET.SubElement(element, "source", socket=sockets[fs.name])
        ET.SubElement(element, "target", dir=fs.name)


def _shared_memory(domain: ET.Element, cpu: ET.Element, vmi: VMI, host: Host) -> None:
    """vhost-user needs guest RAM the virtiofsd can map: compute/memory_backing.go gives it memfd,
    shared, and compute/cpu.go configureSyntheticNUMA one NUMA cell holding all of it."""
    backing = ET.SubElement(domain, "memoryBacking")
    ET.SubElement(backing, "source", type="memfd")
    ET.SubElement(backing, "access", mode="shared")
    numa = ET.SubElement(cpu, "numa")
    ET.SubElement(numa, "cell", id="0", cpus=f"0-{_vcpu_count(vmi, host) - 1}", memory=str(vmi.domain.guest_memory // 1024), unit="KiB")


def _tpm(devices: ET.Element, persistent: bool, socket: str | None) -> None:
    """compute/tpm.go: TPM 2.0 through swtpm, which libvirt starts; a persistent one is tpm-crb (KubeVirt
    meant to move every TPM to it) and libvirt keeps its state when the domain goes. With `socket` the
    caller runs the swtpm and qemu connects to it (libvirt 9.0's external backend): the guest's device
    is the same."""
    tpm = ET.SubElement(devices, "tpm", model="tpm-crb" if persistent else "tpm-tis")
    if socket is not None:
        backend = ET.SubElement(tpm, "backend", type="external", version="2.0")
        ET.SubElement(backend, "source", type="unix", mode="connect", path=socket)
        return
    backend = ET.SubElement(tpm, "backend", type="emulator", version="2.0")
    if persistent:
        backend.set("persistent_state", "yes")


def notes(vmi: VMI, host: Host) -> tuple[str, ...]:
    """What the guest runs without on this host that KubeVirt's domain asks for, one line per field."""
    return features.notes(vmi, host.domain_type) + clock.notes(vmi, host.domain_type)
# network/virtio-queues.go MultiQueueMaxQueues
MAX_NETWORK_QUEUES = 256


def network_queues(vmi: VMI) -> int:
    """NetworkQueuesCapacity: a queue per vCPU with networkInterfaceMultiqueue. The launcher's pod
    network is a stream socket to the VM's pod switch (launcher.network), which carries one queue; a
    Multus bridge network's tap has as many as the NIC (launcher.network.linuxbridge makes it so)."""
    if not vmi.domain.devices.network_multiqueue:
        return 0
    queues = min(vmi.domain.vcpus, MAX_NETWORK_QUEUES)
    if queues > 1 and any(i.model == "virtio" and i.on_pod_network for i in vmi.domain.devices.interfaces):
        raise SpecError("spec.domain.devices.networkInterfaceMultiqueue",
                        f"{queues} queues (one per vCPU) are not supported by the launcher's pod network,"
                        " a stream socket to the VM's pod switch (one queue); leave it out or give the VM one vCPU")
    return queues


def render(vmi: VMI, disks: dict[str, ResolvedDisk], host: Host) -> str:
    """The libvirt domain XML for `vmi`; `disks` maps each volume name to its resolved file, device or
    network source (whose credentials the caller defines first, see secret_xml)."""
    domain = ET.Element("domain", type=host.domain_type)
    _text(domain, "name", vmi.domain_name)
    _text(domain, "uuid", vmi.uuid)
    _text(domain, "memory", str(vmi.domain.guest_memory), unit="b")
    _text(domain, "vcpu", str(_vcpu_count(vmi, host)), placement="static")
    _hotplug_vcpus(domain, vmi, host)
    total_threads, _ = io_threads(vmi)
    if total_threads:
        _text(domain, "iothreads", str(total_threads))
    if vmi.domain.cpu.dedicated_cpu_placement:
        _cputune(domain, vmi, host, total_threads)

    compute.sysinfo(vmi, domain)
    domain.append(_os(vmi, host))
    domain.append(features.render(vmi, host.domain_type))
    cpu = _cpu(vmi, host)
    if vmi.domain.devices.filesystems:
        _shared_memory(domain, cpu, vmi, host)
    domain.append(cpu)
    domain.append(clock.render(vmi))
    _text(domain, "on_poweroff", "destroy")
    _text(domain, "on_reboot", "restart")
    _text(domain, "on_crash", "destroy")

    devices = ET.SubElement(domain, "devices")
    if host.emulator:
        _text(devices, "emulator", host.emulator)
    # A domain-level relabel='no' (a VM's own label) covers every source, and libvirt refuses overrides under it.
    _disks(vmi, disks, devices, host.dac and host.dac_label is None)
    _filesystems(vmi, host, devices)
    model = "virtio-transitional" if vmi.domain.devices.use_virtio_transitional else "virtio-non-transitional"
    queues = network_queues(vmi)
    taps = {name: (device, mac) for name, device, mac in host.taps}
    for iface in vmi.domain.devices.interfaces:
        interfaces.render(iface, model, devices, queues, taps.get(iface.name))
    disks = vmi.domain.devices.disks
    # model none keeps libvirt from adding a USB controller nobody asked for (compute/controllers.go)
    ET.SubElement(devices, "controller", type="usb", index="0", model="qemu-xhci" if compute.usb_needed(vmi) else "none")
    # compute/controllers.go requiresSCSIController: always there for hotplug, unless disableHotplug
    # and no disk is on scsi.
    model = "virtio-transitional" if vmi.domain.devices.use_virtio_transitional else "virtio-non-transitional"
    if not vmi.domain.devices.disable_hotplug or any(d.bus == "scsi" for d in disks):
        ET.SubElement(devices, "controller", type="scsi", index=str(_SCSI_CONTROLLER), model=model)
    # compute/controllers.go requiresVirtioSerialController: the guest sees a virtio-serial device
    # whenever the serial console is attached, channel or not
    if vmi.domain.devices.autoattach_serial_console:
        ET.SubElement(devices, "controller", type="virtio-serial", index="0", model=model)
    if vmi.domain.devices.autoattach_serial_console:
        serial = ET.SubElement(devices, "serial", type="pty")
        if host.serial_log:
            # append="on", as KubeVirt's converter/compute/console.go: the log is made fresh for each run
            # (launcher.runtime.rundir), and the log daemon, qemu's user, could not delete it to truncate.
            ET.SubElement(serial, "log", file=host.serial_log, append="on")
        ET.SubElement(serial, "target", port="0")
        console = ET.SubElement(devices, "console", type="pty")
        ET.SubElement(console, "target", type="serial", port="0")
    compute.channel(devices, host.agent_socket)
    compute.inputs(vmi, devices)
    compute.graphics(vmi, devices, host.vnc_socket)
    compute.memballoon(vmi, devices, model)
    if vmi.domain.devices.rng:
        # compute/rng.go: virtio (transitional or not, as every virtio device here), fed by /dev/urandom
        rng = ET.SubElement(devices, "rng", model=model)
        _text(rng, "backend", "/dev/urandom", model="random")
    if vmi.domain.devices.tpm is not None:
        _tpm(devices, vmi.domain.devices.tpm.persistent, host.tpm_socket)
    pod_nics = [iface for iface in vmi.domain.devices.interfaces if iface.on_pod_network]
    interfaces.backends(domain, [(iface, interfaces.socket_path(host.net_dir, i)) for i, iface in enumerate(pod_nics)])

    if host.dac_label is not None:
        # libvirt's static DAC label ("+UID:+GID": ids, never names): the process's ids; relabel='no'
        # leaves every file as the launcher gave it (docs/formatdomain: Security label).
        label = ET.SubElement(domain, "seclabel", type="static", model="dac", relabel="no")
        _text(label, "label", f"+{host.dac_label[0]}:+{host.dac_label[1]}")

    ET.indent(domain, "  ")
    return ET.tostring(domain, encoding="unicode") + "\n"

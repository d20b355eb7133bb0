"""The devices KubeVirt's converter adds to every domain besides disks and NICs (pure): the VNC display
and its video card, input devices, the memory balloon, the guest agent's channel and the SMBIOS
system entries.

Follows pkg/virt-launcher/virtwrap/converter/compute (graphics.go, input_device.go, balloon.go,
channels.go, sysinfo.go) with the cluster defaults virt-handler hands virt-launcher
(pkg/virt-config: SMBIOS KubeVirt/KubeVirt/None, a balloon statistics period of 10 s, free page
reporting on, the bochs display for EFI guests). One difference: the VNC and guest-agent sockets are the
caller's (the VM's run directory) instead of /var/run/kubevirt-private/UID/virt-vnc and libvirt's
choice, or libvirt's own when the caller has none.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the guest agent's lookups (launcher.runtime.guestagent) need the channel's name, not the spec's parser
    from launcher.spec.vmi import VMI

# staging/src/kubevirt.io/api/core/v1/types.go FreePageReportingDisabledAnnotation
FREE_PAGE_REPORTING_DISABLED = "kubevirt.io/free-page-reporting-disabled"
GUEST_AGENT_CHANNEL = "org.qemu.guest_agent.0"
# pkg/virt-config/virt-config.go: SmbiosConfigDefault*; sku and version are empty, and libvirt drops
# empty entries, so the guest sees the three.
SMBIOS_SYSTEM = (("manufacturer", "KubeVirt"), ("family", "KubeVirt"), ("product", "None"), ("sku", ""), ("version", ""))
BALLOON_STATS_PERIOD = 10  # virt-config.go DefaultMemBalloonStatsPeriod
VIDEO_VRAM = 16384  # graphics.go graphicsDeviceDefaultVRAM (KiB)
VIDEO_HEADS = 1


def sysinfo(vmi: VMI, domain: ET.Element) -> None:
    """sysinfo.go buildSystem: the firmware's UUID and serial, then the cluster's SMBIOS entries."""
    system = ET.SubElement(ET.SubElement(domain, "sysinfo", type="smbios"), "system")
    entries = [("uuid", vmi.uuid)]
    if vmi.domain.firmware.serial:
        entries.append(("serial", vmi.domain.firmware.serial))
    for name, value in entries + list(SMBIOS_SYSTEM):
        ET.SubElement(system, "entry", name=name).text = value


def usb_needed(vmi: VMI) -> bool:
    """arch/amd64.go IsUSBNeeded: an input or a disk on usb."""
    devices = vmi.domain.devices
    return any(i.bus == "usb" for i in devices.inputs) or any(d.bus == "usb" and d.device == "disk" for d in devices.disks)


def channel(devices: ET.Element, socket: str | None) -> None:
    """channels.go newGuestAgentChannel: always there. KubeVirt lets libvirt pick the socket; the
    caller may name one (libvirt's own path below a session daemon's HOME can be too long for one)."""
    element = ET.SubElement(devices, "channel", type="unix")
    if socket:
        ET.SubElement(element, "source", mode="bind", path=socket)
    ET.SubElement(element, "target", type="virtio", name=GUEST_AGENT_CHANNEL)


def inputs(vmi: VMI, devices: ET.Element) -> None:
    """input_device.go: the spec's tablets; amd64 adds none of its own (libvirt adds PS/2 ones)."""
    for device in vmi.domain.devices.inputs:
        attrs = {"type": device.type, "bus": device.bus}
        if device.bus == "virtio":
            attrs["model"] = "virtio"
        element = ET.SubElement(devices, "input", attrs)
        ET.SubElement(element, "alias", name=f"ua-{device.name}")


def graphics(vmi: VMI, devices: ET.Element, socket: str | None) -> None:
    """graphics.go: VNC on a unix socket, and a VGA card (bochs for EFI guests, as virt-handler's
    BochsDisplayForEFIGuests default has it), or the type devices.video names; nothing when
    autoattachGraphicsDevice is false."""
    if not vmi.domain.devices.autoattach_graphics:
        return
    element = ET.SubElement(devices, "graphics", type="vnc")
    ET.SubElement(element, "listen", {"type": "socket", **({"socket": socket} if socket else {})})
    video = ET.SubElement(devices, "video")
    if vmi.domain.devices.video is not None:
        ET.SubElement(video, "model", type=vmi.domain.devices.video, vram=str(VIDEO_VRAM), heads=str(VIDEO_HEADS))
    elif vmi.domain.firmware.bootloader == "efi":
        ET.SubElement(video, "model", type="bochs", heads=str(VIDEO_HEADS))
    else:
        ET.SubElement(video, "model", type="vga", vram=str(VIDEO_VRAM), heads=str(VIDEO_HEADS))


def free_page_reporting(vmi: VMI) -> bool:
    """virtwrap/manager.go isFreePageReportingEnabled: not for high-performance VMIs (dedicated CPUs;
    realtime and hugepages are refused here) nor when the VMI's annotation turns it off."""
    return (vmi.domain.devices.autoattach_mem_balloon and not vmi.domain.cpu.dedicated_cpu_placement
            and vmi.annotations.get(FREE_PAGE_REPORTING_DISABLED) != "true")


def memballoon(vmi: VMI, devices: ET.Element, virtio_model: str) -> None:
    """balloon.go: model none when autoattachMemBalloon is false, else virtio with statistics."""
    if not vmi.domain.devices.autoattach_mem_balloon:
        ET.SubElement(devices, "memballoon", model="none")
        return
    balloon = ET.SubElement(devices, "memballoon", model=virtio_model,
                            freePageReporting="on" if free_page_reporting(vmi) else "off")
    ET.SubElement(balloon, "stats", period=str(BALLOON_STATS_PERIOD))

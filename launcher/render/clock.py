"""<clock> as KubeVirt's converter builds it (compute/clock.go), and the timers emulation lacks (pure).

utc gives offset='utc' with adjustment='reset' (the clock starts at the host's UTC on every boot) or
the offset in seconds; timezone gives offset='timezone'; each timer given becomes a <timer> (kvm is
libvirt's kvmclock, hyperv its hypervclock) with its tick policy and present='yes|no'. A VMI without
spec.domain.clock gets the UTC clock libvirt gives a domain without one, said explicitly.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from launcher.spec.vmi import VMI

LIBVIRT_NAMES = {"kvm": "kvmclock", "hyperv": "hypervclock"}
# paravirtual clocks: QEMU provides them only with KVM
NEED_KVM = {"kvm": "the KVM clock", "hyperv": "the Hyper-V clock"}
AT = "spec.domain.clock.timer"


def render(vmi: VMI) -> ET.Element:
    spec = vmi.domain.clock
    if spec is None:
        return ET.Element("clock", offset="utc")
    clock = ET.Element("clock")
    if spec.offset == "utc":
        clock.set("offset", "utc")
        clock.set("adjustment", "reset" if spec.offset_seconds is None else str(spec.offset_seconds))
    elif spec.offset == "timezone":
        clock.set("offset", "timezone")
        clock.set("timezone", spec.timezone)
    for timer in spec.timers:
        element = ET.SubElement(clock, "timer", name=LIBVIRT_NAMES.get(timer.name, timer.name))
        if timer.tick_policy:
            element.set("tickpolicy", timer.tick_policy)
        element.set("present", "yes" if timer.present else "no")
        if timer.track:
            element.set("track", timer.track)
    return clock


def notes(vmi: VMI, domain_type: str) -> tuple[str, ...]:
    """One line per present timer the guest runs without under emulation; none on KVM."""
    if domain_type == "kvm" or vmi.domain.clock is None:
        return ()
    return tuple(f"{AT}.{t.name}: {NEED_KVM[t.name]} needs KVM; under emulation (TCG) the guest runs without it"
                 for t in vmi.domain.clock.timers if t.name in NEED_KVM and t.present)

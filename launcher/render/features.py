"""<features> as KubeVirt's converter builds it (compute/hypervisor_features.go), and what emulation drops (pure).

acpi, apic, hyperv (every enlightenment given, or mode='passthrough'), smm, kvm (hidden, and the
dedicated-CPU hint) and pvspinlock, in its order. Under emulation (TCG: no usable /dev/kvm) QEMU
exposes no Hyper-V enlightenment, KVM clock or paravirtual spinlock to the guest at all, so the
domain keeps what KubeVirt renders, except what stops QEMU from starting there: Hyper-V's vpindex
("kernel doesn't allow setting HyperV VP_INDEX"), pvspinlock on ("host doesn't support paravirtual
spinlocks"), the dedicated-CPU hint; `notes` says in one line per field what the guest runs without.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from launcher.spec.hyperv import Enlightenment, Hyperv
from launcher.spec.vmi import VMI

# KubeVirt's field -> libvirt's element (api.FeatureHyperv)
ELEMENTS = {"synictimer": "stimer", "vendorid": "vendor_id"}
# what QEMU refuses to start with under TCG
TCG_REFUSES = frozenset({"vpindex"})
AT = "spec.domain.features"


def _on(value: bool) -> str:
    return "on" if value else "off"


def _enlightenment(parent: ET.Element, item: Enlightenment) -> None:
    element = ET.SubElement(parent, ELEMENTS.get(item.name, item.name), state=_on(item.enabled))
    if item.retries is not None:
        element.set("retries", str(item.retries))
    if item.vendor_id:
        element.set("value", item.vendor_id)
    if item.direct is not None:
        ET.SubElement(element, "direct", state=_on(item.direct))


def _hyperv(features: ET.Element, hyperv: Hyperv, tcg: bool) -> None:
    element = ET.SubElement(features, "hyperv")
    for item in hyperv.enlightenments:
        if not (tcg and item.name in TCG_REFUSES):
            _enlightenment(element, item)


def render(vmi: VMI, domain_type: str) -> ET.Element:
    spec = vmi.domain.features
    tcg = domain_type != "kvm"
    features = ET.Element("features")
    for name, enabled in (("acpi", spec.acpi), ("apic", spec.apic)):
        if enabled:
            ET.SubElement(features, name)
    if spec.hyperv is not None:
        _hyperv(features, spec.hyperv, tcg)
    elif spec.hyperv_passthrough:
        ET.SubElement(features, "hyperv", mode="passthrough")
    if spec.smm:
        ET.SubElement(features, "smm")
    hint = vmi.domain.cpu.dedicated_cpu_placement and not tcg
    if spec.kvm_hidden is not None or hint:
        kvm = ET.SubElement(features, "kvm")
        if spec.kvm_hidden is not None:
            ET.SubElement(kvm, "hidden", state=_on(spec.kvm_hidden))
        if hint:
            # KubeVirt always adds the hint with dedicated CPUs (vcpu.AdjustDomainForTopologyAndCPUSet)
            ET.SubElement(kvm, "hint-dedicated", state="on")
    if spec.pvspinlock is not None and not (tcg and spec.pvspinlock):
        ET.SubElement(features, "pvspinlock", state=_on(spec.pvspinlock))
    return features


def notes(vmi: VMI, domain_type: str) -> tuple[str, ...]:
    """One line per feature field the guest runs without under emulation; none on KVM."""
    if domain_type == "kvm":
        return ()
    spec = vmi.domain.features
    found = []
    enabled = spec.hyperv.enabled if spec.hyperv is not None else ()
    if enabled:
        found.append(f"{AT}.hyperv: Hyper-V enlightenments need KVM; under emulation (TCG) the guest runs without them"
                     f" ({', '.join(enabled)})")
    if spec.hyperv_passthrough:
        found.append(f"{AT}.hypervPassthrough: passes the host's Hyper-V enlightenments through, which needs KVM;"
                     " under emulation (TCG) the guest runs without them")
    if spec.pvspinlock:
        found.append(f"{AT}.pvspinlock: paravirtual spinlocks need KVM; under emulation (TCG) the guest runs without them")
    return tuple(found)

"""Instance types and preferences applied to VirtualMachines as KubeVirt applies them.

The objects are written here from kubevirt/common-instancetypes (instancetypes/{u,o,cx,m}/1/*.yaml,
preferences/{fedora,windows/11}/... and preferences/components/*) and the cases from KubeVirt's unit
tests under pkg/instancetype (file and test name cited per test). Each pure case renders the domain
XML and checks what the guest would get; the end-to-end test boots the test guest.
"""

from __future__ import annotations

import copy
import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from launcher.render.domain import Host, ResolvedDisk, render
from launcher.spec.fields import SpecError
from launcher.spec.instancetype import expand, quantity_text
from launcher.spec.k8s import Objects
from launcher.spec.vmi import load_vmi, parse_vmi
from tests.testguest import parse_console
from tests.vmhost import NOREG

V1B1 = "instancetype.kubevirt.io/v1beta1"


def _size(name: str, cpus: int, guest_memory: str, cpu=None, memory=None, **extra) -> dict:
    return {"apiVersion": V1B1, "kind": "VirtualMachineClusterInstancetype", "metadata": {"name": name},
            "spec": {"cpu": {"guest": cpus, **(cpu or {})}, "memory": {"guest": guest_memory, **(memory or {})}, **extra}}


# common-instancetypes: instancetypes/u/1/sizes.yaml, o/1 (o1.yaml: overcommitPercent 50),
# cx/1 (cx1.yaml: dedicated CPUs, isolated emulator thread, NUMA passthrough, ioThreadsPolicy auto;
# sizes: maxSockets = guest, 2Mi hugepages), m/1 (sizes: 2Mi hugepages).
CORPUS = [
    _size("u1.medium", 1, "4Gi"),
    _size("u1.large", 2, "8Gi"),
    _size("u1.2xlarge", 8, "32Gi"),
    _size("o1.large", 2, "8Gi", memory={"overcommitPercent": 50}),
    _size("cx1.large", 2, "4Gi", cpu={"maxSockets": 2, "dedicatedCPUPlacement": True, "isolateEmulatorThread": True,
                                     "numa": {"guestMappingPassthrough": {}}},
          memory={"hugepages": {"pageSize": "2Mi"}}, ioThreadsPolicy="auto"),
    _size("m1.large", 2, "16Gi", memory={"hugepages": {"pageSize": "2Mi"}}),
    # preferences/linux + fedora/requirements + components rng, diskbus-virtio-blk,
    # interfacemodel-virtio-net, secureboot, preferred/required-architecture amd64.
    {"apiVersion": V1B1, "kind": "VirtualMachineClusterPreference", "metadata": {"name": "fedora"},
     "spec": {"devices": {"preferredDiskBus": "virtio", "preferredInterfaceModel": "virtio", "preferredRng": {}},
              "features": {"preferredSmm": {}}, "firmware": {"preferredEfi": {"secureBoot": True}},
              "preferredArchitecture": "amd64", "requirements": {"architecture": "amd64", "cpu": {"guest": 1}, "memory": {"guest": "2Gi"}}}},
    # preferences/windows/11: requirements 2 vCPU / 4Gi, cpu-topology-cores, efi-persisted, tpm,
    # secureboot; windows base: sata disks, e1000e, hyperv clock and features.
    {"apiVersion": V1B1, "kind": "VirtualMachineClusterPreference", "metadata": {"name": "windows.11"},
     "spec": {"cpu": {"preferredCPUTopology": "cores"},
              "devices": {"preferredDiskBus": "sata", "preferredInterfaceModel": "e1000e", "preferredTPM": {"persistent": True}},
              "clock": {"preferredClockOffset": {"utc": {}}, "preferredTimer": {"hpet": {"present": False}}},
              "features": {"preferredAcpi": {}, "preferredApic": {}, "preferredHyperv": {"relaxed": {}}, "preferredSmm": {}},
              "firmware": {"preferredEfi": {"persistent": True, "secureBoot": True}},
              "requirements": {"cpu": {"guest": 2}, "memory": {"guest": "4Gi"}}}},
    # components/cpu-topology-spread (SocketsCoresThreads) and a plain cores preference.
    {"apiVersion": V1B1, "kind": "VirtualMachineClusterPreference", "metadata": {"name": "spread"},
     "spec": {"cpu": {"preferredCPUTopology": "spread", "spreadOptions": {"across": "SocketsCoresThreads"}}}},
    {"apiVersion": V1B1, "kind": "VirtualMachinePreference", "metadata": {"name": "cores", "namespace": "ns"},
     "spec": {"cpu": {"preferredCPUTopology": "cores"},
              "devices": {"preferredDiskBus": "virtio", "preferredCdromBus": "scsi", "preferredDiskCache": "writethrough",
                          "preferredDiskIO": "threads", "preferredDiskDedicatedIoThread": True},
              "machine": {"preferredMachineType": "pc-q35-rhel9.4.0"}, "annotations": {"from": "preference"}}},
    {"apiVersion": V1B1, "kind": "VirtualMachineInstancetype", "metadata": {"name": "small", "namespace": "ns"},
     "spec": {"cpu": {"guest": 4}, "memory": {"guest": "1Gi"}, "annotations": {"from": "instancetype"}}},
]
OBJECTS = Objects(CORPUS)


def vm(instancetype=None, preference=None, disks=None, volumes=None, domain=None, namespace="ns", **spec) -> dict:
    template_spec = {"domain": {"devices": {"disks": disks if disks is not None else []}, **(domain or {})},
                     "volumes": volumes if volumes is not None else [{"name": "root", "containerDisk": {"image": "quay.io/x/y:1"}}]}
    doc = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "vm1", "namespace": namespace},
           "spec": {"template": {"spec": template_spec}, **spec}}
    if instancetype is not None:
        doc["spec"]["instancetype"] = instancetype if isinstance(instancetype, dict) else {"name": instancetype}
    if preference is not None:
        doc["spec"]["preference"] = preference if isinstance(preference, dict) else {"name": preference}
    return doc


EFI_HOST = Host(efi_code="/ovmf/CODE.fd", efi_vars="/ovmf/VARS.fd", nvram="/state/vm1_VARS.fd")  # what launcher.volumes.vmstate finds


def domain_xml(doc: dict, objects=OBJECTS) -> ET.Element:
    vmi = parse_vmi(doc, objects=objects)
    disks = {v.name: ResolvedDisk(f"/run/{v.name}.qcow2", "qcow2") for v in vmi.volumes}
    return ET.fromstring(render(vmi, disks, EFI_HOST))


def summary(xml: ET.Element) -> dict:
    topology = xml.find("cpu/topology")
    return {"vcpu": int(xml.findtext("vcpu")), "memory": int(xml.findtext("memory")),
            "topology": tuple(int(topology.get(k)) for k in ("sockets", "cores", "threads")),
            "buses": [t.get("bus") for t in xml.findall("devices/disk/target")]}


def error(doc: dict, objects=OBJECTS) -> str:
    with pytest.raises(SpecError) as err:
        parse_vmi(doc, objects=objects)
    return err.value.line()


# ---------------------------------------------------------------- instance types

def test_u1_large_gives_its_vcpus_as_sockets_and_its_memory():
    # apply/cpu_test.go "should default to PreferSockets"; apply/memory_test.go "should apply memory spec to VMI"
    assert summary(domain_xml(vm("u1.large"))) == {"vcpu": 2, "memory": 8 << 30, "topology": (2, 1, 1), "buses": ["sata"]}


def test_one_vcpu_is_one_socket_one_core_one_thread():
    # apply/cpu.go applyGuestCPUTopology: 1 vCPU is 1:1:1 whatever the preferred topology
    assert summary(domain_xml(vm("u1.medium", {"name": "cores", "kind": "VirtualMachinePreference"})))["topology"] == (1, 1, 1)


@pytest.mark.parametrize("preference,topology", [
    ("cores", (1, 8, 1)),  # apply/cpu_test.go "should apply in full with PreferCores selected"
    ("spread", (2, 2, 2)),  # apply/cpu_test.go "to SocketsCoresThreads with 8 vCPUs and a default ratio of 1:2:2"
])
def test_preferred_topology_places_the_vcpus(preference, topology):
    preference = {"name": preference, "kind": "VirtualMachinePreference"} if preference == "cores" else preference
    result = summary(domain_xml(vm("u1.2xlarge", preference)))
    assert (result["vcpu"], result["topology"]) == (8, topology)


def test_spread_that_does_not_divide_is_refused():
    # preference/validation/cpu.go CheckSpreadCPUTopology, its message
    doc = vm("u1.large", "spread")  # 2 vCPUs over 2 threads per core and a ratio of 2
    assert error(doc) == ("instancetype.spec.cpu.guest: 2 vCPUs provided by the instance type are not divisible by the number"
                          " of threads per core 2 and Spec.PreferSpreadSocketToCoreRatio or Spec.CPU.PreferSpreadOptions.Ratio of 2")


def test_overcommit_lowers_the_request_not_what_the_guest_gets():
    # apply/memory_test.go "should apply memory overcommit to VMI based on OvercommitPercent"
    vmi = parse_vmi(vm("o1.large"), objects=OBJECTS)
    assert vmi.domain.guest_memory == 8 << 30
    assert vmi.domain.resources.requests_memory == 4 << 30
    assert summary(domain_xml(vm("o1.large")))["memory"] == 8 << 30


def test_namespaced_instancetype_and_annotations():
    # annotations/annotations_test.go and preference/annotations: the VMI names what it was built from;
    # apply/annotations_test.go: the instance type's annotations are added, the preference's do not override.
    vmi = parse_vmi(vm({"name": "small", "kind": "virtualmachineinstancetype"}, {"name": "cores", "kind": "VirtualMachinePreference"}), objects=OBJECTS)
    assert vmi.annotations == {"kubevirt.io/instancetype-name": "small", "kubevirt.io/preference-name": "cores", "from": "instancetype"}
    cluster = parse_vmi(vm("u1.large", "fedora"), objects=OBJECTS)
    assert cluster.annotations == {"kubevirt.io/cluster-instancetype-name": "u1.large", "kubevirt.io/cluster-preference-name": "fedora"}


def test_conflicts_are_refused_with_kubevirts_message():
    # apply/cpu_test.go / memory_test.go "should return a conflict if ..."; conflict/conflicts.go wording.
    doc = vm("u1.large", domain={"cpu": {"sockets": 2, "cores": 1}, "resources": {"requests": {"memory": "1Gi", "cpu": "1"}},
                                 "memory": {"guest": "1Gi"}})
    assert error(doc) == ("spec.instancetype: VM field(s) spec.template.spec.domain.resources.requests.cpu,"
                          " spec.template.spec.domain.cpu.sockets, spec.template.spec.domain.cpu.cores,"
                          " spec.template.spec.domain.memory.guest conflicts with selected instance type")
    limits = vm("u1.large", domain={"resources": {"limits": {"memory": "1Gi"}}})
    assert error(limits) == ("spec.instancetype: VM field(s) spec.template.spec.domain.resources.limits.memory"
                             " conflicts with selected instance type")
    clash = vm({"name": "small", "kind": "VirtualMachineInstancetype"})
    clash["spec"]["template"]["metadata"] = {"annotations": {"from": "vm"}}
    assert error(clash) == "spec.instancetype: VM field(s) annotations.from conflicts with selected instance type"


def test_what_the_launcher_cannot_do_is_refused_naming_the_field():
    # cx1: NUMA passthrough is not implemented; m1: hugepages land in the template and are refused there.
    assert error(vm("cx1.large")) == "spec.instancetype: VirtualMachineClusterInstancetype cx1.large: spec.cpu.numa is not supported by the launcher"
    assert error(vm("m1.large")) == "spec.template.spec.domain.memory.hugepages: not supported by the launcher, and it changes what the guest sees; --ignore-unsupported runs without it"


def test_the_windows_11_preference_gives_a_persistent_tpm_efi_hyperv_and_the_clock():
    # pkg/instancetype/preference/apply: device.go (preferredTPM when the VM has none), features.go
    # (applyHyperVFeaturePreferences, field by field), clock.go (offset and timers whole), firmware.go
    # (preferredEfi, persistent and all); then the converter's compute/tpm.go, hypervisor_features.go, clock.go.
    doc = vm("u1.large", "windows.11", domain={"features": {"hyperv": {"vapic": {}}}})
    template = expand(doc, OBJECTS)["spec"]["template"]["spec"]["domain"]
    assert template["features"]["hyperv"] == {"vapic": {}, "relaxed": {}}
    assert template["firmware"]["bootloader"]["efi"] == {"persistent": True, "secureBoot": True}
    vmi = parse_vmi(doc, objects=OBJECTS)
    xml = domain_xml(doc)
    assert (xml.find("devices/tpm").get("model"), xml.find("devices/tpm/backend").get("persistent_state")) == ("tpm-crb", "yes")
    assert [e.tag for e in xml.find("features/hyperv")] == ["relaxed", "vapic"]
    assert xml.find("clock").attrib == {"offset": "utc", "adjustment": "reset"}
    assert xml.find("clock/timer").attrib == {"name": "hpet", "present": "no"}
    assert (xml.find("os/loader").get("secure"), xml.find("os/nvram").text) == ("yes", "/state/vm1_VARS.fd")
    assert vmi.domain.firmware.efi_persistent and vmi.domain.features.smm


def test_linux_preferences_give_the_guest_a_virtio_rng():
    # pkg/instancetype/preference/apply/device.go: preferredRng when the VMI has no rng of its own.
    template = expand(vm("u1.large", "fedora"), OBJECTS)["spec"]["template"]["spec"]
    assert template["domain"]["devices"]["rng"] == {}
    rng = domain_xml(vm("u1.large", "fedora")).find("devices/rng")
    assert (rng.get("model"), rng.find("backend").get("model"), rng.find("backend").text) == ("virtio-non-transitional", "random", "/dev/urandom")


def test_cx1_without_numa_is_dedicated_and_isolated():
    # apply/cpu_test.go "should apply in full with PreferSockets selected": the CPU flags and the
    # ioThreadsPolicy go to the template, and maxSockets too (apply/cpu.go): room for CPU hotplug,
    # rendered as converter/compute/cpu.go configureCPUTopology renders it.
    spec = copy.deepcopy(CORPUS[4])
    del spec["spec"]["cpu"]["numa"], spec["spec"]["memory"]["hugepages"]
    expanded = expand(vm("cx1.large"), Objects([spec]))
    domain = expanded["spec"]["template"]["spec"]["domain"]
    assert domain["cpu"] == {"dedicatedCpuPlacement": True, "isolateEmulatorThread": True, "sockets": 2, "cores": 1, "threads": 1,
                             "maxSockets": 2}
    assert (domain["memory"], domain["ioThreadsPolicy"]) == ({"guest": "4Gi"}, "auto")
    spec["spec"]["cpu"]["maxSockets"] = 4
    assert expand(vm("cx1.large"), Objects([spec]))["spec"]["template"]["spec"]["domain"]["cpu"]["maxSockets"] == 4
    vmi = parse_vmi(vm("cx1.large"), objects=Objects([spec]))
    pinned = Host(topology=(((0,), (1,), (2,)),), cpuset=(0, 1, 2))  # two vCPUs and the isolated emulator thread
    xml = ET.fromstring(render(vmi, {v.name: ResolvedDisk(f"/run/{v.name}.qcow2", "qcow2") for v in vmi.volumes}, pinned))
    assert [p.get("vcpu") for p in xml.iterfind("cputune/vcpupin")] == ["0", "1"]  # vcpu.go: the enabled ones only
    assert xml.find("vcpu").text == "4" and xml.find("cpu/topology").get("sockets") == "4"
    assert [v.get("enabled") for v in xml.iterfind("vcpus/vcpu")] == ["yes", "yes", "no", "no"]


def test_an_instance_types_supplemental_pool_is_judged_as_the_vmis():
    # apply/iothreads.go and iothreadpolicy.go copy both to the VMI, whose admission and converter judge them.
    spec = _size("io1.large", 2, "4Gi", ioThreadsPolicy="supplementalPool", ioThreads={"supplementalPoolThreadCount": 3})
    domain = expand(vm("io1.large"), Objects([spec]))["spec"]["template"]["spec"]["domain"]
    assert (domain["ioThreadsPolicy"], domain["ioThreads"]) == ("supplementalPool", {"supplementalPoolThreadCount": 3})
    assert error(vm("io1.large"), Objects([spec])).startswith("spec.template.spec.domain.ioThreadsPolicy: supplementalPool maps every virtio disk")


def test_missing_objects_use_the_api_servers_words():
    # controller/vm/controller.go checkResourcesExist: the NotFound of the lookup.
    assert error(vm("u9.huge")) == 'spec.instancetype: virtualmachineclusterinstancetypes.instancetype.kubevirt.io "u9.huge" not found'
    assert error(vm(None, {"name": "gone", "kind": "VirtualMachinePreference"})) == \
        'spec.preference: virtualmachinepreferences.instancetype.kubevirt.io "gone" not found'
    assert error(vm("u1.large"), None) == 'spec.instancetype: virtualmachineclusterinstancetypes.instancetype.kubevirt.io "u1.large" not found'
    # find/spec.go unexpectedKindFmt
    assert error(vm({"name": "x", "kind": "Flavor"})) == "spec.instancetype.kind: got unexpected kind in InstancetypeMatcher: Flavor"
    # webhooks/vm/mutator.go validateInstancetypeMatcher
    assert error(vm({"kind": "VirtualMachineInstancetype"})) == \
        "spec.instancetype: Either Name or InferFromVolume should be provided within the InstancetypeMatcher"


def test_old_api_versions_are_not_served():
    old = copy.deepcopy(CORPUS[1])
    old["apiVersion"] = "instancetype.kubevirt.io/v1alpha2"
    assert "no matches for kind \"VirtualMachineClusterInstancetype\" in version \"instancetype.kubevirt.io/v1alpha2\"" in \
        error(vm("u1.large"), Objects([old]))


# ---------------------------------------------------------------- preferences

def test_preference_fills_buses_cache_io_and_machine_but_never_overrides():
    # preference/apply/device_test.go "should apply to VMI", "Should apply when a VMI disk doesn't have a
    # DiskDevice target defined", "[test_id:CNV-9817] Should ignore preference when a VMI disk have a
    # DiskDevice defined", PreferredDiskDedicatedIoThread "should only apply to virtio disk devices";
    # machine_test.go.
    volumes = [{"name": n, "emptyDisk": {"capacity": "1Gi"}} for n in ("a", "b", "c", "d")]
    volumes.append({"name": "e", "emptyDisk": {"capacity": "1Gi"}})
    disks = [{"name": "a"}, {"name": "b", "disk": {"bus": "sata"}, "cache": "none"}, {"name": "c", "cdrom": {}},
             {"name": "e", "disk": {"bus": "virtio"}, "dedicatedIOThread": False}]
    doc = vm(None, {"name": "cores", "kind": "VirtualMachinePreference"}, disks=disks, volumes=volumes,
             domain={"resources": {"requests": {"memory": "1Gi"}}})
    vmi = parse_vmi(doc, objects=OBJECTS)
    got = {d.name: (d.device, d.bus, d.cache, d.io, d.dedicated_io_thread) for d in vmi.domain.devices.disks}
    assert got == {"a": ("disk", "virtio", "writethrough", "threads", True),
                   "b": ("disk", "sata", "none", "threads", False),
                   "c": ("cdrom", "scsi", None, None, False),
                   "d": ("disk", "virtio", "writethrough", "threads", True),  # the volume's implicit disk too
                   "e": ("disk", "virtio", "writethrough", "threads", False)}
    assert vmi.domain.machine_type == "pc-q35-rhel9.4.0"
    assert summary(domain_xml(vm(None, "fedora", domain={"resources": {"requests": {"memory": "2Gi"}}})))["buses"] == ["virtio"]


def test_preference_flags_land_in_the_template_as_kubevirt_sets_them():
    # preference/apply/device_test.go "should apply to VMI": unset booleans are filled, disableHotplug is
    # replaced (no pointer upstream), the block size goes to every disk target; interfaces are left
    # alone, as the launcher attaches no NIC (a default pod network stays KubeVirt's default).
    flags = {"apiVersion": V1B1, "kind": "VirtualMachineClusterPreference", "metadata": {"name": "flags"},
             "spec": {"devices": {"preferredAutoattachGraphicsDevice": False, "preferredAutoattachSerialConsole": True,
                                  "preferredUseVirtioTransitional": True, "preferredDisableHotplug": True,
                                  "preferredDiskBlockSize": {"matchVolume": {"enabled": True}},
                                  "preferredInterfaceModel": "virtio"}}}
    doc = vm(None, "flags", domain={"devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}],
                                                "autoattachSerialConsole": False, "disableHotplug": False,
                                                "interfaces": [{"name": "default", "masquerade": {}}]}})
    doc["spec"]["template"]["spec"]["networks"] = [{"name": "default", "pod": {}}]
    expanded = expand(doc, Objects([flags]))
    devices = expanded["spec"]["template"]["spec"]["domain"]["devices"]
    assert {k: v for k, v in devices.items() if k not in ("disks", "interfaces")} == {
        "autoattachSerialConsole": False, "disableHotplug": True, "autoattachGraphicsDevice": False, "useVirtioTransitional": True}
    assert devices["disks"] == [{"name": "root", "disk": {"bus": "virtio"}, "blockSize": {"matchVolume": {"enabled": True}}}]
    assert devices["interfaces"] == [{"name": "default", "masquerade": {}}]
    assert "preference" not in expanded["spec"]  # consumed: the VMI names it in an annotation
    assert "preference" in doc["spec"] and "annotations" not in doc["spec"]["template"].get("metadata", {})  # the input is untouched


def test_preferred_storage_class_fills_datavolume_templates():
    # webhooks/vm/mutator.go mutateDataVolumeTemplates: only where the template names no class.
    pref = {"apiVersion": V1B1, "kind": "VirtualMachineClusterPreference", "metadata": {"name": "fast"},
            "spec": {"volumes": {"preferredStorageClassName": "fast-ssd"}}}
    dvt = [{"metadata": {"name": name}, "spec": {"source": {"blank": {}}, "storage": {
        "resources": {"requests": {"storage": "1Gi"}}, **({"storageClassName": "slow"} if name == "keep" else {})}}}
        for name in ("fill", "keep")]
    volumes = [{"name": n, "dataVolume": {"name": n}} for n in ("fill", "keep")]
    doc = vm("u1.large", "fast", volumes=volumes, dataVolumeTemplates=dvt)
    vmi = parse_vmi(doc, objects=Objects(CORPUS + [pref]))
    assert {dv.name: dv.storage_class for dv in vmi.data_volume_templates} == {"fill": "fast-ssd", "keep": "slow"}


def test_preferred_efi_with_secure_boot_and_smm():
    # preference/apply/firmware_test.go "should apply PreferredEfi"; features_test.go preferredSmm
    vmi = parse_vmi(vm("u1.large", "fedora"), objects=OBJECTS)
    assert (vmi.domain.firmware.bootloader, vmi.domain.firmware.secure_boot, vmi.domain.features.smm) == ("efi", True, True)
    # "should not apply PreferredEfi when VM already using BIOS - bug #12985"
    bios = parse_vmi(vm("u1.large", "fedora", domain={"firmware": {"bootloader": {"bios": {}}}}), objects=OBJECTS)
    assert bios.domain.firmware.bootloader == "bios"
    # The preferred EFI is taken whole: secure boot off stays off (KubeVirt's own EFI default is on).
    insecure = {"apiVersion": V1B1, "kind": "VirtualMachineClusterPreference", "metadata": {"name": "efi"},
                "spec": {"firmware": {"preferredEfi": {"secureBoot": False}}}}
    efi = parse_vmi(vm("u1.large", "efi"), objects=Objects(CORPUS + [insecure]))
    assert (efi.domain.firmware.bootloader, efi.domain.firmware.secure_boot) == ("efi", False)


@pytest.mark.parametrize("instancetype,preference,domain,message", [
    # requirements/cpu_test.go "should be rejected ... by an instance type for vCPUs"
    ("u1.medium", "windows-reqs", None, ("spec.instancetype: failure checking preference requirements: insufficient CPU resources"
                                        " of 1 vCPU provided by instance type, preference requires 2 vCPU")),
    # requirements/memory_test.go "by an instance type for Memory"
    ("u1.large", "fedora-reqs-16", None, ("spec.instancetype: failure checking preference requirements: insufficient Memory"
                                         " resources of 8Gi provided by instance type, preference requires 16Gi")),
    # requirements/cpu_test.go "by a VM for vCPUs using PreferCores"
    (None, "windows-reqs", {"cpu": {"cores": 1}, "resources": {"requests": {"memory": "4Gi"}}},
     ("spec.template.spec.domain.cpu.cores: failure checking preference requirements: insufficient CPU resources of 1 vCPU"
     " provided by VirtualMachine, preference requires 2 vCPU provided as cores")),
    # defaults.SetDefaultGuestCPUTopology leaves a partial topology alone: unset cores count as 0.
    (None, "windows-reqs", {"cpu": {"sockets": 2}, "resources": {"requests": {"memory": "4Gi"}}},
     ("spec.template.spec.domain.cpu.cores: failure checking preference requirements: insufficient CPU resources of 0 vCPU"
     " provided by VirtualMachine, preference requires 2 vCPU provided as cores")),
    # ... and with none set, the CPU limit (before the request) rounded up becomes the sockets (requirements/cpu_test.go
    # "by a VM for vCPUs using PreferSockets (default)").
    (None, "three-cpus", {"resources": {"requests": {"memory": "1Gi", "cpu": "1"}, "limits": {"cpu": "1500m"}}},
     ("spec.template.spec.domain.cpu.sockets: failure checking preference requirements: insufficient CPU resources of 2 vCPU"
     " provided by VirtualMachine, preference requires 3 vCPU provided as sockets")),
    # requirements/memory_test.go "by a VM for Memory"
    (None, "fedora-reqs-16", {"resources": {"requests": {"memory": "1536Mi"}}},
     ("spec.template.spec.domain.memory: failure checking preference requirements: insufficient Memory resources of 1536Mi"
     " provided by VirtualMachine, preference requires 16Gi")),
])
def test_requirements_use_kubevirts_messages(instancetype, preference, domain, message):
    reqs = [{"apiVersion": V1B1, "kind": "VirtualMachineClusterPreference", "metadata": {"name": "windows-reqs"},
             "spec": {"cpu": {"preferredCPUTopology": "cores"}, "requirements": {"cpu": {"guest": 2}, "memory": {"guest": "4Gi"}}}},
            {"apiVersion": V1B1, "kind": "VirtualMachineClusterPreference", "metadata": {"name": "fedora-reqs-16"},
             "spec": {"requirements": {"memory": {"guest": "16Gi"}}}},
            {"apiVersion": V1B1, "kind": "VirtualMachineClusterPreference", "metadata": {"name": "three-cpus"},
             "spec": {"requirements": {"cpu": {"guest": 3}}}}]
    assert error(vm(instancetype, preference, domain=domain), Objects(CORPUS + reqs)) == message


def test_requirements_met_pass():
    # requirements/cpu_test.go / memory_test.go "should pass when sufficient resources are provided"
    assert parse_vmi(vm("u1.large", "fedora"), objects=OBJECTS).domain.vcpus == 2


def test_quantities_print_as_kubernetes_prints_them():
    assert [quantity_text(v, True) for v in (2 << 30, 1536 << 20, 0, 1000)] == ["2Gi", "1536Mi", "0", "1000"]
    assert quantity_text(2 * 10**9, False) == "2G"


# ---------------------------------------------------------------- inference

def _labelled(kind: str, name: str, labels: dict, **extra) -> dict:
    return {"apiVersion": "v1", "kind": kind, "metadata": {"name": name, "namespace": "ns", "labels": labels}, **extra}


LABELS = {"instancetype.kubevirt.io/default-instancetype": "u1.large",
          "instancetype.kubevirt.io/default-preference": "fedora"}


def test_infer_from_a_pvc_and_a_datavolume():
    # infer/handler_test.go "should infer defaults from VolumeSource and PersistentVolumeClaim",
    # "should infer defaults from DataVolume with labels", "should infer defaults from DataVolumeTemplate"
    # (DataVolumeSourcePVC).
    objects = Objects(CORPUS + [_labelled("PersistentVolumeClaim", "fedora-pvc", LABELS),
                                _labelled("DataVolume", "fedora-dv", LABELS)])
    infer = {"inferFromVolume": "root"}
    for volume in ({"persistentVolumeClaim": {"claimName": "fedora-pvc"}}, {"dataVolume": {"name": "fedora-dv"}}):
        doc = vm(infer, infer, volumes=[{"name": "root", **volume}])
        assert parse_vmi(doc, objects=objects).annotations == {"kubevirt.io/cluster-instancetype-name": "u1.large",
                                                       "kubevirt.io/cluster-preference-name": "fedora"}
    templated = vm(infer, None, volumes=[{"name": "root", "dataVolume": {"name": "fresh"}}],
                   dataVolumeTemplates=[{"metadata": {"name": "fresh"},
                                         "spec": {"source": {"pvc": {"name": "fedora-pvc", "namespace": "ns"}},
                                                  "storage": {"resources": {"requests": {"storage": "1Gi"}}}}}])
    assert parse_vmi(templated, objects=objects).domain.vcpus == 2
    # handler_test.go "should infer defaults from DataVolume, DataVolumeSourceRef" ",DataSource and
    # PersistentVolumeClaim": an unlabelled DataVolume cloning from a DataSource (in the VM's namespace)
    # whose PVC carries the labels.
    sourced = Objects(CORPUS + [
        _labelled("DataVolume", "cloned", {}, spec={"sourceRef": {"kind": "DataSource", "name": "fedora"}}),
        _labelled("DataSource", "fedora", {}, spec={"source": {"pvc": {"name": "fedora-pvc", "namespace": "ns"}}}),
        _labelled("PersistentVolumeClaim", "fedora-pvc", LABELS)])
    from_source = vm(infer, infer, volumes=[{"name": "root", "dataVolume": {"name": "cloned"}}])
    assert parse_vmi(from_source, objects=sourced).annotations["kubevirt.io/cluster-preference-name"] == "fedora"


def test_infer_failures_and_the_ignore_policy():
    # infer/volume.go: a containerDisk cannot be inferred from; a missing label either. Under
    # inferFromVolumeFailurePolicy: Ignore the matcher goes (handler_test.go "should ignore failure ...").
    objects = Objects(CORPUS + [_labelled("PersistentVolumeClaim", "bare", {})])
    assert error(vm({"inferFromVolume": "root"}), objects) == \
        "spec.instancetype.inferFromVolume: unable to infer defaults from volume root as type is not supported"
    bare = [{"name": "root", "persistentVolumeClaim": {"claimName": "bare"}}]
    assert error(vm({"inferFromVolume": "root"}, volumes=bare), objects) == \
        "spec.instancetype.inferFromVolume: unable to find required instancetype.kubevirt.io/default-instancetype label on the volume"
    assert error(vm({"inferFromVolume": "nope"}), objects) == "spec.instancetype.inferFromVolume: unable to find volume nope to infer defaults"
    ignored = vm({"inferFromVolume": "root", "inferFromVolumeFailurePolicy": "Ignore"}, volumes=bare,
                 domain={"resources": {"requests": {"memory": "128Mi"}}})
    vmi = parse_vmi(ignored, objects=objects)
    assert (vmi.domain.vcpus, vmi.domain.guest_memory, vmi.annotations) == (1, 128 << 20, {})
    # Under Ignore a successful inference drops the template's memory, so it cannot conflict
    # (infer/handler.go Instancetype).
    labelled = [{"name": "root", "persistentVolumeClaim": {"claimName": "fedora-pvc"}}]
    with_memory = vm({"inferFromVolume": "root", "inferFromVolumeFailurePolicy": "Ignore"}, volumes=labelled,
                     domain={"memory": {"guest": "128Mi"}})
    inferred = parse_vmi(with_memory, objects=Objects(CORPUS + [_labelled("PersistentVolumeClaim", "fedora-pvc", LABELS)]))
    assert (inferred.domain.vcpus, inferred.domain.guest_memory) == (2, 8 << 30)
    # A claim that does not exist is no inference failure: it is refused under either policy.
    missing = vm({"inferFromVolume": "root", "inferFromVolumeFailurePolicy": "Ignore"},
                 volumes=[{"name": "root", "persistentVolumeClaim": {"claimName": "gone"}}])
    assert error(missing, objects) == 'spec.instancetype.inferFromVolume: persistentvolumeclaims "gone" not found'
    assert error(vm({"inferFromVolume": "root", "name": "u1.large"})) == \
        "spec.instancetype.name: Name already set, should be cleared before setting inferFromVolume"


# ---------------------------------------------------------------- end to end

def test_vm_boots_with_the_instancetypes_cpus_memory_and_rng(qemu_user, guest_image):
    manifests = qemu_user.root / "itype-manifests"
    manifests.mkdir()
    objects = [
        {"apiVersion": V1B1, "kind": "VirtualMachineClusterInstancetype", "metadata": {"name": "tiny.2c"},
         "spec": {"cpu": {"guest": 2, "maxSockets": 2}, "memory": {"guest": "320Mi"}}},
        {"apiVersion": V1B1, "kind": "VirtualMachinePreference", "metadata": {"name": "virtio-cores"},
         "spec": {"cpu": {"preferredCPUTopology": "cores"}, "devices": {"preferredDiskBus": "virtio", "preferredRng": {}}}},
    ]
    (manifests / "types.yaml").write_text(yaml.safe_dump_all(objects))
    manifests.chmod(0o755)
    doc = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "sized"},
           "spec": {"instancetype": {"name": "tiny.2c"}, "preference": {"kind": "VirtualMachinePreference", "name": "virtio-cores"},
                    "template": {"spec": {"domain": {"devices": {"disks": [{"name": "root"}]}},
                                          "volumes": [{"name": "root", "containerDisk": {"image": guest_image}},
                                                      {"name": "ci", "cloudInitNoCloud": {"userData": "#cloud-config\n"}}]}}}}
    path = qemu_user.root / "sized.yaml"
    path.write_text(json.dumps(doc))

    domain = qemu_user.launcher("domain", NOREG, "--manifests", manifests, path)
    assert domain.code == 0, domain.err
    xml = ET.fromstring(domain.out)
    topology = xml.find("cpu/topology")
    # room for a second socket of two cores (maxSockets; converter/compute/cpu.go), the first one enabled
    assert (xml.findtext("vcpu"), topology.get("sockets"), topology.get("cores"), topology.get("threads")) == ("4", "2", "2", "1")
    assert [v.get("enabled") for v in xml.iterfind("vcpus/vcpu")] == ["yes", "yes", "no", "no"]

    result = qemu_user.launcher("run", NOREG, "--console", "--timeout", "240", "--manifests", manifests, path)
    assert result.code == 0, result.err
    console = parse_console(result.out)
    assert console["ready"] and console["done"], result.out
    assert console["cpus"] == 2  # the requested ones online; the hotplug socket's wait unplugged
    assert console["rng"] == "virtio_rng.0"  # the preference's virtio RNG
    # MemTotal is what the kernel has left of the 320 MiB it was given.
    assert 256 * 1024 < console["mem_kib"] <= 320 * 1024, console["mem_kib"]
    # Both disks reached the guest on virtio (the template names no bus; SATA would be invisible here).
    assert {"vda", "vdb"} <= set(console["disks"]), console["disks"]
    meta = json.loads(console["isos"]["vdb"]["files"]["/meta-data"])
    assert meta["instance-type"] == "tiny.2c"

    # Without the manifests the instance type cannot be found: refused before anything starts.
    refused = qemu_user.launcher("run", NOREG, path)
    assert refused.code != 0
    assert 'spec.instancetype: virtualmachineclusterinstancetypes.instancetype.kubevirt.io "tiny.2c" not found' in refused.err


def test_the_example_parses():
    examples = Path(__file__).resolve().parent.parent / "examples" / "instancetypes"
    vmi = load_vmi(examples / "vm.yaml", objects=Objects.load(examples))
    assert (vmi.domain.topology, vmi.domain.guest_memory) == ((1, 2, 1), 4 << 30)
    assert [d.bus for d in vmi.domain.devices.disks] == ["virtio", "virtio"]

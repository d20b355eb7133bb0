"""Instance types and preferences (instancetype.kubevirt.io/v1beta1) applied to a VirtualMachine (pure).

`expand` does to a VirtualMachine document what KubeVirt does before its VMI is defaulted and
validated: infer the matchers from a volume (pkg/instancetype/infer), find the objects
(pkg/instancetype/find, preference/find), refuse conflicts (pkg/instancetype/apply,
pkg/instancetype/conflict), apply the instance type and then the preference
(pkg/instancetype/preference/apply) to spec.template, annotate the template as the VM controller
annotates the VMI (pkg/instancetype/annotations, preference/annotations), and check the preference's
requirements as the VM admitter does (pkg/instancetype/preference/requirements). The input device the
VM controller adds for autoattachInputDevice (AutoAttachInputDevice) is added here too, with or
without a preference: it comes between the preference's autoattach flags and its input bus and type.

Objects come from whatever `get(kind, namespace, name)` the caller holds (manifests or the API); no
I/O here. What an instance type or preference would put in the VMI and the launcher cannot do is
refused, naming the field, rather than dropped.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Protocol

from launcher.spec.fields import SpecError, as_list, as_map, dig, parse_quantity

GROUP = "instancetype.kubevirt.io"
API_VERSION = f"{GROUP}/v1beta1"  # staging/src/kubevirt.io/api/instancetype: the only version served

INSTANCETYPE = "VirtualMachineInstancetype"
CLUSTER_INSTANCETYPE = "VirtualMachineClusterInstancetype"
PREFERENCE = "VirtualMachinePreference"
CLUSTER_PREFERENCE = "VirtualMachineClusterPreference"
CLUSTER_KINDS = frozenset({CLUSTER_INSTANCETYPE, CLUSTER_PREFERENCE})
# The matcher's kind, lower-cased, singular or plural (find/spec.go); empty means the cluster kind.
_MATCHER_KINDS = {
    "instancetype": {"virtualmachineinstancetype": INSTANCETYPE, "virtualmachineinstancetypes": INSTANCETYPE,
                     "virtualmachineclusterinstancetype": CLUSTER_INSTANCETYPE,
                     "virtualmachineclusterinstancetypes": CLUSTER_INSTANCETYPE, "": CLUSTER_INSTANCETYPE},
    "preference": {"virtualmachinepreference": PREFERENCE, "virtualmachinepreferences": PREFERENCE,
                   "virtualmachineclusterpreference": CLUSTER_PREFERENCE,
                   "virtualmachineclusterpreferences": CLUSTER_PREFERENCE, "": CLUSTER_PREFERENCE},
}
_MATCHER_NAMES = {"instancetype": "InstancetypeMatcher", "preference": "PreferenceMatcher"}

# api/core/v1 types.go: what the VM controller puts on the VMI.
ANNOTATIONS = {INSTANCETYPE: "kubevirt.io/instancetype-name", CLUSTER_INSTANCETYPE: "kubevirt.io/cluster-instancetype-name",
               PREFERENCE: "kubevirt.io/preference-name", CLUSTER_PREFERENCE: "kubevirt.io/cluster-preference-name"}
# api/instancetype/register.go: the labels inference reads.
DEFAULT_LABELS = {"instancetype": ("instancetype.kubevirt.io/default-instancetype", "instancetype.kubevirt.io/default-instancetype-kind"),
                  "preference": ("instancetype.kubevirt.io/default-preference", "instancetype.kubevirt.io/default-preference-kind")}

# api/instancetype/v1beta1 PreferredCPUTopology, the deprecated spellings first.
_TOPOLOGIES = {"preferSockets": "sockets", "preferCores": "cores", "preferThreads": "threads", "preferSpread": "spread",
               "preferAny": "any", "sockets": "sockets", "cores": "cores", "threads": "threads", "spread": "spread", "any": "any"}
_SPREAD_ACROSS = ("SocketsCoresThreads", "SocketsCores", "CoresThreads")
_CONFLICT = "VM field(s) {} conflicts with selected instance type"
_BASE = "spec.template.spec"


class ObjectSource(Protocol):
    def get(self, kind: str, namespace: str | None, name: str) -> dict | None: ...

    # Optional: the hint labels of a containerDisk's image (diskkit.oci.hints.from_config of its
    # config), for inference from a containerDisk volume; a source without it infers as KubeVirt does.
    # def image_labels(self, image: str) -> dict[str, str]: ...


@dataclass(frozen=True)
class Selected:
    kind: str
    name: str
    spec: dict

    @property
    def label(self) -> str:
        return f"{self.kind} {self.name}"



# ---------------------------------------------------------------- matchers and inference

def _check_matcher(matcher: dict, what: str) -> None:
    """webhooks/vm/mutator.go validateInstancetypeMatcher / validatePreferenceMatcher."""
    if not matcher.get("name") and not matcher.get("inferFromVolume"):
        raise SpecError(f"spec.{what}", f"Either Name or InferFromVolume should be provided within the {_MATCHER_NAMES[what]}")
    if matcher.get("inferFromVolume"):
        for key in ("name", "kind"):
            if matcher.get(key):
                raise SpecError(f"spec.{what}.{key}", f"{key.capitalize()} already set, should be cleared before setting inferFromVolume")
    policy = matcher.get("inferFromVolumeFailurePolicy")
    if policy is not None and policy not in ("Ignore", "Reject"):
        raise SpecError(f"spec.{what}.inferFromVolumeFailurePolicy", f"Invalid value '{policy}' for InferFromVolumeFailurePolicy")


class _Ignorable(Exception):
    """infer/errors.go IgnoreableInferenceError: cleared by inferFromVolumeFailurePolicy: Ignore."""


class _Failed(Exception):
    """Any other inference error (an object the labels should come from is missing): refused under both policies."""


def _not_found(resource: str, name: str) -> _Failed:
    return _Failed(f'{resource} "{name}" not found')


def _from_labels(labels: Any, what: str) -> tuple[str, str]:
    name_label, kind_label = DEFAULT_LABELS[what]
    labels = labels if isinstance(labels, dict) else {}
    if name_label not in labels:
        raise _Ignorable(f"unable to find required {name_label} label on the volume")
    return str(labels[name_label]), str(labels.get(kind_label) or "")


def _from_pvc(objects: ObjectSource | None, name: str, namespace: str, what: str) -> tuple[str, str]:
    pvc = objects.get("PersistentVolumeClaim", namespace, name) if objects is not None else None
    if pvc is None:
        raise _not_found("persistentvolumeclaims", name)
    return _from_labels(dig(pvc, "metadata", "labels"), what)


def _from_snapshot(objects: ObjectSource | None, name: str, namespace: str, what: str) -> tuple[str, str]:
    snapshot = objects.get("VolumeSnapshot", namespace, name) if objects is not None else None
    if snapshot is None:
        raise _not_found("volumesnapshots.snapshot.storage.k8s.io", name)
    return _from_labels(dig(snapshot, "metadata", "labels"), what)


def _from_data_source(objects: ObjectSource | None, name: str, namespace: str, what: str) -> tuple[str, str]:
    source = objects.get("DataSource", namespace, name) if objects is not None else None
    if source is None:
        raise _not_found("datasources.cdi.kubevirt.io", name)
    try:
        return _from_labels(dig(source, "metadata", "labels"), what)
    except _Ignorable:
        pass
    pvc, snapshot = dig(source, "spec", "source", "pvc"), dig(source, "spec", "source", "snapshot")
    if isinstance(pvc, dict):
        return _from_pvc(objects, str(pvc.get("name")), pvc.get("namespace") or namespace, what)
    if isinstance(snapshot, dict):
        return _from_snapshot(objects, str(snapshot.get("name")), snapshot.get("namespace") or namespace, what)
    raise _Ignorable("unable to infer defaults from DataSource that doesn't provide DataVolumeSourcePVC or DataVolumeSourceSnapshot")


def _from_dv_spec(objects: ObjectSource | None, spec: Any, namespace: str, what: str) -> tuple[str, str]:
    pvc, snapshot = dig(spec, "source", "pvc"), dig(spec, "source", "snapshot")
    # CDI's own namespace default for a clone source is the DataVolume's; KubeVirt passes the field as is.
    if isinstance(pvc, dict):
        return _from_pvc(objects, str(pvc.get("name")), pvc.get("namespace") or namespace, what)
    if isinstance(snapshot, dict):
        return _from_snapshot(objects, str(snapshot.get("name")), snapshot.get("namespace") or namespace, what)
    ref = dig(spec, "sourceRef")
    if isinstance(ref, dict):
        if ref.get("kind") == "DataSource":
            return _from_data_source(objects, str(ref.get("name")), ref.get("namespace") or namespace, what)
        raise _Ignorable(f"unable to infer defaults from DataVolumeSourceRef as Kind {ref.get('kind')} is not supported")
    raise _Ignorable("unable to infer defaults from DataVolumeSpec as DataVolumeSource is not supported")


def _from_volume(vm: dict, objects: ObjectSource | None, volume_name: str, namespace: str, what: str) -> tuple[str, str]:
    """infer/volume.go fromVolumes: PVCs and DataVolumes (template first, then the object); any other
    volume type, containerDisk included, is 'not supported' there.

    A difference from KubeVirt: a containerDisk is read from too when the caller can read images
    (`image_labels`): its config's labels, or its ENV as CDI reads it (diskkit.oci.hints), which is what
    a DataVolume imported from the same image would carry on its claim."""
    for volume in as_list(dig(vm, "spec", "template", "spec", "volumes"), f"{_BASE}.volumes"):
        if not isinstance(volume, dict) or volume.get("name") != volume_name:
            continue
        image = dig(volume, "containerDisk", "image")
        read = getattr(objects, "image_labels", None)
        if isinstance(image, str) and image and read is not None:
            try:
                return _from_labels(read(image), what)
            except _Ignorable as err:
                raise _Ignorable(f"{err} (containerDisk image {image})") from None
        if isinstance(volume.get("persistentVolumeClaim"), dict):
            return _from_pvc(objects, str(volume["persistentVolumeClaim"].get("claimName")), namespace, what)
        if isinstance(volume.get("dataVolume"), dict):
            dv_name = str(volume["dataVolume"].get("name"))
            for template in as_list(dig(vm, "spec", "dataVolumeTemplates"), "spec.dataVolumeTemplates"):
                if dig(template, "metadata", "name") == dv_name:
                    return _from_dv_spec(objects, dig(template, "spec"), namespace, what)
            dv = objects.get("DataVolume", namespace, dv_name) if objects is not None else None
            if dv is None:
                # A garbage-collected DataVolume leaves its claim of the same name.
                return _from_pvc(objects, dv_name, namespace, what)
            try:
                return _from_labels(dig(dv, "metadata", "labels"), what)
            except _Ignorable:
                return _from_dv_spec(objects, dig(dv, "spec"), namespace, what)
        raise _Ignorable(f"unable to infer defaults from volume {volume_name} as type is not supported")
    raise _Failed(f"unable to find volume {volume_name} to infer defaults")


def _infer(vm: dict, objects: ObjectSource | None, namespace: str, what: str) -> None:
    """infer/handler.go: replace the matcher by the volume's default, or drop it under policy Ignore."""
    matcher = vm["spec"][what]
    volume = matcher.get("inferFromVolume")
    if not volume:
        return
    ignore = matcher.get("inferFromVolumeFailurePolicy") == "Ignore"
    try:
        name, kind = _from_volume(vm, objects, volume, namespace, what)
    except _Ignorable as err:
        if ignore:
            del vm["spec"][what]
            return
        raise SpecError(f"spec.{what}.inferFromVolume", str(err)) from None
    except _Failed as err:
        raise SpecError(f"spec.{what}.inferFromVolume", str(err)) from None
    domain = dig(vm, "spec", "template", "spec", "domain")
    if ignore and what == "instancetype" and isinstance(domain, dict):
        # The handler clears the template's memory so an inferred instance type cannot conflict with it.
        domain.pop("memory", None)
    vm["spec"][what] = {"name": name, "kind": kind}


# ---------------------------------------------------------------- finding

def _find(vm: dict, objects: ObjectSource | None, namespace: str, what: str) -> Selected | None:
    matcher = vm["spec"].get(what)
    if matcher is None:
        return None
    raw_kind = str(matcher.get("kind") or "")
    kind = _MATCHER_KINDS[what].get(raw_kind.lower())
    if kind is None:
        raise SpecError(f"spec.{what}.kind", f"got unexpected kind in {_MATCHER_NAMES[what]}: {raw_kind}")
    name = str(matcher["name"])
    doc = objects.get(kind, None if kind in CLUSTER_KINDS else namespace, name) if objects is not None else None
    if doc is None:
        # The VM controller's checkResourcesExist (FailedFindInstancetype / FailedFindPreference):
        # the API server's NotFound.
        raise SpecError(f"spec.{what}", f'{kind.lower()}s.{GROUP} "{name}" not found')
    version = doc.get("apiVersion")
    if version != API_VERSION:
        raise SpecError(f"spec.{what}", f"{kind} {name}: no matches for kind \"{kind}\" in version \"{version}\" (KubeVirt serves {API_VERSION})")
    return Selected(kind, name, as_map(doc.get("spec"), f"{kind} {name} spec"))


# ---------------------------------------------------------------- validation of the objects

def _uint(value: Any, at: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecError(at, "must be a non-negative integer")
    return value


def _check_instancetype(it: Selected) -> None:
    """The CRD schema's required fields and webhooks/admitter.go ValidateInstanceTypeSpec."""
    at = f"{it.label} spec"
    cpu, memory = as_map(it.spec.get("cpu"), f"{at}.cpu"), as_map(it.spec.get("memory"), f"{at}.memory")
    if "guest" not in cpu:
        raise SpecError(f"{at}.cpu.guest", "Required value")
    if _uint(cpu["guest"], f"{at}.cpu.guest") == 0:
        raise SpecError(f"{at}.cpu.guest", "Invalid value: 0: spec.cpu.guest in body should be greater than or equal to 1")
    if "guest" not in memory:
        raise SpecError(f"{at}.memory.guest", "Required value")
    parse_quantity(memory["guest"], f"{at}.memory.guest")
    percent = memory.get("overcommitPercent", 0)
    if isinstance(percent, bool) or not isinstance(percent, int) or not 0 <= percent <= 100:
        raise SpecError(f"{at}.memory.overcommitPercent", f"spec.memory.overcommitPercent '{percent}': must be in range between 0 and 100.")
    if percent and memory.get("hugepages") is not None:
        raise SpecError(f"{at}.memory.overcommitPercent", "spec.memory.overcommitPercent and spec.memory.hugepages should not be requested together.")


def _topology(pref: Selected | None) -> str:
    """preference/apply/cpu.go GetPreferredTopology: sockets unless the preference says otherwise."""
    value = dig(pref.spec, "cpu", "preferredCPUTopology") if pref else None
    return _TOPOLOGIES[value] if value else "sockets"


def _spread_options(pref: Selected) -> tuple[int, str]:
    """preference/apply/cpu.go GetSpreadOptions: ratio 2 across SocketsCores by default."""
    ratio = pref.spec.get("preferSpreadSocketToCoreRatio") or 2
    options = as_map(dig(pref.spec, "cpu", "spreadOptions"), f"{pref.label} spec.cpu.spreadOptions")
    if options.get("ratio") is not None:
        ratio = _uint(options["ratio"], f"{pref.label} spec.cpu.spreadOptions.ratio")
    return ratio, options.get("across") or "SocketsCores"


def _check_preference(pref: Selected) -> None:
    """preference/webhooks/admitter.go ValidatePreferenceSpec."""
    value = dig(pref.spec, "cpu", "preferredCPUTopology")
    if value is not None and value not in _TOPOLOGIES:
        raise SpecError(f"{pref.label} spec.cpu.preferredCPUTopology", f"unknown preferredCPUTopology {value}")
    if _topology(pref) == "spread":
        ratio, across = _spread_options(pref)
        if across not in _SPREAD_ACROSS:
            raise SpecError(f"{pref.label} spec.cpu.spreadOptions.across", f"across {across} is not supported")
        if across == "CoresThreads" and ratio != 2:
            raise SpecError(f"{pref.label} spec.cpu.spreadOptions.ratio",
                            "only a ratio of 2 (1 core 2 threads) is allowed when spreading vCPUs over cores and threads")
        if ratio == 0:
            raise SpecError(f"{pref.label} spec.cpu.spreadOptions.ratio", "must be at least 1")


def _check_spread(it: Selected | None, pref: Selected | None) -> None:
    """preference/validation/cpu.go CheckSpreadCPUTopology."""
    if it is None or pref is None or _topology(pref) != "spread":
        return
    guest = it.spec["cpu"]["guest"]
    ratio, across = _spread_options(pref)
    at = "instancetype.spec.cpu.guest"
    ratio_name = "Spec.PreferSpreadSocketToCoreRatio or Spec.CPU.PreferSpreadOptions.Ratio"
    if across == "SocketsCores" and guest % ratio:
        raise SpecError(at, f"{guest} vCPUs provided by the instance type are not divisible by the {ratio_name} of {ratio} provided by the preference")
    if across == "CoresThreads" and guest % ratio:
        raise SpecError(at, f"{guest} vCPUs provided by the instance type are not divisible by the number of threads per core {ratio}")
    if across == "SocketsCoresThreads" and (guest % 2 or (guest // 2) % ratio):
        raise SpecError(at, f"{guest} vCPUs provided by the instance type are not divisible by the number of threads per core 2 and {ratio_name} of {ratio}")


# ---------------------------------------------------------------- the instance type

def _unsupported(owner: Selected, path: str) -> SpecError:
    what = "instancetype" if owner.kind in (INSTANCETYPE, CLUSTER_INSTANCETYPE) else "preference"
    return SpecError(f"spec.{what}", f"{owner.label}: spec.{path} is not supported by the launcher")


def _conflicts(it: Selected, tspec: dict, meta: dict) -> list[str]:
    """apply/vmi.go ApplyToVMI's checks, in its order: every CPU conflict, the first memory one, then
    the single-field ones (apply/cpu.go, memory.go, iothreads.go, ...)."""
    spec, dom = it.spec, as_map(tspec.get("domain"), f"{_BASE}.domain")
    cpu, vcpu = as_map(spec.get("cpu"), "cpu"), as_map(dom.get("cpu"), f"{_BASE}.domain.cpu")
    requests = as_map(dig(dom, "resources", "requests"), f"{_BASE}.domain.resources.requests")
    limits = as_map(dig(dom, "resources", "limits"), f"{_BASE}.domain.resources.limits")
    memory, vmem = as_map(spec.get("memory"), "memory"), as_map(dom.get("memory"), f"{_BASE}.domain.memory")
    found: list[str] = []
    d = f"{_BASE}.domain"
    if spec.get("nodeSelector") is not None and tspec.get("nodeSelector") is not None:
        found.append(f"{_BASE}.nodeSelector")
    if spec.get("schedulerName") and tspec.get("schedulerName"):
        found.append(f"{_BASE}.schedulerName")
    cpu_checks = [("cpu" in requests, "resources.requests.cpu"), ("cpu" in limits, "resources.limits.cpu"),
                  (bool(vcpu.get("sockets")), "cpu.sockets"), (bool(vcpu.get("cores")), "cpu.cores"),
                  (bool(vcpu.get("threads")), "cpu.threads"),
                  (bool(vcpu.get("model")) and cpu.get("model") is not None, "cpu.model"),
                  (bool(vcpu.get("dedicatedCpuPlacement")) and cpu.get("dedicatedCPUPlacement") is not None, "cpu.dedicatedCPUPlacement"),
                  (bool(vcpu.get("isolateEmulatorThread")) and cpu.get("isolateEmulatorThread") is not None, "cpu.isolateEmulatorThread"),
                  (vcpu.get("numa") is not None and cpu.get("numa") is not None, "cpu.numa"),
                  (vcpu.get("realtime") is not None and cpu.get("realtime") is not None, "cpu.realtime")]
    found += [f"{d}.{path}" for hit, path in cpu_checks if hit]
    memory_checks = [(vmem.get("guest") is not None, "memory.guest"),
                     (vmem.get("hugepages") is not None and memory.get("hugepages") is not None, "memory.hugepages"),
                     (vmem.get("maxGuest") is not None and memory.get("maxGuest") is not None, "memory.maxGuest"),
                     ("memory" in requests, "resources.requests.memory"), ("memory" in limits, "resources.limits.memory")]
    found += [f"{d}.{path}" for hit, path in memory_checks if hit][:1]
    if dig(spec, "ioThreads", "supplementalPoolThreadCount") is not None and dig(dom, "ioThreads", "supplementalPoolThreadCount") is not None:
        found.append(f"{d}.ioThreads.supplementalPoolThreadCount")
    if spec.get("ioThreadsPolicy") is not None and dom.get("ioThreadsPolicy") is not None:
        found.append(f"{d}.ioThreadsPolicy")
    if spec.get("launchSecurity") is not None and dom.get("launchSecurity") is not None:
        found.append(f"{d}.launchSecurity")
    if spec.get("gpus") and dig(dom, "devices", "gpus"):
        found.append(f"{d}.devices.gpus")
    if spec.get("hostDevices") and dig(dom, "devices", "hostDevices"):
        found.append(f"{d}.devices.hostDevices")
    annotations = as_map(meta.get("annotations"), "spec.template.metadata.annotations")
    for key, value in as_map(spec.get("annotations"), "annotations").items():
        if key in annotations and annotations[key] != value:
            found.append(f"annotations.{key}")
    return found


def _apply_instancetype(it: Selected, pref: Selected | None, tspec: dict, meta: dict) -> None:
    conflicts = _conflicts(it, tspec, meta)
    if conflicts:
        raise SpecError("spec.instancetype", _CONFLICT.format(", ".join(conflicts)))
    spec = it.spec
    cpu, memory = spec["cpu"], spec["memory"]
    guest = cpu["guest"]
    sockets, cores, threads = _place(guest, pref)
    for key in ("numa", "realtime"):
        if cpu.get(key) is not None:
            raise _unsupported(it, f"cpu.{key}")
    if memory.get("maxGuest") is not None:
        raise _unsupported(it, "memory.maxGuest")  # memory hotplug
    if spec.get("launchSecurity") is not None:
        raise _unsupported(it, "launchSecurity")

    domain = _obj(tspec, "domain", "spec.template.spec.domain")
    for key in ("gpus", "hostDevices"):  # apply/gpu.go, hostdevices.go: copied in, then judged as the VM's own
        if spec.get(key):
            _obj(domain, "devices", "spec.template.spec.domain.devices")[key] = copy.deepcopy(spec[key])
    vcpu = _obj(domain, "cpu", "spec.template.spec.domain.cpu")
    if cpu.get("model") is not None:
        vcpu["model"] = cpu["model"]
    if cpu.get("dedicatedCPUPlacement") is not None:
        vcpu["dedicatedCpuPlacement"] = cpu["dedicatedCPUPlacement"]
    if cpu.get("isolateEmulatorThread") is not None:
        vcpu["isolateEmulatorThread"] = cpu["isolateEmulatorThread"]
    vcpu.update(sockets=sockets, cores=cores, threads=threads)
    if cpu.get("maxSockets") is not None:  # apply/cpu.go: the instance type's wins, no conflict
        vcpu["maxSockets"] = _uint(cpu["maxSockets"], f"{it.label} spec.cpu.maxSockets")
    if dig(spec, "ioThreads", "supplementalPoolThreadCount") is not None:  # apply/iothreads.go; the VMI's policy judges it
        domain["ioThreads"] = {"supplementalPoolThreadCount": spec["ioThreads"]["supplementalPoolThreadCount"]}

    vmem = _obj(domain, "memory", "spec.template.spec.domain.memory")
    vmem["guest"] = memory["guest"]
    percent = memory.get("overcommitPercent") or 0
    if percent:
        # apply/memory.go: the pod asks for less than the guest gets; the guest still sees all of it.
        amount = parse_quantity(memory["guest"], f"{it.label} spec.memory.guest")
        _obj(_obj(domain, "resources", "spec.template.spec.domain.resources"), "requests", "spec.template.spec.domain.resources.requests")["memory"] = str(int(amount * (100 - percent) / 100))
    if memory.get("hugepages") is not None:
        vmem["hugepages"] = copy.deepcopy(memory["hugepages"])
    if spec.get("nodeSelector") is not None:
        tspec["nodeSelector"] = dict(spec["nodeSelector"])
    if spec.get("schedulerName"):
        tspec["schedulerName"] = spec["schedulerName"]
    if spec.get("ioThreadsPolicy") is not None:
        domain["ioThreadsPolicy"] = spec["ioThreadsPolicy"]
    annotations = _obj(meta, "annotations", "spec.template.metadata.annotations")
    for key, value in as_map(spec.get("annotations"), "annotations").items():
        annotations.setdefault(key, value)


def _place(guest: int, pref: Selected | None) -> tuple[int, int, int]:
    """apply/cpu.go applyGuestCPUTopology: (sockets, cores, threads) for `guest` vCPUs."""
    if guest == 1:
        return 1, 1, 1
    topology = _topology(pref)
    if topology in ("sockets", "any"):
        return guest, 1, 1
    if topology == "cores":
        return 1, guest, 1
    if topology == "threads":
        return 1, 1, guest
    ratio, across = _spread_options(pref)
    if across == "SocketsCores":
        return guest // ratio, ratio, 1
    if across == "CoresThreads":
        return 1, guest // ratio, ratio
    return guest // 2 // ratio, ratio, 2


# ---------------------------------------------------------------- the preference

def _set_default(target: dict, key: str, value: Any) -> None:
    """Preferences never override what the VM says (an empty string counts as unset, as in Go)."""
    if target.get(key) in (None, ""):
        target[key] = copy.deepcopy(value)


def _apply_disks(pref: Selected, devices: dict, prefs: dict) -> None:
    """preference/apply/disk.go."""
    for disk in as_list(devices.get("disks"), f"{_BASE}.domain.devices.disks"):
        if not isinstance(disk, dict):
            continue
        if not any(isinstance(disk.get(k), dict) for k in ("disk", "cdrom", "lun")):
            disk["disk"] = {}
        if isinstance(disk.get("disk"), dict):
            if prefs.get("preferredDiskBus"):
                _set_default(disk["disk"], "bus", prefs["preferredDiskBus"])
            if prefs.get("preferredDiskBlockSize") is not None:
                _set_default(disk, "blockSize", prefs["preferredDiskBlockSize"])
            for key, field in (("preferredDiskCache", "cache"), ("preferredDiskIO", "io")):
                if prefs.get(key):
                    _set_default(disk, field, prefs[key])
            if prefs.get("preferredDiskDedicatedIoThread") is not None and disk["disk"].get("bus") == "virtio":
                _set_default(disk, "dedicatedIOThread", prefs["preferredDiskDedicatedIoThread"])
        elif isinstance(disk.get("cdrom"), dict):
            if prefs.get("preferredCdromBus"):
                _set_default(disk["cdrom"], "bus", prefs["preferredCdromBus"])
        elif prefs.get("preferredLunBus"):
            _set_default(disk["lun"], "bus", prefs["preferredLunBus"])


# Booleans a preference sets when the VM leaves them unset (device.go ApplyDevicePreferences and
# ApplyAutoAttachPreferences).
_DEVICE_FLAGS = {"preferredUseVirtioTransitional": "useVirtioTransitional", "preferredBlockMultiQueue": "blockMultiQueue",
                 "preferredNetworkInterfaceMultiQueue": "networkInterfaceMultiqueue",
                 "preferredAutoattachGraphicsDevice": "autoattachGraphicsDevice",
                 "preferredAutoattachMemBalloon": "autoattachMemBalloon",
                 "preferredAutoattachPodInterface": "autoattachPodInterface",
                 "preferredAutoattachSerialConsole": "autoattachSerialConsole",
                 "preferredAutoattachInputDevice": "autoattachInputDevice"}


def _default_volume_disks(devices: dict, tspec: dict) -> None:
    """util.SetDefaultVolumeDisk, which the VM controller runs on the VMI before the preference is
    applied: so a volume's implicit disk gets the preferred bus too."""
    named = {d.get("name") for key in ("disks", "filesystems")
             for d in as_list(devices.get(key), f"{_BASE}.domain.devices.{key}")
             if isinstance(d, dict) and isinstance(d.get("name"), str)}
    for volume in as_list(tspec.get("volumes"), f"{_BASE}.volumes"):
        # names of the wrong type are left for the VMI parser to refuse in its words
        if isinstance(volume, dict) and isinstance(volume.get("name"), str) and volume["name"] not in named:
            if devices.get("disks") is None:
                devices["disks"] = []
            devices["disks"].append({"name": volume["name"]})


def _auto_attach_input(tspec: dict) -> None:
    """pkg/virt-controller/watch/vm/vm.go AutoAttachInputDevice: a VM whose autoattachInputDevice is
    true and that names no input gets one, named default-0 (its bus and type: a preference's, else the
    defaults, usb and tablet). A VirtualMachine's alone: the VM controller adds it to the VMI it makes."""
    domain = tspec.get("domain")
    devices = domain.get("devices") if isinstance(domain, dict) else None
    if isinstance(devices, dict) and devices.get("autoattachInputDevice") is True and not devices.get("inputs"):
        devices["inputs"] = [{"name": "default-0"}]


def _apply_devices(pref: Selected, tspec: dict) -> None:
    """preference/apply/device.go, interface.go, disk.go."""
    devices = _obj(_obj(tspec, "domain", "spec.template.spec.domain"), "devices", "spec.template.spec.domain.devices")
    _default_volume_disks(devices, tspec)
    prefs = as_map(pref.spec.get("devices"), f"{pref.label} spec.devices")
    if not prefs:
        _auto_attach_input(tspec)
        return
    for key, field in _DEVICE_FLAGS.items():
        if prefs.get(key) is not None:
            _set_default(devices, field, prefs[key])
    # The VM controller applies the autoattach preferences, adds the input, then the other preferences.
    _auto_attach_input(tspec)
    if prefs.get("preferredDisableHotplug") is not None:
        devices["disableHotplug"] = prefs["preferredDisableHotplug"]  # not a pointer upstream: always replaced
    if prefs.get("preferredSoundModel") and isinstance(devices.get("sound"), dict) and not devices["sound"].get("model"):
        raise _unsupported(pref, "devices.preferredSoundModel")
    # pkg/instancetype/preference/apply/device.go: the preferred RNG when the VMI names none
    if prefs.get("preferredRng") is not None and devices.get("rng") is None:
        devices["rng"] = copy.deepcopy(prefs["preferredRng"])
    if prefs.get("preferredTPM") is not None and devices.get("tpm") is None:
        devices["tpm"] = copy.deepcopy(prefs["preferredTPM"])
    if prefs.get("preferredVideoType") is not None:
        if devices.get("video") is None:
            devices["video"] = {}
        if isinstance(devices["video"], dict):
            _set_default(devices["video"], "type", prefs["preferredVideoType"])
    if prefs.get("preferredPanicDeviceModel") is not None:
        raise _unsupported(pref, "devices.preferredPanicDeviceModel")
    for item in as_list(devices.get("inputs"), f"{_BASE}.domain.devices.inputs"):  # device.go applyInputPreferences
        for key, field in (("preferredInputBus", "bus"), ("preferredInputType", "type")):
            if prefs.get(key) and isinstance(item, dict):
                _set_default(item, field, prefs[key])
    # preferredInterfaceModel / preferredInterfaceMasquerade (interface.go) shape NICs, and the launcher
    # attaches none: KubeVirt's default pod interface is the same VM without one (README).
    _apply_disks(pref, devices, prefs)


def _apply_features(pref: Selected, domain: dict) -> None:
    """preference/apply/features.go."""
    prefs = as_map(pref.spec.get("features"), f"{pref.label} spec.features")
    if not prefs:
        return
    features = _obj(domain, "features", "spec.template.spec.domain.features")
    if prefs.get("preferredAcpi") is not None:
        features["acpi"] = copy.deepcopy(prefs["preferredAcpi"])  # acpi is no pointer upstream: always replaced
    for key, field in (("preferredApic", "apic"), ("preferredSmm", "smm")):
        if prefs.get(key) is not None:
            _set_default(features, field, prefs[key])
    if prefs.get("preferredHyperv") is not None:
        # applyHyperVFeaturePreferences: enlightenment by enlightenment, what the VM leaves unset
        hyperv = _obj(features, "hyperv", "spec.template.spec.domain.features.hyperv")
        for key, value in as_map(prefs["preferredHyperv"], f"{pref.label} spec.features.preferredHyperv").items():
            _set_default(hyperv, key, value)
    for key, field in (("preferredKvm", "kvm"), ("preferredPvspinlock", "pvspinlock")):
        if prefs.get(key) is not None:
            _set_default(features, field, prefs[key])


def _apply_firmware(pref: Selected, domain: dict) -> None:
    """preference/apply/firmware.go, including its early return after preferredEfi."""
    prefs = as_map(pref.spec.get("firmware"), f"{pref.label} spec.firmware")
    if not prefs:
        return
    loader = _obj(_obj(domain, "firmware", "spec.template.spec.domain.firmware"), "bootloader", "spec.template.spec.domain.firmware.bootloader")
    if prefs.get("preferredUseBios") and loader.get("bios") is None and loader.get("efi") is None:
        loader["bios"] = {}
    if prefs.get("preferredUseBiosSerial") is not None and isinstance(loader.get("bios"), dict):
        _set_default(loader["bios"], "useSerial", prefs["preferredUseBiosSerial"])
    if loader.get("efi") is None and loader.get("bios") is None and prefs.get("preferredEfi") is not None:
        loader["efi"] = copy.deepcopy(as_map(prefs["preferredEfi"], f"{pref.label} spec.firmware.preferredEfi"))
        return
    if prefs.get("preferredUseEfi") and loader.get("efi") is None and loader.get("bios") is None:
        loader["efi"] = {}
    if prefs.get("preferredUseSecureBoot") is not None and isinstance(loader.get("efi"), dict):
        _set_default(loader["efi"], "secureBoot", prefs["preferredUseSecureBoot"])


def _apply_clock(pref: Selected, domain: dict) -> None:
    """preference/apply/clock.go: the offset whole when the VM gives neither utc nor timezone, the timers
    whole when it gives none."""
    prefs = as_map(pref.spec.get("clock"), f"{pref.label} spec.clock")
    if not prefs:
        return
    clock = _obj(domain, "clock", "spec.template.spec.domain.clock")
    offset = prefs.get("preferredClockOffset")
    if offset is not None and clock.get("utc") is None and clock.get("timezone") is None:
        clock.update(copy.deepcopy(as_map(offset, f"{pref.label} spec.clock.preferredClockOffset")))
    if prefs.get("preferredTimer") is not None and clock.get("timer") is None:
        clock["timer"] = copy.deepcopy(prefs["preferredTimer"])


def _apply_preference(pref: Selected, vm: dict, tspec: dict, meta: dict) -> None:
    """preference/apply/vmi.go Apply, in its order, plus the VM mutator's storage class for
    dataVolumeTemplates (webhooks/vm/mutator.go)."""
    spec = pref.spec
    domain = _obj(tspec, "domain", "spec.template.spec.domain")
    features = dig(spec, "cpu", "preferredCPUFeatures")
    if features:
        have = {f.get("name") for f in as_list(dig(domain, "cpu", "features"), f"{_BASE}.domain.cpu.features") if isinstance(f, dict)}
        if any(isinstance(f, dict) and f.get("name") not in have for f in features):
            raise _unsupported(pref, "cpu.preferredCPUFeatures")
    _apply_devices(pref, tspec)
    _apply_features(pref, domain)
    _apply_firmware(pref, domain)
    machine_type = dig(spec, "machine", "preferredMachineType")
    if machine_type:
        _set_default(_obj(domain, "machine", "spec.template.spec.domain.machine"), "type", machine_type)
    _apply_clock(pref, domain)
    if spec.get("preferredSubdomain") is not None:
        _set_default(tspec, "subdomain", spec["preferredSubdomain"])
    if spec.get("preferredTerminationGracePeriodSeconds") is not None:
        _set_default(tspec, "terminationGracePeriodSeconds", spec["preferredTerminationGracePeriodSeconds"])
    if spec.get("preferredArchitecture"):
        _set_default(tspec, "architecture", spec["preferredArchitecture"])
    annotations = _obj(meta, "annotations", "spec.template.metadata.annotations")
    for key, value in as_map(spec.get("annotations"), f"{pref.label} spec.annotations").items():
        annotations.setdefault(key, value)
    if spec.get("preferredLaunchSecurity") is not None and domain.get("launchSecurity") is None:
        raise _unsupported(pref, "preferredLaunchSecurity")
    storage_class = dig(spec, "volumes", "preferredStorageClassName")
    if storage_class:
        for template in as_list(vm["spec"].get("dataVolumeTemplates"), "spec.dataVolumeTemplates"):
            for key in ("pvc", "storage"):
                target = dig(template, "spec", key)
                if isinstance(target, dict) and target.get("storageClassName") is None:
                    target["storageClassName"] = storage_class


# ---------------------------------------------------------------- entry points

def _obj(parent: dict, key: str, at: str) -> dict:
    """parent[key] as a mapping to fill in, made when absent or null; anything else is refused in one line."""
    value = parent.get(key)
    if value is None:
        value = parent[key] = {}
    if not isinstance(value, dict):
        raise SpecError(at, "must be a mapping")
    return value


def expand(vm: dict, objects: ObjectSource | None) -> dict:
    """The VirtualMachine `vm` with its instance type and preference applied to spec.template and its
    matchers gone (a copy; `vm` is left as it was)."""
    spec = as_map(vm.get("spec"), "spec")
    vm = copy.deepcopy(vm)
    if spec.get("instancetype") is None and spec.get("preference") is None:
        tspec = dig(vm, "spec", "template", "spec")
        if isinstance(tspec, dict):
            _auto_attach_input(tspec)
        return vm
    namespace = dig(vm, "metadata", "namespace") or "default"
    for what in ("instancetype", "preference"):
        if vm["spec"].get(what) is not None:
            _check_matcher(as_map(vm["spec"][what], f"spec.{what}"), what)
    for what in ("instancetype", "preference"):
        if vm["spec"].get(what) is not None:
            _infer(vm, objects, namespace, what)
    it = _find(vm, objects, namespace, "instancetype")
    pref = _find(vm, objects, namespace, "preference")
    if it is not None:
        _check_instancetype(it)
    if pref is not None:
        _check_preference(pref)
    _check_spread(it, pref)
    template = _obj(vm["spec"], "template", "spec.template")
    if not isinstance(template, dict):
        raise SpecError("spec.template", "must be a mapping")
    tspec = _obj(template, "spec", "spec.template.spec")
    meta = _obj(template, "metadata", "spec.template.metadata")
    if not isinstance(tspec, dict) or not isinstance(meta, dict):
        raise SpecError("spec.template", "spec and metadata must be mappings")
    if it is not None:
        _apply_instancetype(it, pref, tspec, meta)
    if pref is not None:
        _apply_preference(pref, vm, tspec, meta)
        _check_requirements(it, pref, tspec)
    else:
        _auto_attach_input(tspec)
    annotations = _obj(meta, "annotations", "spec.template.metadata.annotations")
    for selected in (it, pref):
        if selected is not None:
            annotations[ANNOTATIONS[selected.kind]] = selected.name
    # Consumed: what is left describes the VMI, which names them in the annotations only.
    vm["spec"].pop("instancetype", None)
    vm["spec"].pop("preference", None)
    return vm


def quantity_text(amount: Fraction | int, binary: bool) -> str:
    """resource.Quantity.String(): the largest suffix that keeps the number whole."""
    amount = Fraction(amount)
    if amount.denominator == 1:
        units = ((2**60, "Ei"), (2**50, "Pi"), (2**40, "Ti"), (2**30, "Gi"), (2**20, "Mi"), (2**10, "Ki")) if binary else \
            ((10**18, "E"), (10**15, "P"), (10**12, "T"), (10**9, "G"), (10**6, "M"), (10**3, "k"))
        for size, suffix in units:
            if amount and amount % size == 0:
                return f"{amount // size}{suffix}"
        return str(amount.numerator)
    return f"{math.ceil(amount * 1000)}m"


def _quantity(value: Any, at: str) -> tuple[Fraction, str]:
    amount = parse_quantity(value, at)
    return amount, quantity_text(amount, str(value).strip().endswith("i"))


def _defaulted_topology(tspec: dict) -> dict[str, int]:
    """defaults.SetDefaultGuestCPUTopology: only when none of the three is set do they become
    (CPU limit, else request, rounded up, else 1) sockets of 1 core of 1 thread; a partial topology
    keeps its zeros, and the requirements see them."""
    cpu = as_map(dig(tspec, "domain", "cpu"), f"{_BASE}.domain.cpu")
    counts = {k: cpu.get(k) or 0 for k in ("sockets", "cores", "threads")}
    if any(counts.values()):
        return counts
    sockets = 1
    for side in ("limits", "requests"):
        value = dig(tspec, "domain", "resources", side, "cpu")
        if value is not None:
            sockets = math.ceil(parse_quantity(value, f"{_BASE}.domain.resources.{side}.cpu"))  # Quantity.Value()
            break
    return {"sockets": sockets, "cores": 1, "threads": 1}


def _defaulted_memory(tspec: dict) -> tuple[Fraction, str]:
    """defaults.setGuestMemory: guest, else the memory request, else the limit, else the hugepage size;
    none at all reads as 0 (the checker's own starting value)."""
    memory = as_map(dig(tspec, "domain", "memory"), f"{_BASE}.domain.memory")
    for value, at in ((memory.get("guest"), "memory.guest"),
                      (dig(tspec, "domain", "resources", "requests", "memory"), "resources.requests.memory"),
                      (dig(tspec, "domain", "resources", "limits", "memory"), "resources.limits.memory"),
                      (dig(memory, "hugepages", "pageSize"), "memory.hugepages.pageSize")):
        if value is not None and parse_quantity(value, f"{_BASE}.domain.{at}"):
            return _quantity(value, f"{_BASE}.domain.{at}")
    return Fraction(0), "0"


def _check_requirements(it: Selected | None, pref: Selected, tspec: dict) -> None:
    """preference/requirements, as the VM admitter runs it: after the instance type and preference are
    applied and the template defaulted, before the template is validated. The minimums are checked
    against the instance type, or without one against the template (its sockets/cores/threads by
    name, guest memory, architecture)."""
    requirements = as_map(pref.spec.get("requirements"), f"{pref.label} spec.requirements")
    if not requirements:
        return
    prefix = "failure checking preference requirements: "
    need_cpu = dig(requirements, "cpu", "guest")
    if need_cpu is not None:
        need_cpu = _uint(need_cpu, f"{pref.label} spec.requirements.cpu.guest")
        if it is not None:
            if it.spec["cpu"]["guest"] < need_cpu:
                raise SpecError("spec.instancetype", f"{prefix}insufficient CPU resources of {it.spec['cpu']['guest']} vCPU provided by instance type, preference requires {need_cpu} vCPU")
        else:
            topology = _topology(pref)
            base = f"{_BASE}.domain.cpu"
            if topology == "spread":
                _, across = _spread_options(pref)
                names = {"SocketsCores": ("sockets", "cores"), "CoresThreads": ("cores", "threads")}.get(across, ("sockets", "cores", "threads"))
                label = across
            elif topology == "any":
                names, label = ("cores", "sockets", "threads"), "cores, sockets and threads"
            else:
                names, label = (topology,), topology
            counts = _defaulted_topology(tspec)
            provided = 1
            for name in names:
                provided *= counts[name]
            if provided < need_cpu:
                raise SpecError(", ".join(f"{base}.{n}" for n in names),
                                f"{prefix}insufficient CPU resources of {provided} vCPU provided by VirtualMachine, preference requires {need_cpu} vCPU provided as {label}")
    need_memory = dig(requirements, "memory", "guest")
    if need_memory is not None:
        need, need_text = _quantity(need_memory, f"{pref.label} spec.requirements.memory.guest")
        if it is not None:
            have, have_text = _quantity(it.spec["memory"]["guest"], f"{it.label} spec.memory.guest")
            subject, source = "spec.instancetype", "instance type"
        else:
            have, have_text = _defaulted_memory(tspec)
            subject, source = f"{_BASE}.domain.memory", "VirtualMachine"
        if have < need:
            raise SpecError(subject, f"{prefix}insufficient Memory resources of {have_text} provided by {source}, preference requires {need_text}")
    arch = requirements.get("architecture")
    architecture = tspec.get("architecture") or "amd64"  # defaults.setDefaultArchitecture: the node's
    if arch is not None and arch != architecture:
        raise SpecError(f"{_BASE}.architecture", f"{prefix}preference requires architecture {arch} but {architecture} is being requested")

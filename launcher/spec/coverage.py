"""Which fields of a VM or VMI the launcher implements, and a walk that finds the rest (pure).

The launcher's promise is the VM KubeVirt would run, or a refusal: never a different VM. So every
field of a manifest is one of
- HANDLED: parsed, validated and rendered (launcher.spec.vmi and the modules it calls);
- INERT: KubeVirt fields that change nothing the guest sees (scheduling, probes, pull secrets);
- UNSUPPORTED: KubeVirt fields the launcher does not implement and that would change the guest
  (a device, a CPU feature, a network). Refused, naming the field, unless the user asks to go on
  without them (`--ignore-unsupported`), and then each one is named as it is dropped;
- or not a KubeVirt field at all: refused the same way (KubeVirt's API server would prune it silently,
  which is how `readOnly` on a disk target, the schema's `readonly`, loses its effect in a cluster).

Field names and nesting follow staging/src/kubevirt.io/api/core/v1 (types.go, schema.go).
"""

from __future__ import annotations

import copy
import re
from typing import Any

from launcher.spec.fields import did_you_mean

HANDLED, INERT, UNSUPPORTED = "handled", "inert", "unsupported"
# A flag whose false or absent value is what the launcher does anyway; only a true value is refused.
UNLESS_FALSE = "unsupported unless false"
# Parsed, then refused in one line saying why where it asks for what the node cannot do (KubeVirt's
# words first where KubeVirt refuses it too: its gates and admitters); accepted where it asks nothing.
JUDGED = "judged"
# What a node gives from its device plugins, DRA drivers and CNI plugins: this node has none, so they
# are refused as a cluster stops a VM its nodes cannot serve (launcher.spec.hostdevices, .multus; but a
# Multus bridge network, which a root launcher makes itself: JUDGED).
NODE_LACKS = "node lacks"


class ListOf:
    """A list whose items are objects of the given shape."""

    def __init__(self, shape: dict):
        self.shape = shape


OBJECT_REF = {"name": HANDLED}
METADATA = {
    "name": HANDLED, "namespace": HANDLED, "labels": HANDLED, "annotations": HANDLED, "uid": HANDLED,
    **dict.fromkeys(("generateName", "resourceVersion", "creationTimestamp", "generation", "ownerReferences",
                     "finalizers", "managedFields", "selfLink", "deletionTimestamp", "deletionGracePeriodSeconds"), INERT),
}
CLOUD_INIT = {
    "userData": HANDLED, "userDataBase64": HANDLED, "secretRef": OBJECT_REF,
    "networkData": HANDLED, "networkDataBase64": HANDLED, "networkDataSecretRef": OBJECT_REF,
}
CLAIM = {"claimName": HANDLED, "readOnly": HANDLED, "hotpluggable": INERT}
VOLUME = {
    "name": HANDLED,
    "containerDisk": {"image": HANDLED, "path": HANDLED, "imagePullPolicy": HANDLED,
                      "imagePullSecret": HANDLED},  # the Secret in --manifests, for that image's pulls
    "persistentVolumeClaim": CLAIM,
    "dataVolume": {"name": HANDLED, "hotpluggable": INERT},
    "ephemeral": {"persistentVolumeClaim": CLAIM},
    "emptyDisk": {"capacity": HANDLED},
    "hostDisk": {"path": HANDLED, "type": HANDLED, "capacity": HANDLED, "shared": HANDLED},
    "cloudInitNoCloud": CLOUD_INIT,
    "cloudInitConfigDrive": CLOUD_INIT,
    "configMap": {"name": HANDLED, "optional": HANDLED, "volumeLabel": HANDLED},
    "secret": {"secretName": HANDLED, "optional": HANDLED, "volumeLabel": HANDLED},
    "serviceAccount": {"serviceAccountName": HANDLED},
    "downwardAPI": {"fields": ListOf({"path": HANDLED, "fieldRef": {"apiVersion": HANDLED, "fieldPath": HANDLED},
                                      "resourceFieldRef": HANDLED, "mode": HANDLED}),
                    "volumeLabel": HANDLED},
    "downwardMetrics": {},
    "sysprep": {"configMap": OBJECT_REF, "secret": OBJECT_REF},
    "memoryDump": JUDGED,  # launcher.spec.vmi: admitted as KubeVirt admits it, then refused (launcher memory-dump adds none)
    "containerPath": UNSUPPORTED,
}
TARGET = {"bus": HANDLED, "readonly": HANDLED}
DISK = {
    "name": HANDLED,
    "disk": {**TARGET, "pciAddress": HANDLED},
    "lun": {**TARGET, "reservation": JUDGED},  # behind its gate; only an iSCSI lun on bus scsi (launcher.spec.gates, launcher.render.domain)
    "cdrom": {**TARGET, "tray": HANDLED},
    "floppy": HANDLED,  # refused by the parser with KubeVirt's words
    "bootOrder": HANDLED, "serial": HANDLED, "dedicatedIOThread": HANDLED, "cache": HANDLED, "io": HANDLED,
    "tag": INERT,  # device role tags reach the guest only through KubeVirt's metadata service
    "blockSize": {"custom": {"logical": HANDLED, "physical": HANDLED, "discardGranularity": HANDLED},
                  "matchVolume": {"enabled": HANDLED}},
    "shareable": HANDLED, "errorPolicy": HANDLED,
    "changedBlockTracking": INERT,
}
# launcher.spec.network parses these, refusing SR-IOV, Multus and KubeVirt's discontinued bindings in
# their own words; portRanges and dhcpOptions too (a feature gate, KubeVirt's in-pod DHCP server).
INTERFACE = {
    "sriov": NODE_LACKS,
    **dict.fromkeys(("name", "model", "bridge", "masquerade", "slirp", "passt", "macvtap", "passtBinding",
                     "macAddress", "bootOrder", "pciAddress", "portRanges", "dhcpOptions", "state"), HANDLED),
    "binding": {"name": HANDLED},
    "ports": ListOf({"name": HANDLED, "protocol": HANDLED, "port": HANDLED}),
    "tag": INERT,  # as a disk's tag: only KubeVirt's metadata service shows it
    "acpiIndex": UNSUPPORTED,
}
NETWORK = {"name": HANDLED, "pod": {"vmNetworkCIDR": HANDLED, "vmIPv6NetworkCIDR": HANDLED},
           "multus": JUDGED, "resourceClaim": HANDLED}
DEVICES = {
    "disks": ListOf(DISK),
    "useVirtioTransitional": HANDLED, "disableHotplug": HANDLED, "autoattachSerialConsole": HANDLED,
    "filesystems": ListOf({"name": HANDLED, "virtiofs": {}}),
    "blockMultiQueue": HANDLED,
    "interfaces": ListOf(INTERFACE), "autoattachPodInterface": HANDLED,
    # autoattachInputDevice: a VirtualMachine's, the VM controller's input (launcher.spec.instancetype)
    **dict.fromkeys(("autoattachGraphicsDevice", "autoattachMemBalloon", "autoattachInputDevice",
                     "networkInterfaceMultiqueue"), HANDLED),
    "inputs": ListOf({"name": HANDLED, "bus": HANDLED, "type": HANDLED}),
    "video": {"type": HANDLED},
    "logSerialConsole": INERT,  # the console is always logged to the run directory
    "autoattachVSOCK": UNLESS_FALSE,
    "rng": {},
    "tpm": {"enabled": HANDLED, "persistent": HANDLED},
    "downwardMetrics": JUDGED,  # launcher.spec.gates: KubeVirt's gate, then refused (no server answers the port)
    **dict.fromkeys(("gpus", "hostDevices"), NODE_LACKS),
    **dict.fromkeys(("watchdog", "panicDevices", "clientPassthrough", "sound"), UNSUPPORTED),
}
STATE = {"enabled": HANDLED}
# launcher.spec.hyperv; each is rendered, and said in one line where emulation runs the guest without it.
# libvirt 9.0's <tlbflush> takes neither <direct> nor <extended> (it would drop them unsaid).
HYPERV = {
    **dict.fromkeys(("relaxed", "vapic", "vpindex", "runtime", "synic", "reset", "frequencies", "reenlightenment",
                     "ipi", "evmcs"), STATE),
    "spinlocks": {"enabled": HANDLED, "spinlocks": HANDLED},
    "vendorid": {"enabled": HANDLED, "vendorid": HANDLED},
    "synictimer": {"enabled": HANDLED, "direct": STATE},
    "tlbflush": {"enabled": HANDLED, "direct": UNSUPPORTED, "extended": UNSUPPORTED},
}
TIMER = {"hpet": {"tickPolicy": HANDLED, "present": HANDLED}, "pit": {"tickPolicy": HANDLED, "present": HANDLED},
         "rtc": {"tickPolicy": HANDLED, "present": HANDLED, "track": HANDLED},
         "kvm": {"present": HANDLED}, "hyperv": {"present": HANDLED}}
QUANTITIES = HANDLED  # requests/limits: the parser reads cpu and memory; other resources only schedule
DOMAIN = {
    "resources": {"requests": QUANTITIES, "limits": QUANTITIES, "overcommitGuestOverhead": INERT},
    "cpu": {"cores": HANDLED, "sockets": HANDLED, "threads": HANDLED, "model": HANDLED,
            "dedicatedCpuPlacement": HANDLED, "isolateEmulatorThread": HANDLED,
            "maxSockets": HANDLED, "features": UNSUPPORTED, "numa": UNSUPPORTED, "realtime": UNSUPPORTED},
    "memory": {"guest": HANDLED, "hugepages": UNSUPPORTED, "maxGuest": UNSUPPORTED, "reservedOverhead": INERT},
    "machine": {"type": HANDLED},
    "firmware": {"uuid": HANDLED, "serial": HANDLED,
                 "bootloader": {"bios": {"useSerial": HANDLED}, "efi": {"secureBoot": HANDLED, "persistent": HANDLED}},
                 "kernelBoot": {"kernelArgs": HANDLED,
                                "container": {"image": HANDLED, "kernelPath": HANDLED, "initrdPath": HANDLED,
                                              "imagePullPolicy": HANDLED, "imagePullSecret": HANDLED}},
                 "acpi": UNSUPPORTED},
    "clock": {"utc": {"offsetSeconds": HANDLED}, "timezone": HANDLED, "timer": TIMER},
    "features": {"acpi": {"enabled": HANDLED}, "apic": {"enabled": HANDLED, "endOfInterrupt": UNLESS_FALSE},
                 "smm": {"enabled": HANDLED},
                 "hyperv": HYPERV, "hypervPassthrough": {"enabled": HANDLED}, "kvm": {"hidden": HANDLED},
                 "pvspinlock": {"enabled": HANDLED}},
    "devices": DEVICES,
    "ioThreadsPolicy": HANDLED,
    "ioThreads": {"supplementalPoolThreadCount": JUDGED},  # launcher.spec.vmi: with its policy, refused there
    "chassis": UNSUPPORTED, "launchSecurity": UNSUPPORTED, "rebootPolicy": UNSUPPORTED,
}
VMI_SPEC = {
    "domain": DOMAIN,
    "volumes": ListOf(VOLUME),
    "hostname": HANDLED, "architecture": HANDLED, "terminationGracePeriodSeconds": HANDLED,
    "dataVolumeTemplates": HANDLED,  # a VirtualMachine's field, read on a VMI too (launcher.spec.datavolume parses it)
    **dict.fromkeys(("priorityClassName", "nodeSelector", "affinity", "schedulerName", "serviceAccountName",
                     "tolerations", "topologySpreadConstraints", "evictionStrategy",
                     "livenessProbe", "readinessProbe", "subdomain", "dnsPolicy", "dnsConfig"), INERT),
    "networks": ListOf(NETWORK),
    # launcher.spec.credentials
    "accessCredentials": ListOf({"sshPublicKey": {"source": {"secret": {"secretName": HANDLED}},
                                                  "propagationMethod": {"noCloud": {}, "configDrive": {},
                                                                        "qemuGuestAgent": {"users": HANDLED}}},
                                 "userPassword": UNSUPPORTED}),
    "resourceClaims": NODE_LACKS,
    **dict.fromkeys(("startStrategy", "utilityVolumes"), UNSUPPORTED),
}
TEMPLATE = {"metadata": METADATA, "spec": VMI_SPEC}
VM_SPEC = {
    "template": TEMPLATE, "dataVolumeTemplates": HANDLED,
    **dict.fromkeys(("running", "runStrategy", "updateVolumesStrategy"), INERT),
    # launcher.spec.instancetype applies them (and removes them) before this walk
    **dict.fromkeys(("instancetype", "preference"), HANDLED),
}
DOCUMENT = {"apiVersion": HANDLED, "kind": HANDLED, "metadata": METADATA, "status": INERT}

UNSUPPORTED_RULE = "not supported by the launcher, and it changes what the guest sees; --ignore-unsupported runs without it"
UNKNOWN_RULE = "unknown field: not in KubeVirt's schema, so its API server would drop it; --ignore-unsupported runs without it"
VM_SPEC_RULE = "not a VirtualMachine field: a VirtualMachine's VirtualMachineInstance spec belongs under spec.template.spec"


def _walk(value: Any, shape: Any, path: str, found: list[tuple[str, str]]) -> None:
    if isinstance(shape, ListOf):
        if isinstance(value, list):
            for i, item in enumerate(value):
                _walk(item, shape.shape, f"{path}[{i}]", found)
        return
    if not isinstance(shape, dict) or not isinstance(value, dict):
        return  # leaves, and wrong types the parser reports in its own words
    for key, child in value.items():
        where = f"{path}.{key}" if path else str(key)
        rule = shape.get(key)
        if rule is None:
            hint = did_you_mean(key, shape)
            found.append((where, f"unknown field{hint.replace('; ', ' (', 1) + ')' if hint else ''}: {UNKNOWN_RULE.removeprefix('unknown field: ')}"))
        elif rule == UNSUPPORTED or (rule == UNLESS_FALSE and child not in (None, False)):
            found.append((where, UNSUPPORTED_RULE))
        else:
            _walk(child, rule, where, found)


def unsupported_fields(doc: Any) -> list[tuple[str, str]]:
    """(field path, rule) of every field of a VM or VMI document the launcher would not honour."""
    if not isinstance(doc, dict):
        return []
    vm = doc.get("kind") == "VirtualMachine"
    shape = {**DOCUMENT, "spec": VM_SPEC if vm else VMI_SPEC}
    found: list[tuple[str, str]] = []
    _walk(doc, shape, "", found)
    if vm:  # the commonest VirtualMachine mistake: the VMI's spec one level too high
        found = [(path, VM_SPEC_RULE if rule.startswith("unknown field") and path.startswith("spec.") and path[5:] in VMI_SPEC else rule)
                 for path, rule in found]
    return found


_VOLUME_SOURCE = re.compile(r"(.*)\.volumes\[(\d+)\]\.([A-Za-z]+)")
_CREDENTIAL_PART = re.compile(r"(.*)\.accessCredentials\[(\d+)\]\..*")


def without(doc: dict, paths: list[str]) -> dict:
    """A copy of `doc` with the fields at `paths` (as unsupported_fields names them) removed.

    A volume whose source is dropped goes whole, with the disks and filesystems that use it: a volume
    without a source is one KubeVirt refuses, and a disk without its volume too. So do the volumes of
    dropped filesystems. An access credential loses nothing but goes whole: one without its type or
    propagation method is one KubeVirt refuses."""
    out = copy.deepcopy(doc)
    volumes, credentials = [], []
    for path in paths:
        if match := _CREDENTIAL_PART.fullmatch(path):
            credentials.append((match.group(1), int(match.group(2))))
            continue
        match = _VOLUME_SOURCE.fullmatch(path)
        if match and match.group(3) in VOLUME:
            volumes.append((match.group(1), int(match.group(2))))
            continue
        parent, key = _locate(out, path)
        if parent is None:
            continue
        dropped = parent.pop(key, None)
        if path.endswith(".domain.devices.filesystems") and isinstance(dropped, list):
            # A filesystem's volume has no disk (util.SetDefaultVolumeDisk skips it): kept, it would
            # become a disk the VM never had.
            spec_path = path.removesuffix(".domain.devices.filesystems")
            spec, _ = _locate(out, f"{spec_path}.volumes")
            names = {f.get("name") for f in dropped if isinstance(f, dict) and isinstance(f.get("name"), str)}
            listed = spec.get("volumes") if spec is not None else None
            for index, volume in enumerate(listed if isinstance(listed, list) else []):
                if isinstance(volume, dict) and isinstance(volume.get("name"), str) and volume["name"] in names:
                    volumes.append((spec_path, index))
    for spec_path, index in sorted(set(credentials), reverse=True):
        spec, _ = _locate(out, f"{spec_path}.accessCredentials")
        if spec is not None and isinstance(spec.get("accessCredentials"), list) and index < len(spec["accessCredentials"]):
            spec["accessCredentials"].pop(index)
    for spec_path, index in sorted(set(volumes), reverse=True):
        spec, _ = _locate(out, f"{spec_path}.volumes")
        if spec is None or not isinstance(spec.get("volumes"), list) or index >= len(spec["volumes"]):
            continue
        popped = spec["volumes"].pop(index)
        name = popped.get("name") if isinstance(popped, dict) else None
        domain = spec.get("domain")
        devices = domain.get("devices") if isinstance(domain, dict) else None
        for key in ("disks", "filesystems"):  # whatever used the volume goes with it
            if isinstance(devices, dict) and isinstance(devices.get(key), list):
                devices[key] = [d for d in devices[key] if not (isinstance(d, dict) and d.get("name") == name)]
    return out


def _locate(doc: Any, path: str) -> tuple[dict | None, str]:
    tokens: list[Any] = []
    for part in _split(path):
        name, _, rest = part.partition("[")
        if name:
            tokens.append(name)
        while rest:
            index, _, rest = rest.partition("]")
            tokens.append(int(index) if index.isdigit() else index)
            rest = rest.removeprefix("[")
    node = doc
    for token in tokens[:-1]:
        try:
            node = node[token]
        except (KeyError, IndexError, TypeError):
            return None, ""
    return (node, tokens[-1]) if isinstance(node, dict) else (None, "")


def _split(path: str) -> list[str]:
    # Dots inside [...] (annotation keys) do not separate fields.
    parts, depth, current = [], 0, ""
    for char in path:
        if char == "." and depth == 0:
            parts.append(current)
            current = ""
            continue
        depth += char == "["
        depth -= char == "]"
        current += char
    parts.append(current)
    return parts

"""VirtualMachineInstance specs for the tests, built from options as KubeVirt's own tests build theirs
(kubevirt/kubevirt pkg/libvmi: `libvmi.New(libvmi.WithContainerDisk(...), libvmi.WithResourceMemory(...))`).

    vmi = new("web", with_container_disk("root", image, serial="hold-300"), with_nic("default"))
    path = write(vmi, directory)

Each option is a function that changes the spec in place; `new` starts from what every test guest
needs (a name, 128Mi, no devices) and applies them in order. The result is a plain dict, so a test
can still change anything the options do not cover before it writes the file (JSON, which is YAML).

The test guest (images/testguest/init) reads its instructions from disk serials: `hold-N` keeps it up N
seconds after DONE, `hold-N-echo` answers each console line, `no-ssh`, `http-PORT`, `attack-fs`,
`net-bench`, and `-ignore-acpi` as a suffix. `with_guest_serial` sets the root disk's.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Callable

Option = Callable[[dict], None]


def new(name: str, *options: Option, namespace: str | None = None) -> dict:
    vmi: dict = {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": name, **({"namespace": namespace} if namespace else {})},
        "spec": {"domain": {"resources": {"requests": {"memory": "128Mi"}}, "devices": {"disks": []}}, "volumes": []},
    }
    for option in options:
        option(vmi)
    return vmi


def write(vmi: dict, directory: Path, name: str | None = None) -> Path:
    path = Path(directory) / f"{name or vmi['metadata']['name']}.yaml"
    path.write_text(json.dumps(vmi, indent=2))
    return path


def virtual_machine(vmi: dict, running: bool = True) -> dict:
    """The VMI as the template of a VirtualMachine of the same name."""
    spec = copy.deepcopy(vmi["spec"])
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": copy.deepcopy(vmi["metadata"]),
            "spec": {"running": running, "template": {"metadata": {}, "spec": spec}}}


# --- disks and volumes ---------------------------------------------------------------------------

def with_disk(name: str, volume: dict, bus: str = "virtio", serial: str | None = None, kind: str = "disk", **disk: object) -> Option:
    """A disk of `kind` (disk, cdrom, lun) on `bus` backed by `volume` (the volume's source, without its name)."""
    def apply(vmi: dict) -> None:
        device: dict = {"name": name, kind: {"bus": bus} if bus else {}, **disk}
        if serial:
            device["serial"] = serial
        vmi["spec"]["domain"]["devices"]["disks"].append(device)
        vmi["spec"]["volumes"].append({"name": name, **volume})
    return apply


def with_container_disk(name: str, image: str, path: str | None = None, serial: str | None = None, bus: str = "virtio", **disk: object) -> Option:
    source: dict = {"image": image}
    if path:
        source["path"] = path
    return with_disk(name, {"containerDisk": source}, bus=bus, serial=serial, **disk)


def with_claim(name: str, claim: str, serial: str | None = None, read_only: bool = False, **disk: object) -> Option:
    source: dict = {"claimName": claim}
    if read_only:
        source["readOnly"] = True
    return with_disk(name, {"persistentVolumeClaim": source}, serial=serial, **disk)


def with_cloud_init_nocloud(user_data: str = "#cloud-config\n", name: str = "cloudinit", **source: object) -> Option:
    return with_disk(name, {"cloudInitNoCloud": {"userData": user_data, **source}})


def with_cloud_init_config_drive(user_data: str = "#cloud-config\n", name: str = "cloudinit", **source: object) -> Option:
    return with_disk(name, {"cloudInitConfigDrive": {"userData": user_data, **source}})


def with_empty_disk(name: str, capacity: str, serial: str | None = None) -> Option:
    return with_disk(name, {"emptyDisk": {"capacity": capacity}}, serial=serial)


def with_filesystem(name: str, volume: dict) -> Option:
    """A virtiofs share of `volume` (tag `name`: the test guest mounts fs0..fs7)."""
    def apply(vmi: dict) -> None:
        vmi["spec"]["domain"]["devices"].setdefault("filesystems", []).append({"name": name, "virtiofs": {}})
        vmi["spec"]["volumes"].append({"name": name, **volume})
    return apply


def with_guest_serial(serial: str) -> Option:
    """The first disk's serial: how the test guest is told to hold, echo, attack..."""
    def apply(vmi: dict) -> None:
        vmi["spec"]["domain"]["devices"]["disks"][0]["serial"] = serial
    return apply


# --- domain --------------------------------------------------------------------------------------

def with_memory(quantity: str) -> Option:
    def apply(vmi: dict) -> None:
        vmi["spec"]["domain"]["resources"]["requests"]["memory"] = quantity
    return apply


def with_domain(**fields: object) -> Option:
    """Fields of spec.domain (firmware, cpu, clock, features...), merged over what is there."""
    def apply(vmi: dict) -> None:
        vmi["spec"]["domain"].update(copy.deepcopy(fields))
    return apply


def with_devices(**fields: object) -> Option:
    def apply(vmi: dict) -> None:
        vmi["spec"]["domain"]["devices"].update(copy.deepcopy(fields))
    return apply


def with_spec(**fields: object) -> Option:
    """Fields of spec beside the domain (accessCredentials, terminationGracePeriodSeconds, ...)."""
    def apply(vmi: dict) -> None:
        vmi["spec"].update(copy.deepcopy(fields))
    return apply


def with_firmware_serial(serial: str) -> Option:
    """SMBIOS serial: the test guest's web page names it, so a test knows which VM answered."""
    def apply(vmi: dict) -> None:
        vmi["spec"]["domain"].setdefault("firmware", {})["serial"] = serial
    return apply


# --- network -------------------------------------------------------------------------------------

def with_nic(name: str = "default", binding: str = "masquerade", network: dict | None = None, **interface: object) -> Option:
    """An interface of `binding` on the pod network (or `network`'s source)."""
    def apply(vmi: dict) -> None:
        vmi["spec"]["domain"]["devices"].setdefault("interfaces", []).append({"name": name, binding: {}, **interface})
        vmi["spec"].setdefault("networks", []).append({"name": name, **(network or {"pod": {}})})
    return apply


def with_access_credential(secret: str, method: str = "noCloud") -> Option:
    """An ssh key from Secret `secret`, propagated by `method` (noCloud, configDrive, qemuGuestAgent)."""
    def apply(vmi: dict) -> None:
        vmi["spec"].setdefault("accessCredentials", []).append(
            {"sshPublicKey": {"source": {"secret": {"secretName": secret}}, "propagationMethod": {method: {}}}})
    return apply

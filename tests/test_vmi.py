"""VMI parsing: KubeVirt's defaulting and its validation messages, each error naming the field path."""

from __future__ import annotations

import copy
from fractions import Fraction

import pytest

from launcher.spec.fields import SpecError, parse_quantity
from launcher.spec.vmi import ContainerDiskSource, EmptyDiskSource, load_vmi, parse_vmi


def vmi_doc(disks=None, volumes=None, **domain):
    domain.setdefault("resources", {"requests": {"memory": "64Mi"}})
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": "vm1", "namespace": "ns"},
        "spec": {
            "domain": {**domain, "devices": {**domain.pop("devices", {}), "disks": disks or []}},
            "volumes": volumes if volumes is not None else [{"name": "root", "containerDisk": {"image": "quay.io/x/y:1"}}],
        },
    }


def error(doc) -> str:
    with pytest.raises(SpecError) as err:
        parse_vmi(doc)
    return str(err.value)


ROOT_VOLUME = {"name": "root", "containerDisk": {"image": "quay.io/x/y:1"}}


# ---------------------------------------------------------------- defaulting

def test_minimal_vmi_gets_kubevirts_defaults():
    vmi = parse_vmi(vmi_doc())
    assert vmi.domain_name == "ns_vm1"
    (disk,) = vmi.domain.devices.disks
    # a volume without a disk gets one (util.SetDefaultVolumeDisk), on SATA (pkg/defaults/amd64.go)
    assert (disk.name, disk.device, disk.bus, disk.index, disk.defaulted, disk.error_policy) == ("root", "disk", "sata", 0, True, "stop")
    assert vmi.volume("root").source == ContainerDiskSource("quay.io/x/y:1")
    assert vmi.domain.machine_type == "q35"
    assert vmi.domain.guest_memory == 64 * 2**20
    assert vmi.domain.topology == (1, 1, 1)
    assert vmi.domain.features.acpi


def test_namespace_defaults_to_default():
    doc = vmi_doc()
    del doc["metadata"]["namespace"]
    assert parse_vmi(doc).domain_name == "default_vm1"


def test_cdrom_defaults_to_read_only_closed_tray_on_sata():
    vmi = parse_vmi(vmi_doc([{"name": "root", "cdrom": {}}]))
    disk = vmi.disk("root")
    assert (disk.device, disk.bus, disk.read_only, disk.tray) == ("cdrom", "sata", True, "closed")


def test_disk_without_target_is_a_sata_disk():
    assert parse_vmi(vmi_doc([{"name": "root"}])).disk("root").device == "disk"


@pytest.mark.parametrize(
    "image,policy",
    [("quay.io/x/y", "Always"), ("quay.io/x/y:latest", "Always"), ("quay.io/x/y:1", "IfNotPresent"),
     ("quay.io/x/y@sha256:" + "a" * 64, "IfNotPresent"), ("localhost:5000/y", "IfNotPresent")],
)
def test_pull_policy_default_follows_kubevirt(image, policy):
    # localhost:5000/y has a ':' so KubeVirt's own test (strings.ContainsAny) says IfNotPresent too
    assert ContainerDiskSource(image).pull_policy == policy
    assert ContainerDiskSource(image, image_pull_policy="Never").pull_policy == "Never"


def test_cpu_limit_becomes_request_and_sockets():
    vmi = parse_vmi(vmi_doc(resources={"requests": {"memory": "1Gi"}, "limits": {"cpu": "1500m"}}))
    assert vmi.domain.resources.requests_cpu == 1500
    assert vmi.domain.topology == (2, 1, 1)  # resource.Quantity.Value() rounds up
    vmi = parse_vmi(vmi_doc(cpu={"cores": 3}, resources={"requests": {"memory": "1Gi", "cpu": 8}}))
    assert vmi.domain.topology == (1, 3, 1) and vmi.domain.vcpus == 3


def test_max_sockets_bounds_the_vcpus_it_makes_room_for():
    # Each hotpluggable vCPU is an element of the domain: KubeVirt's own bound (pkg/defaults/defaults.go
    # setupCPUHotplug, 512) is taken before any is made; at the bound it is fine.
    assert parse_vmi(vmi_doc(cpu={"cores": 2, "maxSockets": 256})).domain.cpu.max_sockets == 256
    assert error(vmi_doc(cpu={"cores": 2, "maxSockets": 2**32 - 1})) == (
        f"spec.domain.cpu.maxSockets: {2**32 - 1} sockets of 2 cores and 1 threads are {2 * (2**32 - 1)} vCPUs, more than the 512 a domain may have")


def test_guest_memory_wins_over_request():
    vmi = parse_vmi(vmi_doc(memory={"guest": "1G"}, resources={"requests": {"memory": "2Gi"}}))
    assert vmi.domain.guest_memory == 10**9


def test_other_volume_kinds_are_accepted():
    volumes = [
        ROOT_VOLUME,
        {"name": "pvc", "persistentVolumeClaim": {"claimName": "c"}},
        {"name": "dv", "dataVolume": {"name": "d"}},
        {"name": "scratch", "emptyDisk": {"capacity": "2Gi"}},
        {"name": "host", "hostDisk": {"path": "/data/x.img", "type": "DiskOrCreate", "capacity": "1Gi"}},
        {"name": "eph", "ephemeral": {"persistentVolumeClaim": {"claimName": "c"}}},
        {"name": "ci", "cloudInitNoCloud": {"userData": "#cloud-config"}},
        {"name": "cd", "cloudInitConfigDrive": {"secretRef": {"name": "s"}}},
        {"name": "cm", "configMap": {"name": "m"}},
        {"name": "sec", "secret": {"secretName": "s"}},
        {"name": "sa", "serviceAccount": {"serviceAccountName": "default"}},
        {"name": "dapi", "downwardAPI": {"fields": []}},
        {"name": "metrics", "downwardMetrics": {}},
    ]
    vmi = parse_vmi(vmi_doc(disks=[{"name": "metrics", "disk": {"bus": "virtio"}}], volumes=volumes))
    assert [v.kind for v in vmi.volumes] == [
        "containerDisk", "persistentVolumeClaim", "dataVolume", "emptyDisk", "hostDisk", "ephemeral", "cloudInitNoCloud",
        "cloudInitConfigDrive", "configMap", "secret", "serviceAccount", "downwardAPI", "downwardMetrics",
    ]
    assert vmi.volume("scratch").source == EmptyDiskSource(2 * 2**30)
    assert vmi.disk("metrics").bus == "virtio"


def test_downward_metrics_volume_without_a_virtio_disk_is_refused():
    # pkg/defaults/amd64.go gives the defaulted disk sata before the admitter (vmi-create-admitter.go)
    # checks that a downwardMetrics disk is on virtio.
    volumes = [ROOT_VOLUME, {"name": "metrics", "downwardMetrics": {}}]
    assert error(vmi_doc(volumes=volumes)) == ("spec.domain.devices.disks[1].disk.bus: DownwardMetrics volume must be mapped"
                                               " to virtio bus, but spec.domain.devices.disks[1].disk.bus is set to sata")


def test_a_virtual_machine_template_is_accepted():
    doc = vmi_doc()
    vm = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": doc["metadata"],
          "spec": {"running": True, "template": {"metadata": {"labels": {"app": "x"}}, "spec": doc["spec"]}}}
    vmi = parse_vmi(vm)
    assert vmi.domain_name == "ns_vm1" and vmi.labels == {"app": "x"}
    del vm["spec"]["template"]["spec"]["volumes"][0]["containerDisk"]["image"]
    assert error(vm) == "spec.template.spec.volumes[0].containerDisk.image: required"


def test_load_vmi_reads_yaml(tmp_path):
    path = tmp_path / "vmi.yaml"
    path.write_text("apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {name: a}\n"
                    "spec:\n  domain: {memory: {guest: 1Gi}}\n  volumes: [{name: r, containerDisk: {image: x:1}}]\n")
    assert load_vmi(path).domain_name == "default_a"
    path.write_text("kind: [unclosed\n")
    with pytest.raises(SpecError, match=r"vmi.yaml: not valid YAML"):
        load_vmi(path)


# ---------------------------------------------------------------- quantities

@pytest.mark.parametrize(
    "text,value",
    [("1Gi", 2**30), ("512Mi", 512 * 2**20), ("1G", 10**9), ("1k", 1000), ("500m", Fraction(1, 2)), ("1e3", 1000),
     ("1.5Gi", 3 * 2**29), (2, 2), ("0.5", Fraction(1, 2))],
)
def test_quantities(text, value):
    assert parse_quantity(text, "x") == value


@pytest.mark.parametrize("text", ["1GB", "one", "", "1 Gi", ".", True, "1Gi2"])
def test_bad_quantities(text):
    with pytest.raises(SpecError, match=r"^x: quantities must match the regular expression"):
        parse_quantity(text, "x")


# ---------------------------------------------------------------- errors, with KubeVirt's words

def test_container_disk_image_is_required():
    volumes = [ROOT_VOLUME, {"name": "data", "containerDisk": {"path": "/disk/x.img"}}]
    assert error(vmi_doc(volumes=volumes)) == "spec.volumes[1].containerDisk.image: required"


@pytest.mark.parametrize(
    "path,rule",
    [("/", "must not point to root"),
     ("disk/x.img", "must be an absolute path to a file without relative components"),
     ("/disk/../x.img", "must be an absolute path to a file without relative components"),
     ("/disk//x.img", "must be an absolute path to a file without relative components")],
)
def test_container_disk_path_rules(path, rule):
    volumes = [{"name": "root", "containerDisk": {"image": "x:1", "path": path}}]
    assert error(vmi_doc(volumes=volumes)) == f"spec.volumes[0].containerDisk.path: {rule}"


def test_floppy_is_rejected():
    assert error(vmi_doc([{"name": "root", "floppy": {}}])) == (
        "spec.domain.devices.disks[0].floppy: Floppy disks are deprecated and will be removed from the API soon."
    )


def test_lun_on_a_container_disk_is_rejected():
    assert error(vmi_doc([{"name": "root", "lun": {"bus": "scsi"}}])) == (
        "spec.domain.devices.disks[0].lun: can only be mapped to a DataVolume or PersistentVolumeClaim volume."
    )


def test_lun_needs_a_scsi_or_virtio_bus():
    doc = vmi_doc([{"name": "san", "lun": {}}], [{"name": "san", "persistentVolumeClaim": {"claimName": "s"}}])
    assert error(doc) == "spec.domain.devices.disks[0].lun.bus: a lun needs bus scsi or virtio, not sata"


def test_disk_must_reference_a_volume():
    doc = vmi_doc([{"name": "root", "disk": {}}, {"name": "data", "disk": {}}])
    assert error(doc) == "spec.domain.devices.disks[1].name: spec.domain.devices.disks[1].Name 'data' not found."


def test_empty_cdrom_needs_a_feature_gate():
    doc = vmi_doc([{"name": "root", "disk": {}}, {"name": "empty", "cdrom": {}}])
    assert error(doc) == (
        "spec.domain.devices.disks[1].name: DeclarativeHotplugVolumes feature gate not enabled, cannot define an empty CD-ROM disk"
    )


def test_duplicate_disk_and_volume_names():
    assert error(vmi_doc([{"name": "root"}, {"name": "root", "cdrom": {}}])) == (
        "spec.domain.devices.disks[1].name: spec.domain.devices.disks[1] and spec.domain.devices.disks[0] must not have the same Name."
    )
    assert error(vmi_doc(volumes=[ROOT_VOLUME, {"name": "root", "emptyDisk": {"capacity": "1Gi"}}])) == (
        "spec.volumes[1].name: spec.volumes[1] and spec.volumes[0] must not have the same Name."
    )


def test_missing_memory():
    assert error(vmi_doc(resources={})) == (
        "spec.domain.memory: no memory requested, at least one of 'spec.domain.memory.guest',"
        " 'spec.domain.memory.hugepages.pageSize' or 'spec.domain.resources.requests.memory' must be set"
    )


def test_memory_bounds():
    assert error(vmi_doc(resources={"requests": {"memory": "512k"}})) == (
        "spec.domain.resources.requests.memory: '512k': must be greater than or equal to 1M."
    )
    assert error(vmi_doc(resources={"requests": {"memory": "2Gi"}, "limits": {"memory": "1Gi"}})) == (
        "spec.domain.resources.requests.memory: '2Gi' is greater than spec.domain.resources.limits.memory '1Gi'"
    )
    assert error(vmi_doc(memory={"guest": "2Gi"}, resources={"limits": {"memory": "1Gi"}})) == (
        "spec.domain.memory.guest: '2Gi' must be equal to or less than the memory limit spec.domain.resources.limits.memory '1Gi'"
    )
    assert error(vmi_doc(resources={"requests": {"memory": "-1Gi"}})) == (
        "spec.domain.resources.requests.memory: '-1Gi': must be greater than or equal to 0."
    )


def test_block_multi_queue_needs_no_cpu_request():
    # storage/configurator.go: queues = the vCPUs of the topology, at least one; no request needed
    assert parse_vmi(vmi_doc(devices={"blockMultiQueue": True}, cpu={"cores": 2})).domain.devices.block_multi_queue
    with_limit = vmi_doc(devices={"blockMultiQueue": True}, resources={"requests": {"memory": "1Gi"}, "limits": {"cpu": 2}})
    assert parse_vmi(with_limit).domain.devices.block_multi_queue


def test_kernel_args_need_a_kernel_container():
    doc = vmi_doc(firmware={"kernelBoot": {"kernelArgs": "console=ttyS0"}})
    assert error(doc) == "spec.domain.firmware.kernelBoot.kernelArgs: kernel arguments cannot be provided without an external kernel"


def test_kernel_container_needs_an_image_and_a_path():
    doc = vmi_doc(firmware={"kernelBoot": {"container": {"kernelPath": "/boot/vmlinuz"}}})
    assert error(doc) == "spec.domain.firmware.kernelBoot.container.image: spec.domain.firmware.kernelBoot.container must be defined with an image"
    doc = vmi_doc(firmware={"kernelBoot": {"container": {"image": "k:1"}}})
    assert error(doc) == (
        "spec.domain.firmware.kernelBoot.container: must be defined with at least one of the following: kernelPath, initrdPath"
    )


def test_kernel_paths_are_checked_like_container_disk_paths():
    doc = vmi_doc(firmware={"kernelBoot": {"container": {"image": "k:1", "kernelPath": "/boot/vmlinuz", "initrdPath": "/"}}})
    assert error(doc) == "spec.domain.firmware.kernelBoot.container.initrdPath: must not point to root"
    ok = vmi_doc(firmware={"kernelBoot": {"kernelArgs": "quiet", "container": {"image": "k:1", "initrdPath": "/boot/initrd"}}})
    assert parse_vmi(ok).domain.firmware.kernel_boot.container.initrd_path == "/boot/initrd"


@pytest.mark.parametrize(
    "disk,message",
    [
        ({"disk": {"bus": "ide"}}, "spec.domain.devices.disks[0].disk.bus: IDE bus is not supported"),
        ({"disk": {"bus": "pata"}}, "spec.domain.devices.disks[0].disk.bus: spec.domain.devices.disks[0] is set with an"
                                    " unrecognized bus pata, must be one of: [virtio scsi sata usb]; did you mean \"sata\"?"),
        ({"cdrom": {"bus": "virtio"}}, "spec.domain.devices.disks[0].cdrom.bus: Bus type virtio is invalid for CD-ROM device"),
        ({"disk": {"readonly": True}}, "spec.domain.devices.disks[0].disk.bus: sata hard-disks do not support read-only."),
        ({"disk": {}, "dedicatedIOThread": True}, "spec.domain.devices.disks[0]: IOThreads are not supported for disks on a sata bus"),
        ({"disk": {}, "cdrom": {}}, "spec.domain.devices.disks[0]: can only have a single target type defined"),
        ({"disk": {}, "bootOrder": 0}, "spec.domain.devices.disks[0].bootOrder: spec.domain.devices.disks[0] must have a boot order > 0, if supplied"),
        ({"disk": {}, "serial": "a b"}, "spec.domain.devices.disks[0].serial: spec.domain.devices.disks[0] must be made up of"
                                        " the following characters [A-Za-z0-9_.+-], if specified"),
        ({"disk": {}, "cache": "unsafe"}, "spec.domain.devices.disks[0].cache: has invalid value unsafe"),
        ({"disk": {}, "errorPolicy": "panic"}, 'spec.domain.devices.disks[0].errorPolicy: has invalid value "panic"'),
        ({"disk": {}, "io": "uring"}, "spec.domain.devices.disks[0].io: Disk IO mode for spec.domain.devices.disks is not supported. Supported modes are: native, threads."),
        ({"disk": {"bus": "virtio"}, "shareable": True, "cache": "writethrough"},
         "spec.domain.devices.disks[0].cache: a sharable disk requires cache = none got: writethrough"),
        ({"disk": {"bus": "sata", "pciAddress": "0000:81:01.0"}},
         "spec.domain.devices.disks[0].disk.pciAddress: disk spec.domain.devices.disks[0].name - setting a PCI address is only possible with bus type virtio."),
        ({"cdrom": {"tray": "ajar"}}, 'spec.domain.devices.disks[0].cdrom.tray: Unsupported value: "ajar": supported values: "open", "closed"'),
    ],
)
def test_disk_rules(disk, message):
    assert error(vmi_doc([{"name": "root", **disk}])) == message


def test_disk_names_are_dns_labels():
    assert error(vmi_doc([{"name": "Root_Disk"}], [{"name": "Root_Disk", "containerDisk": {"image": "x:1"}}])).startswith(
        "spec.volumes[0].name: a lowercase RFC 1123 label must consist of lower case alphanumeric characters"
    )


def test_duplicate_boot_order():
    doc = vmi_doc([{"name": "root", "bootOrder": 1}, {"name": "b", "bootOrder": 1}],
                  [ROOT_VOLUME, {"name": "b", "emptyDisk": {"capacity": "1Gi"}}])
    assert error(doc) == "spec.domain.devices.disks[1].bootOrder: Boot order for spec.domain.devices.disks[1].bootOrder already set for a different device."


@pytest.mark.parametrize(
    "volume,message",
    [
        ({"containerDisk": {"image": "x:1"}, "emptyDisk": {"capacity": "1Gi"}}, "spec.volumes[0]: must have exactly one source type set"),
        ({"contianerDisk": {"image": "x:1"}}, "spec.volumes[0].contianerDisk: unknown field (did you mean \"containerDisk\"?): not in KubeVirt's schema,"
                                              " so its API server would drop it; --ignore-unsupported runs without it"),
        # pkg/virt-controller/services/template.go sysprepVolumeSource, refusing to render the pod
        ({"sysprep": {}}, "spec.volumes[0].sysprep: Sysprep must have Secret or ConfigMap reference set"),
        ({"dataVolume": {}}, "spec.volumes[0].dataVolume.name: DataVolume 'name' must be set"),
        ({"emptyDisk": {}}, "spec.volumes[0].emptyDisk.capacity: required"),
        ({"persistentVolumeClaim": {}}, "spec.volumes[0].persistentVolumeClaim.claimName: required"),
        ({"hostDisk": {"type": "Disk"}}, "spec.volumes[0].hostDisk.path: is required for hostDisk volume"),
        ({"hostDisk": {"path": "/x", "type": "Dsk"}},
         "spec.volumes[0].hostDisk.type: has invalid value 'Dsk', allowed are 'Disk' or 'DiskOrCreate'"),
        ({"hostDisk": {"path": "/x", "type": "Disk", "capacity": "1Gi"}},
         "spec.volumes[0].hostDisk.capacity: is allowed to pass only with spec.volumes[0].hostDisk.type equal to 'DiskOrCreate'"),
        ({"cloudInitNoCloud": {}}, "spec.volumes[0].cloudInitNoCloud: must have at least one userdatasource or one networkdatasource set."),
        ({"containerDisk": {"image": "x:1", "imagePullPolicy": "Sometimes"}},
         'spec.volumes[0].containerDisk.imagePullPolicy: Unsupported value: "Sometimes": supported values: "Always", "IfNotPresent", "Never"'),
    ],
)
def test_volume_rules(volume, message):
    assert error(vmi_doc(volumes=[{"name": "root", **volume}])) == message


def test_only_one_service_account_volume():
    volumes = [ROOT_VOLUME, {"name": "a", "serviceAccount": {"serviceAccountName": "x"}},
               {"name": "b", "serviceAccount": {"serviceAccountName": "y"}}]
    assert error(vmi_doc(volumes=volumes)) == "spec.volumes: must have max one serviceAccount volume set"


@pytest.mark.parametrize(
    "domain,message",
    [
        ({"ioThreadsPolicy": "lots"}, "spec.domain.ioThreadsPolicy: Invalid IOThreadsPolicy (lots)"),
        ({"machine": {"type": "pc-i440fx-7.2"}},
         "spec.domain.machine.type: is not supported: pc-i440fx-7.2 (allowed values: [q35* pc-q35*])"),
        ({"firmware": {"bootloader": {"efi": {}}}},
         "spec.domain: has EFI SecureBoot enabled. SecureBoot requires SMM, which is currently disabled."),
        ({"firmware": {"bootloader": {"efi": {}, "bios": {}}}},
         "spec.domain.firmware.bootloader: has both EFI and BIOS configured, but they are mutually exclusive."),
        ({"firmware": {"bootloader": {"efi": {"secureBoot": False}}}, "features": {"acpi": {"enabled": False}}},
         "spec.domain.features.acpi: UEFI requires ACPI on this architecture"),
        ({"firmware": {"uuid": "not-a-uuid"}}, "spec.domain.firmware.uuid: must be a UUID"),
    ],
)
def test_domain_rules(domain, message):
    assert error(vmi_doc(**domain)) == message


def test_efi_with_smm_is_fine():
    vmi = parse_vmi(vmi_doc(firmware={"bootloader": {"efi": {}}}, features={"smm": {}}))
    assert (vmi.domain.firmware.bootloader, vmi.domain.firmware.secure_boot, vmi.domain.features.smm) == ("efi", True, True)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda d: d.update(kind="Pod"), "kind: must be VirtualMachineInstance or VirtualMachine, not 'Pod'"),
        (lambda d: d.update(apiVersion="kubevirt.io/v1beta1"), "apiVersion: must be kubevirt.io/v1, not 'kubevirt.io/v1beta1'"),
        (lambda d: d["metadata"].pop("name"), "metadata.name: required"),
        (lambda d: d["spec"].update(volumes={}), "spec.volumes: must be a list"),
        (lambda d: d["spec"].update(architecture="arm64"), "spec.architecture: arm64 is not supported by the launcher (amd64 only)"),
    ],
)
def test_document_rules(change, message):
    doc = copy.deepcopy(vmi_doc())
    change(doc)
    assert error(doc) == message


# ---------------------------------------------------------------- dedicated CPUs (validateCpuPinning)

GUARANTEED = {"requests": {"memory": "64Mi"}, "limits": {"memory": "64Mi"}}


@pytest.mark.parametrize(
    "cpu, resources, message",
    [
        ({"isolateEmulatorThread": True}, GUARANTEED,
         "spec.domain.cpu.isolateEmulatorThread: IsolateEmulatorThread should be only set in combination with DedicatedCPUPlacement"),
        ({"dedicatedCpuPlacement": True, "cores": 2}, {"requests": {"memory": "64Mi"}, "limits": {"memory": "128Mi"}},
         "spec.domain.resources.requests.memory must be equal to spec.domain.resources.limits.memory"),
        ({"dedicatedCpuPlacement": True}, {**GUARANTEED, "requests": {"memory": "64Mi", "cpu": "1500m"}},
         "provided resources CPU requests must be an interger"),
        ({"dedicatedCpuPlacement": True}, GUARANTEED,
         "either spec.domain.resources.requests.cpu or spec.domain.resources.limits.cpu or spec.domain.cpu.cores must be provided"),
        ({"dedicatedCpuPlacement": True}, {"requests": {"memory": "64Mi", "cpu": "1"}, "limits": {"memory": "64Mi", "cpu": "2"}},
         "spec.domain.resources.requests.cpu or spec.domain.resources.limits.cpu must be equal when DedicatedCPUPlacement is true"),
        ({"dedicatedCpuPlacement": True, "cores": 2}, {"requests": {"memory": "64Mi", "cpu": "3"}, "limits": {"memory": "64Mi", "cpu": "3"}},
         "must not be provided at the same time with spec.domain.cpu.cores"),
        ({"dedicatedCpuPlacement": True, "threads": 4}, GUARANTEED,
         "Not more than two threads must be provided at spec.domain.cpu.threads (got 4)"),
    ],
)
def test_dedicated_cpu_rules(cpu, resources, message):
    assert message in error(vmi_doc(cpu=cpu, resources=resources))


def test_dedicated_cpus_from_cores_or_an_integer_request():
    by_cores = parse_vmi(vmi_doc(cpu={"dedicatedCpuPlacement": True, "cores": 2, "isolateEmulatorThread": True}, resources=GUARANTEED))
    assert by_cores.domain.cpu.isolate_emulator_thread and by_cores.domain.vcpus == 2
    by_request = parse_vmi(vmi_doc(cpu={"dedicatedCpuPlacement": True}, resources={"requests": {"memory": "64Mi", "cpu": "2"}}))
    assert by_request.domain.vcpus == 2


def test_v1alpha3_is_still_served():
    # deprecated but served by KubeVirt's API server; CDI's examples still use it
    doc = vmi_doc()
    doc["apiVersion"] = "kubevirt.io/v1alpha3"
    assert parse_vmi(doc).name == doc["metadata"]["name"]


def test_dedicated_cpus_with_only_guest_memory():
    # examples/vmi-fedora-isolated.yaml: validateMemoryIsProvided accepts memory.guest alone
    doc = vmi_doc(cpu={"cores": 2, "dedicatedCpuPlacement": True, "isolateEmulatorThread": True})
    doc["spec"]["domain"]["memory"] = {"guest": "1Gi"}
    doc["spec"]["domain"].pop("resources", None)
    vmi = parse_vmi(doc)
    assert vmi.domain.cpu.dedicated_cpu_placement and vmi.domain.guest_memory == 1 << 30
    doc["spec"]["domain"]["memory"] = {}
    doc["spec"]["domain"]["resources"] = {"requests": {"cpu": 2}}
    assert error(doc).startswith("spec.domain.resources.limits.memory: spec.domain.resources.requests.memory,"
                                 " spec.domain.resources.limits.memory, spec.domain.memory.hugepages or"
                                 " spec.domain.memory.guest should be provided")


# pkg/storage/admitters/disks.go validateBlockSize / validateCustomBlockSize, in their order
@pytest.mark.parametrize("block_size,bus,message", [
    ({"custom": {"logical": 512, "physical": 512}, "matchVolume": {}}, "virtio",
     "spec.domain.devices.disks[0].blockSize: Block size matching can't be enabled together with a custom value"),
    ({"custom": {"logical": 4096, "physical": 512}}, "virtio",
     "spec.domain.devices.disks[0].blockSize.custom.logical: Logical size 4096 must be the same or less than the physical size of 512"),
    ({"custom": {"logical": 4096, "physical": 4096}}, None,
     "spec.domain.devices.disks[0].blockSize.custom.logical: Logical size 4096 must be 512 for SATA devices"),
    ({"custom": {"logical": 4096, "physical": 4096, "discardGranularity": 6144}}, "virtio",
     "spec.domain.devices.disks[0].blockSize.custom.discardGranularity: Discard granularity 6144 must be multiples of logical size 4096"),
    ({"custom": {"logical": 256, "physical": 4096}}, "virtio",
     "spec.domain.devices.disks[0].blockSize.custom.logical: Provided size of 256 is less than the supported minimum size of 512"),
    ({"custom": {"logical": 512, "physical": 4194304}}, "virtio",
     "spec.domain.devices.disks[0].blockSize.custom.physical: Provided size of 4194304 is greater than the supported maximum size of 2097152"),
    ({"custom": {"logical": 512, "physical": 3000}}, "virtio",
     "spec.domain.devices.disks[0].blockSize.custom.physical: Provided size of 3000 is not a power of 2"),
])
def test_block_size_rules(block_size, bus, message):
    disk = {"name": "root", "blockSize": block_size, **({"disk": {"bus": bus}} if bus else {})}
    assert error(vmi_doc(disks=[disk])) == message


def test_block_size_accepted():
    disks = [{"name": "root", "disk": {"bus": "virtio"}, "blockSize": {"custom": {"logical": 4096, "physical": 4096}}},
             {"name": "data", "blockSize": {"matchVolume": {"enabled": False}, "custom": {"logical": 512, "physical": 4096}}}]
    vmi = parse_vmi(vmi_doc(disks=disks, volumes=[{"name": "root", "containerDisk": {"image": "x/y:1"}},
                                                 {"name": "data", "emptyDisk": {"capacity": "1Gi"}}]))
    root, data = vmi.domain.devices.disks
    assert root.block_size == (4096, 4096, None) and data.block_size == (512, 4096, None)
    assert not root.match_volume_block_size


def test_an_empty_error_policy_is_refused():
    # storage/admitters/disks.go validateErrorPolicy: any value that is set is checked
    assert error(vmi_doc(disks=[{"name": "root", "errorPolicy": ""}])) == 'spec.domain.devices.disks[0].errorPolicy: has invalid value ""'


def test_host_disk_of_type_disk_with_zero_capacity_passes():
    # vmi-create-admitter.go refuses a capacity with type Disk only when it is not zero
    volumes = [{"name": "root", "hostDisk": {"path": "/d/x.img", "type": "Disk", "capacity": "0"}}]
    assert parse_vmi(vmi_doc(volumes=volumes)).volume("root").source.type == "Disk"


def test_termination_grace_period_is_the_vmis_unless_the_launcher_is_told_otherwise():
    # pkg/virt-controller/services/template.go gracePeriodInSeconds: the VMI's, else 30
    # (DefaultGracePeriodSeconds in staging/src/kubevirt.io/api/core/v1/types.go).
    from launcher.runtime.vms import RunOptions, grace_period_of
    doc = vmi_doc()
    assert grace_period_of(parse_vmi(doc), RunOptions()) == 30
    doc["spec"]["terminationGracePeriodSeconds"] = 0
    assert grace_period_of(parse_vmi(doc), RunOptions()) == 0
    doc["spec"]["terminationGracePeriodSeconds"] = 120
    assert grace_period_of(parse_vmi(doc), RunOptions()) == 120
    assert grace_period_of(parse_vmi(doc), RunOptions(grace_period=5)) == 5
    doc["spec"]["terminationGracePeriodSeconds"] = -1
    assert error(doc) == "spec.terminationGracePeriodSeconds: must be a non-negative integer"

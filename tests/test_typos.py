"""Errors that fix typos (issue 30 item 7): did-you-mean for fields, buses and transports, a missing
repository told from a missing tag, a VirtualMachine's misplaced VMI spec, the VMI field of a pulled image."""

from __future__ import annotations

import pytest
import yaml

from diskkit.errors import DiskkitError
from diskkit.oci.reference import parse_ref
from launcher.spec.fields import SpecError
from launcher.spec.vmi import parse_vmi
from tests.conftest import run_launcher
from tests.test_coverage import vmi
from tests.test_registry import INSECURE, repo


def _refusal(doc) -> str:
    with pytest.raises(SpecError) as err:
        parse_vmi(doc)
    return str(err.value)


def test_an_unknown_field_names_the_closest_known_one():
    doc = vmi()
    doc["spec"]["domain"]["devices"]["disks"] = [{"name": "root", "bootorder": 1, "disk": {"bus": "virtio"}}]
    assert _refusal(doc).startswith('spec.domain.devices.disks[0].bootorder: unknown field (did you mean "bootOrder"?): not in KubeVirt\'s schema')
    doc["spec"]["domain"]["devices"]["disks"] = [{"name": "root", "zzz": 1, "disk": {"bus": "virtio"}}]
    assert _refusal(doc).startswith("spec.domain.devices.disks[0].zzz: unknown field: not in KubeVirt's schema")  # nothing close: no guess


def test_an_unknown_bus_names_the_closest_one_after_kubevirts_words():
    doc = vmi()
    doc["spec"]["domain"]["devices"]["disks"] = [{"name": "root", "disk": {"bus": "virtoi"}}]
    # KubeVirt pkg/virt-api/webhooks/validating-webhook/admitters/vmi-create-admitter.go: "unrecognized bus"
    assert _refusal(doc) == ('spec.domain.devices.disks[0].disk.bus: spec.domain.devices.disks[0] is set with an unrecognized bus virtoi, '
                             'must be one of: [virtio scsi sata usb]; did you mean "virtio"?')


def test_a_virtual_machine_with_its_vmi_spec_at_spec_domain_is_told_where_it_belongs():
    doc = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "x"},
           "spec": {"running": True, "domain": {"devices": {}}}}
    assert _refusal(doc) == ("spec.domain: not a VirtualMachine field: a VirtualMachine's VirtualMachineInstance spec belongs "
                             "under spec.template.spec")


def test_an_unknown_transport_is_named_in_containers_images_words():
    # containers/image transports/alltransports/alltransports.go: Invalid image name %q, unknown transport %q
    with pytest.raises(DiskkitError) as err:
        parse_ref("dokcer://quay.io/x/y:1")
    assert err.value.line() == 'Invalid image name "dokcer://quay.io/x/y:1", unknown transport "dokcer"; did you mean "docker://"?'
    with pytest.raises(DiskkitError) as err:
        parse_ref("ocl:./layout/x")
    assert err.value.line() == 'Invalid image name "ocl:./layout/x", unknown transport "ocl"; did you mean "oci:"?'
    # registry references without a transport stay what they were
    assert parse_ref("localhost:5000/disks/x:1").transport == "docker"
    assert parse_ref("fedora:latest").transport == "docker"


def test_a_missing_repository_and_a_missing_tag_are_told_apart(diskkit, registry, qcow2, tmp_path):
    target = repo(registry)
    assert diskkit("build", qcow2, "-t", f"{target}:v1", INSECURE).code == 0
    tag = diskkit("inspect", INSECURE, f"{target}:v2")
    path = target.split("/", 1)[1]
    assert tag.code == 5  # Exit.NOT_FOUND
    assert tag.err.strip().endswith(f"manifest v2 not found: repository {path} exists, tag v2 does not (MANIFEST_UNKNOWN)"), tag.err
    name = diskkit("inspect", INSECURE, f"{target}-typo:v1")
    assert name.code == 5
    assert name.err.strip().endswith(f"manifest v1 not found: repository {path}-typo does not exist (NAME_UNKNOWN); check the repository's name"), name.err


def test_a_pull_error_names_the_vmi_field_of_the_image(registry, tmp_path):
    doc = vmi()
    doc["spec"]["domain"]["devices"]["disks"] = [{"name": "root", "disk": {"bus": "virtio"}}]
    doc["spec"]["volumes"] = [{"name": "root", "containerDisk": {"image": f"{repo(registry)}:nope"}}]
    path = tmp_path / "vmi.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = run_launcher("domain", "--cache-dir", tmp_path / "cache", "--no-lazy", INSECURE, path)
    assert result.code == 5  # Exit.NOT_FOUND
    assert result.err.startswith("launcher: spec.volumes[0].containerDisk.image: docker://"), result.err
    assert "does not exist (NAME_UNKNOWN)" in result.err
    doc["spec"]["volumes"][0]["containerDisk"]["image"] = "dokcer://quay.io/x/y:1"
    path.write_text(yaml.safe_dump(doc))
    result = run_launcher("domain", "--cache-dir", tmp_path / "cache", path)
    assert result.err.strip() == ('launcher: spec.volumes[0].containerDisk.image: Invalid image name "dokcer://quay.io/x/y:1", '
                                  'unknown transport "dokcer"; did you mean "docker://"?')

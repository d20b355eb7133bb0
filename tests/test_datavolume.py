"""DataVolume specs as CDI's webhook reads them, dataVolumeTemplates of VMs and VMIs, and the phase rules (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.datavolumes.control import manifests
from launcher.spec import datavolume as dvm
from launcher.spec.datavolume import (
    DataVolume,
    Source,
    Status,
    can_upload,
    parse_data_volume,
    phase,
)
from launcher.spec.fields import SpecError
from launcher.spec.k8s import Objects
from launcher.spec.vmi import load_vmi, parse_vmi
from launcher.volumes.storage import Storage

MI = 1 << 20


def manifest(source: dict, target: dict | None = None, name: str = "disk", namespace: str | None = None, **spec) -> dict:
    metadata = {"name": name, **({"namespace": namespace} if namespace else {})}
    body = {"source": source, **spec}
    if target is not None:
        body.update(target)
    else:
        body["storage"] = {"resources": {"requests": {"storage": "1Gi"}}}
    return {"apiVersion": dvm.API_VERSION, "kind": "DataVolume", "metadata": metadata, "spec": body}


def refused(doc, **kw) -> str:
    with pytest.raises(SpecError) as err:
        parse_data_volume(doc, "DataVolume", **kw)
    return str(err.value)


def test_every_supported_source_parses():
    http = parse_data_volume(manifest({"http": {"url": "https://example.org/f.qcow2", "secretRef": "creds", "certConfigMap": "ca"}},
                                      namespace="vms"), "DataVolume")
    assert http == DataVolume("disk", "vms", Source("http", "https://example.org/f.qcow2", "creds", "ca"), 1 << 30, None, None, "DataVolume")
    registry = parse_data_volume(manifest({"registry": {"url": "docker://quay.io/containerdisks/fedora:40", "pullMethod": "pod"}}), "DataVolume")
    assert registry.source == Source("registry", "docker://quay.io/containerdisks/fedora:40")
    clone = parse_data_volume(manifest({"pvc": {"name": "golden"}}, {"storage": {}}, namespace="vms"), "DataVolume")
    assert clone.source == Source("pvc", claim="golden", claim_namespace="vms") and clone.size is None
    blank = parse_data_volume(manifest({"blank": {}}, {"pvc": {"accessModes": ["ReadWriteOnce"], "storageClassName": "local",
                                                               "resources": {"requests": {"storage": "512Mi"}}}}), "DataVolume")
    assert (blank.source.kind, blank.size, blank.storage_class) == ("blank", 512 * MI, "local")
    upload = parse_data_volume(manifest({"upload": {}}), "DataVolume")
    assert (upload.scheduled_phase, upload.running_phase) == (dvm.UPLOAD_SCHEDULED, dvm.UPLOAD_READY)


@pytest.mark.parametrize("source, target, message", [
    ({}, None, "DataVolume.spec.source: Missing Data volume source"),
    ({"http": {"url": "http://a/b"}, "blank": {}}, None, "DataVolume.spec.source: Multiple Data volume sources"),
    ({"s3": {"url": "s3://b/k"}}, None, "DataVolume.spec.source.s3: this DataVolume source is not supported by the launcher"),
    ({"http": {}}, None, "DataVolume.spec.source.http.url: required"),
    ({"http": {"url": "ftp://host/f.img"}}, None, "ftp://host/f.img is not an http:// or https:// URL"),
    ({"registry": {"url": "https://quay.io/x"}}, None, "illegal registry source URL scheme https://quay.io/x"),
    ({"registry": {"url": "docker://q/x", "pullMethod": "node"}}, None, "only pullMethod pod is supported by the launcher"),
    ({"registry": {"url": "docker://q/x", "pullMethod": "fast"}}, None, 'importMethod fast is neither pod, node or ""'),
    ({"registry": {}}, None, "source registry should have either URL or ImageStream"),
    ({"blank": {}}, {}, "DataVolume.spec: Missing Data volume PVC"),
    ({"blank": {}}, {"pvc": {}, "storage": {}}, "Duplicate storage definition, both target storage and target pvc defined"),
    ({"blank": {}}, {"pvc": {"accessModes": ["ReadWriteOnce"]}}, "DataVolume.spec.pvc.resources.requests.storage: PVC size is missing"),
    ({"blank": {}}, {"pvc": {"resources": {"requests": {"storage": "1Gi"}}}}, "at least 1 access mode is required"),
    ({"blank": {}}, {"storage": {"resources": {"requests": {"storage": "0"}}}}, "Storage size can't be equal or less than zero"),
    ({"blank": {}}, {"storage": {"accessModes": ["ReadWriteSome"]}}, 'Unsupported value: "ReadWriteSome"'),
])
def test_cdi_validation_messages(source, target, message):
    assert message in refused(manifest(source, target))


def test_manifest_identity_and_unsupported_fields():
    assert "must be cdi.kubevirt.io/v1beta1" in refused({**manifest({"blank": {}}), "apiVersion": "cdi.kubevirt.io/v1alpha1"})
    assert "sourceRef" in refused({**manifest({"blank": {}}), "spec": {"sourceRef": {"kind": "DataSource", "name": "f"}, "storage": {}}})
    assert parse_data_volume(manifest({"http": {"url": "http://a/b.tar"}}, contentType="archive"), "dv").content_type == "archive"


# CDI pkg/apiserver/webhooks/util.go validateContentType, validateBlankSource, validateRegistrySource
@pytest.mark.parametrize("source,content_type,message", [
    ({"http": {"url": "http://a/b"}}, "tarball", "DataVolume.spec.contentType: ContentType not one of: kubevirt, archive"),
    ({"blank": {}}, "archive", "DataVolume.spec.contentType: SourceType cannot be blank and the contentType be archive"),
    ({"registry": {"url": "docker://r/i:1"}}, "archive", "DataVolume.spec.contentType: ContentType must be kubevirt when Source is Registry"),
])
def test_content_type_rules(source, content_type, message):
    assert message in refused(manifest(source, contentType=content_type))
    assert "RFC 1123" in refused(manifest({"blank": {}}, name="Root_Disk"))


def _vm(templates, volumes, kind="VirtualMachine"):
    spec = {"domain": {"resources": {"requests": {"memory": "64Mi"}}}, "volumes": volumes}
    if kind == "VirtualMachine":
        return {"apiVersion": "kubevirt.io/v1", "kind": kind, "metadata": {"name": "vm", "namespace": "vms"},
                "spec": {"dataVolumeTemplates": templates, "template": {"spec": spec}}}
    return {"apiVersion": "kubevirt.io/v1", "kind": kind, "metadata": {"name": "vm", "namespace": "vms"},
            "spec": {**spec, "dataVolumeTemplates": templates}}


@pytest.mark.parametrize("kind", ["VirtualMachine", "VirtualMachineInstance"])
def test_data_volume_templates_of_a_vm_and_of_a_vmi(kind):
    template = {"metadata": {"name": "root"}, "spec": {"source": {"http": {"url": "http://h/f.qcow2"}},
                                                        "storage": {"resources": {"requests": {"storage": "2Gi"}}}}}
    vmi = parse_vmi(_vm([template], [{"name": "root", "dataVolume": {"name": "root"}}], kind))
    (dv,) = vmi.data_volume_templates
    assert (dv.name, dv.namespace, dv.size, dv.origin) == ("root", "vms", 2 << 30, "spec.dataVolumeTemplates[0]")
    with pytest.raises(SpecError) as err:
        parse_vmi(_vm([template, template], [], kind))
    assert "spec.dataVolumeTemplates[1].metadata.name: root is already the name of spec.dataVolumeTemplates[0]" in str(err.value)
    with pytest.raises(SpecError) as err:
        parse_vmi(_vm([{"metadata": {"name": "x"}, "spec": {"storage": {}}}], [], kind))
    assert str(err.value) == "spec.dataVolumeTemplates[0].spec.source: Data volume should have either Source, SourceRef, or be externally populated"


def test_phases():
    http = parse_data_volume(manifest({"http": {"url": "http://a/b"}}), "DataVolume")
    upload = parse_data_volume(manifest({"upload": {}}), "DataVolume")
    assert phase(http, Status(), wait_for_first_consumer=False) == dvm.PENDING
    assert phase(http, Status(), wait_for_first_consumer=True) == dvm.WAIT_FOR_FIRST_CONSUMER
    assert phase(http, Status(consumer="vms_vm"), wait_for_first_consumer=True) == dvm.PENDING
    assert phase(http, Status(dvm.IMPORT_IN_PROGRESS, "12.00%"), False, worker_alive=True) == dvm.IMPORT_IN_PROGRESS
    assert phase(http, Status(dvm.IMPORT_IN_PROGRESS, "12.00%"), False, worker_alive=False) == dvm.PENDING  # its importer died
    assert phase(http, Status(dvm.SUCCEEDED), wait_for_first_consumer=True) == dvm.SUCCEEDED
    assert phase(upload, Status(), False) == dvm.UPLOAD_SCHEDULED
    assert phase(upload, Status(dvm.UPLOAD_READY), True) == dvm.WAIT_FOR_FIRST_CONSUMER
    assert phase(upload, Status(dvm.UPLOAD_READY, consumer="vms_vm"), True) == dvm.UPLOAD_READY
    assert can_upload(dvm.WAIT_FOR_FIRST_CONSUMER) == "cannot upload to DataVolume in state WaitForFirstConsumer"
    assert can_upload(dvm.UPLOAD_READY) is None
    assert "not ready" in can_upload(dvm.UPLOAD_SCHEDULED)


def test_the_examples_parse():
    examples = Path(__file__).resolve().parent.parent / "examples" / "datavolumes"
    vm = load_vmi(examples / "vm.yaml")
    assert [(dv.name, dv.source.kind) for dv in vm.data_volume_templates] == [("fedora-root", "http")]
    found = manifests(Storage(objects=Objects.load(examples)))
    assert {name: dv.source.kind for (_, name), dv in found.items()} == {"fedora-data": "upload", "golden": "registry"}

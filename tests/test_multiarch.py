"""Multi-architecture images as kubevirt/containerdisks ("medius") makes them: per-platform labels,
env and instance type hints, annotations at each level (docker buildx's --annotation syntax), an
index assembled from images pushed in separate jobs, and every platform verified.

skopeo reads what was written (a peer, not our own reader)."""

from __future__ import annotations

import json
import uuid

import pytest

from diskkit.errors import DiskkitError
from diskkit.oci import hints
from diskkit.oci.image import Platform
from diskkit.ops.buildmeta import parse
from tests.conftest import make_qcow2, run

AMD, ARM = Platform("linux", "amd64"), Platform("linux", "arm64")
FAST = ["--tls-verify=false", "--retry-delay", "0.05"]


def skopeo(*args: str) -> dict:
    return json.loads(run("skopeo", *args).stdout)


@pytest.fixture
def disks(tmp_path):
    return make_qcow2(tmp_path / "x86.qcow2", size="16M", pattern=0x11), make_qcow2(tmp_path / "arm.qcow2", size="16M", pattern=0x22)


def test_cdi_reads_the_env_as_these_labels():
    # containerized-data-importer pkg/importer/util_test.go: the env CDI turns into a claim's labels.
    assert hints.env_label("INSTANCETYPE_KUBEVIRT_IO_DEFAULT_INSTANCETYPE") == "instancetype.kubevirt.io/default-instancetype"
    assert hints.env_label("INSTANCETYPE_KUBEVIRT_IO_DEFAULT_PREFERENCE_KIND") == "instancetype.kubevirt.io/default-preference-kind"
    assert hints.env_label("KUBEVIRT_IO_FOO_BAR") == "kubevirt.io/foo-bar"
    assert hints.env_label("PATH") is None
    for label in (hints.INSTANCETYPE_LABEL, hints.INSTANCETYPE_KIND_LABEL, hints.PREFERENCE_LABEL, hints.PREFERENCE_KIND_LABEL):
        assert hints.env_label(hints.env_name(label)) == label
    config = {"config": {"Env": ["INSTANCETYPE_KUBEVIRT_IO_DEFAULT_PREFERENCE=fedora", "PATH=/bin"],
                         "Labels": {hints.PREFERENCE_LABEL: "old", hints.INSTANCETYPE_LABEL: "u1.small", "shasum": "x"}}}
    assert hints.from_config(config) == {hints.PREFERENCE_LABEL: "fedora", hints.INSTANCETYPE_LABEL: "u1.small"}


def test_platform_prefixes_and_annotation_levels_parse():
    meta = parse([AMD, ARM], True, labels=["a=1", "linux/arm64:a=2", "source=https://x:1"], env=["PATH=/a:/b", "linux/amd64:X=1"],
                 annotations=["k=v", "index,manifest:v=40", "manifest[linux/arm64]:arm=yes", "manifest-descriptor:d=1"],
                 preference=["fedora", "linux/arm64:fedora.arm64:virtualmachineclusterpreferences"])
    assert meta.labels_for(AMD) == {"a": "1", "source": "https://x:1", hints.PREFERENCE_LABEL: "fedora"}
    assert meta.labels_for(ARM) == {"a": "2", "source": "https://x:1", hints.PREFERENCE_LABEL: "fedora.arm64",
                                    hints.PREFERENCE_KIND_LABEL: "VirtualMachineClusterPreference"}
    assert meta.env_for(AMD) == ["PATH=/a:/b", "INSTANCETYPE_KUBEVIRT_IO_DEFAULT_PREFERENCE=fedora", "X=1"]
    assert "INSTANCETYPE_KUBEVIRT_IO_DEFAULT_PREFERENCE=fedora.arm64" in meta.env_for(ARM)
    assert meta.index_annotations == {"v": "40"}
    assert meta.annotations_for(AMD) == {"k": "v", "v": "40"} and meta.annotations_for(ARM) == {"k": "v", "v": "40", "arm": "yes"}
    assert meta.descriptor_for(ARM) == {"d": "1"}


@pytest.mark.parametrize("flags, words", [
    ({"labels": ["linux/s390x:a=1"]}, "linux/s390x is not a platform this build makes (linux/amd64, linux/arm64)"),
    ({"annotations": ["bogus:k=v"]}, "unknown annotation type 'bogus'"),
    ({"annotations": ["index[linux/amd64]:k=v"]}, "an index annotation has no platform"),
    ({"annotations": ["manifest"]}, "must be [TYPE[,TYPE][[OS/ARCH]]:]KEY=VALUE"),
    ({"env": ["linux/amd64:NOVALUE"]}, "must be KEY=VALUE"),
    ({"preference": ["fedora:VirtualMachineInstancetype"]}, "KIND must be VirtualMachinePreference or VirtualMachineClusterPreference"),
    ({"instancetype": ["u1.small:"]}, "must be NAME or NAME:KIND"),
])
def test_metadata_refusals(flags, words):
    with pytest.raises(DiskkitError) as err:
        parse([AMD, ARM], True, **flags)
    assert words in err.value.line()


def test_index_annotation_needs_an_index():
    with pytest.raises(DiskkitError) as err:
        parse([AMD], False, annotations=["index:k=v"])
    assert "this build writes no index" in err.value.line()


def test_per_platform_build_as_skopeo_reads_it(diskkit, disks, tmp_path):
    layout = tmp_path / "layout"
    result = diskkit("build", "--platform", f"linux/amd64={disks[0]}", "--platform", f"linux/arm64={disks[1]}", "-t", f"oci:{layout}:40",
                     "--default-instancetype", "u1.medium", "--default-preference", "linux/amd64:fedora",
                     "--default-preference", "linux/arm64:fedora.arm64", "--label", "linux/arm64:shasum=arm", "--env", "linux/amd64:X=1",
                     "--annotation", "index,manifest:org.opencontainers.image.version=40",
                     "--annotation", "manifest-descriptor[linux/arm64]:note=arm")
    assert result.code == 0, result.err
    index = skopeo("inspect", "--raw", f"oci:{layout}:40")
    assert index["annotations"]["org.opencontainers.image.version"] == "40"
    by_arch = {m["platform"]["architecture"]: m for m in index["manifests"]}
    assert by_arch["arm64"]["annotations"] == {"note": "arm"} and "annotations" not in by_arch["amd64"]
    amd = skopeo("inspect", "--config", "--override-arch", "amd64", f"oci:{layout}:40")["config"]
    arm = skopeo("inspect", "--config", "--override-arch", "arm64", f"oci:{layout}:40")["config"]
    assert amd["Labels"] == {hints.INSTANCETYPE_LABEL: "u1.medium", hints.PREFERENCE_LABEL: "fedora"}
    assert arm["Labels"] == {hints.INSTANCETYPE_LABEL: "u1.medium", hints.PREFERENCE_LABEL: "fedora.arm64", "shasum": "arm"}
    # The ENV pair kubevirt/containerdisks writes (pkg/common/common.go) and CDI reads.
    assert sorted(amd["Env"]) == ["INSTANCETYPE_KUBEVIRT_IO_DEFAULT_INSTANCETYPE=u1.medium", "INSTANCETYPE_KUBEVIRT_IO_DEFAULT_PREFERENCE=fedora", "X=1"]
    assert arm["Env"] == ["INSTANCETYPE_KUBEVIRT_IO_DEFAULT_INSTANCETYPE=u1.medium", "INSTANCETYPE_KUBEVIRT_IO_DEFAULT_PREFERENCE=fedora.arm64"]
    manifest = skopeo("inspect", "--raw", "--override-arch", "arm64", f"oci:{layout}:40")
    assert manifest["annotations"]["org.opencontainers.image.version"] == "40"


def test_refusals_on_the_command_line(diskkit, disks, tmp_path):
    layout = tmp_path / "layout"
    single = diskkit("build", disks[0], "-t", f"oci:{layout}:x", "--annotation", "index:k=v")
    assert single.code != 0 and "--annotation index:k=v: this build writes no index" in single.err
    foreign = diskkit("build", disks[0], "-t", f"oci:{layout}:x", "--label", "linux/arm64:k=v")
    assert foreign.code != 0 and "linux/arm64 is not a platform this build makes (linux/amd64)" in foreign.err
    assert not layout.exists()


# ---------------------------------------------------------------- the launcher: hints and platforms

V1B1 = "instancetype.kubevirt.io/v1beta1"
TYPES = [
    {"apiVersion": V1B1, "kind": "VirtualMachineClusterInstancetype", "metadata": {"name": "tiny.2c"},
     "spec": {"cpu": {"guest": 2}, "memory": {"guest": "320Mi"}}},
    {"apiVersion": V1B1, "kind": "VirtualMachineClusterPreference", "metadata": {"name": "virtio-amd"},
     "spec": {"devices": {"preferredDiskBus": "virtio"}}},
    {"apiVersion": V1B1, "kind": "VirtualMachinePreference", "metadata": {"name": "sata-arm", "namespace": "default"},
     "spec": {"devices": {"preferredDiskBus": "sata"}}},
]


def _vm(tmp_path, image: str, policy: str | None = None, memory: str | None = None) -> str:
    infer = {"inferFromVolume": "root", **({"inferFromVolumeFailurePolicy": policy} if policy else {})}
    doc = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "inferred"},
           "spec": {"instancetype": infer, "preference": dict(infer),
                    "template": {"spec": {"domain": {"devices": {"disks": [{"name": "root"}]},
                                                     **({"resources": {"requests": {"memory": memory}}} if memory else {})},
                                          "volumes": [{"name": "root", "containerDisk": {"image": image}}]}}}}
    path = tmp_path / f"vm-{uuid.uuid4().hex[:6]}.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.fixture
def manifests(tmp_path):
    import yaml

    where = tmp_path / "manifests"
    where.mkdir()
    (where / "types.yaml").write_text(yaml.safe_dump_all(TYPES))
    return where


@pytest.fixture
def two_arch(diskkit, disks, tmp_path):
    """An index whose amd64 image names tiny.2c and virtio-amd, its arm64 one sata-arm (namespaced)."""
    ref = f"oci:{tmp_path / 'two'}:40"
    result = diskkit("build", "--platform", f"linux/amd64={disks[0]}", "--platform", f"linux/arm64={disks[1]}", "-t", ref,
                     "--default-instancetype", "tiny.2c", "--default-preference", "linux/amd64:virtio-amd",
                     "--default-preference", "linux/arm64:sata-arm:VirtualMachinePreference")
    assert result.code == 0, result.err
    return ref


def _domain(tmp_path, *args):
    from tests.conftest import run_launcher

    return run_launcher("domain", "--accel", "qemu", "--cache-dir", tmp_path / "cache", *args)


def test_instancetype_inferred_from_a_containerdisk_image(two_arch, manifests, tmp_path):
    import xml.etree.ElementTree as ET

    result = _domain(tmp_path, "--manifests", manifests, _vm(tmp_path, two_arch))
    assert result.code == 0, result.err
    xml = ET.fromstring(result.out)
    # tiny.2c from the amd64 image's hints, and its preference's virtio bus.
    assert (xml.findtext("vcpu"), xml.findtext("memory")) == ("2", str(320 << 20))
    assert [t.get("bus") for t in xml.findall("devices/disk/target")] == ["virtio"]


def test_inference_failures_from_an_image(diskkit, disks, manifests, tmp_path):
    plain = f"oci:{tmp_path / 'plain'}:1"
    assert diskkit("build", disks[0], "-t", plain).code == 0
    refused = _domain(tmp_path, "--manifests", manifests, _vm(tmp_path, plain))
    assert refused.code != 0
    assert ("spec.instancetype.inferFromVolume: unable to find required instancetype.kubevirt.io/default-instancetype label"
            f" on the volume (containerDisk image {plain})") in refused.err
    # Under Ignore the matchers go (infer/handler.go) and the VM runs with its own sizing.
    ignored = _domain(tmp_path, "--manifests", manifests, _vm(tmp_path, plain, "Ignore", "96Mi"))
    assert ignored.code == 0, ignored.err


def test_a_foreign_architecture_is_refused(diskkit, disks, two_arch, manifests, tmp_path):
    arm = f"oci:{tmp_path / 'arm'}:1"
    assert diskkit("build", disks[1], "--platform", "linux/arm64", "-t", arm).code == 0
    vmi = tmp_path / "vmi.json"
    vmi.write_text(json.dumps({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "arm"},
                               "spec": {"domain": {"devices": {}, "resources": {"requests": {"memory": "64Mi"}}},
                                        "volumes": [{"name": "root", "containerDisk": {"image": arm}}]}}))
    # A single-platform arm64 image: an x86_64 q35 domain cannot run it (issue 32 trap 7).
    refused = _domain(tmp_path, vmi)
    assert refused.code != 0
    line = refused.err.strip().splitlines()[-1]
    assert f"{arm}: image platform linux/arm64 is not the guest's linux/amd64: this host runs linux/amd64 guests" in line
    assert "qemu-system-aarch64" in line
    # --platform naming another architecture: refused before anything is read.
    early = _domain(tmp_path, "--platform", "linux/arm64", "--manifests", manifests, _vm(tmp_path, two_arch))
    assert early.code != 0
    assert "--platform linux/arm64: cannot boot an image for linux/arm64: this host runs linux/amd64 guests" in early.err
    # --platform linux/amd64 picks the amd64 image of the index.
    picked = _domain(tmp_path, "--platform", "linux/amd64", "--manifests", manifests, _vm(tmp_path, two_arch))
    assert picked.code == 0, picked.err

"""Multi-architecture images as kubevirt/containerdisks ("medius") makes them: per-platform labels,
env and instance type hints, annotations at each level (docker buildx's --annotation syntax), an
index assembled from images pushed in separate jobs, and every platform verified.

skopeo reads what was written (a peer, not our own reader)."""

from __future__ import annotations

import hashlib
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
    # Refused on its config: no layer was read into the cache.
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and "disks" in p.parts]
    # --platform naming another architecture: refused before anything is read.
    early = _domain(tmp_path, "--platform", "linux/arm64", "--manifests", manifests, _vm(tmp_path, two_arch))
    assert early.code != 0
    assert "--platform linux/arm64: cannot boot an image for linux/arm64: this host runs linux/amd64 guests" in early.err
    # --platform linux/amd64 picks the amd64 image of the index.
    picked = _domain(tmp_path, "--platform", "linux/amd64", "--manifests", manifests, _vm(tmp_path, two_arch))
    assert picked.code == 0, picked.err
    # The CI smoke test refuses it the same way, before the disk is downloaded.
    from tests.conftest import run_launcher

    smoke = run_launcher("test", "--cache-dir", tmp_path / "smoke", "--timeout", "60", arm)
    assert smoke.code == 3  # Exit.GUEST_FAILED: launcher test's "did not boot"
    assert f"{arm}: image platform linux/arm64 is not the guest's linux/amd64" in smoke.err + smoke.out
    assert not [p for p in (tmp_path / "smoke").rglob("*") if p.is_file() and "disks" in p.parts]
    early = run_launcher("test", "--cache-dir", tmp_path / "smoke", "--platform", "linux/arm64", arm)
    assert early.code != 0 and "--platform linux/arm64: cannot boot an image for linux/arm64" in early.err + early.out


# ---------------------------------------------------------------- an index from separate jobs

def _job(diskkit, disk, plat: str, target: str) -> str:
    """One CI job: one architecture's image, pushed on its own."""
    result = diskkit("build", disk, "--platform", plat, "-t", target, *FAST, "--json")
    assert result.code == 0, result.err
    return json.loads(result.out)["digest"]


def test_index_from_images_pushed_in_separate_jobs(diskkit, registry, disks, tmp_path):
    base = f"{registry.host}/multi-{uuid.uuid4().hex[:6]}"
    amd = _job(diskkit, disks[0], "linux/amd64", f"{base}/x86:40")
    arm = _job(diskkit, disks[1], "linux/arm64", f"{base}/arm:40")
    created = diskkit("index", "create", *FAST, "--json", f"{base}/fedora:40", f"{base}/x86:40", f"{base}/arm:40",
                      "--annotation", "index:org.opencontainers.image.version=40")
    assert created.code == 0, created.err
    out = json.loads(created.out)
    # Another repository of the same registry: the blobs are mounted, not sent again.
    assert set(out["blobs"].values()) == {"mounted"}
    index = skopeo("inspect", "--raw", "--tls-verify=false", f"docker://{base}/fedora:40")
    assert index["annotations"] == {"org.opencontainers.image.version": "40"}
    assert {(m["platform"]["architecture"], m["digest"]) for m in index["manifests"]} == {("amd64", amd), ("arm64", arm)}
    raw = run("skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{base}/fedora:40").stdout.encode()
    assert out["digest"] == "sha256:" + hashlib.sha256(raw).hexdigest()
    # Every blob is in the new repository: skopeo copies the whole index out of it.
    run("skopeo", "copy", "--all", "--src-tls-verify=false", f"docker://{base}/fedora:40", f"oci:{tmp_path / 'out'}:40")

    # A second amd64 image is refused before anything is written.
    twice = diskkit("index", "create", *FAST, f"{base}/other:40", f"{base}/x86:40", f"{base}/x86:40")
    assert twice.code != 0 and f"{base}/x86:40: platform linux/amd64 is already in the index (from {base}/x86:40)" in twice.err
    tags = diskkit("tags", *FAST, f"{base}/other")
    assert tags.code != 0 and "40" not in tags.out  # the repository was never made

    # The arm64 job runs again with a new disk: append refuses it, --replace swaps it in, amd64 stays.
    newer = make_qcow2(tmp_path / "arm2.qcow2", size="16M", pattern=0x33)
    arm2 = _job(diskkit, newer, "linux/arm64", f"{base}/arm:41")
    refused = diskkit("index", "append", *FAST, f"{base}/fedora:40", f"{base}/arm:41")
    assert refused.code != 0 and "platform linux/arm64 is already in the index" in refused.err and "--replace" in refused.err
    replaced = diskkit("index", "append", *FAST, "--replace", "--json", f"{base}/fedora:40", f"{base}/arm:41")
    assert replaced.code == 0, replaced.err
    assert json.loads(replaced.out)["replaced"] == [arm]
    index = skopeo("inspect", "--raw", "--tls-verify=false", f"docker://{base}/fedora:40")
    assert {(m["platform"]["architecture"], m["digest"]) for m in index["manifests"]} == {("amd64", amd), ("arm64", arm2)}
    assert index["annotations"] == {"org.opencontainers.image.version": "40"}  # kept by append

    verified = diskkit("verify", *FAST, "--all-platforms", "--json", f"{base}/fedora:40")
    assert verified.code == 0, verified.err
    report = json.loads(verified.out)
    assert [(p["platform"], p["ok"], p["digest"]) for p in report["platforms"]] == [("linux/amd64", True, amd), ("linux/arm64", True, arm2)]


def test_append_needs_an_index(diskkit, disks, tmp_path):
    single = f"oci:{tmp_path / 'one'}:1"
    assert diskkit("build", disks[0], "-t", single).code == 0
    other = f"oci:{tmp_path / 'two'}:1"
    assert diskkit("build", disks[1], "--platform", "linux/arm64", "-t", other).code == 0
    refused = diskkit("index", "append", single, other)
    assert refused.code != 0 and f"{single}: is an image, not an index" in refused.err
    missing = diskkit("index", "append", f"oci:{tmp_path / 'one'}:nope", other)
    assert missing.code != 0


def test_verify_all_platforms_finds_a_mislabelled_entry(diskkit, disks, tmp_path):
    from diskkit.oci.image import canonical_json, sha256_digest

    layout = tmp_path / "layout"
    assert diskkit("build", "--platform", f"linux/amd64={disks[0]}", "--platform", f"linux/arm64={disks[1]}", "-t", f"oci:{layout}:40").code == 0
    assert diskkit("verify", "--all-platforms", f"oci:{layout}:40").code == 0
    # The index says the amd64 image is for s390x: a node of that kind would pull it.
    top = json.loads((layout / "index.json").read_text())
    digest = top["manifests"][0]["digest"]
    index = json.loads((layout / "blobs/sha256" / digest[7:]).read_bytes())
    index["manifests"][0]["platform"] = {"architecture": "s390x", "os": "linux"}
    data = canonical_json(index)
    (layout / "blobs/sha256" / sha256_digest(data)[7:]).write_bytes(data)
    top["manifests"][0].update(digest=sha256_digest(data), size=len(data))
    (layout / "index.json").write_text(json.dumps(top))
    result = diskkit("verify", "--all-platforms", f"oci:{layout}:40")
    assert result.code == 8  # Exit.VERIFY_FAILED
    assert f"oci:{layout}:40 [linux/s390x]: the index lists sha256:" in result.err and "as linux/s390x, its config says linux/amd64" in result.err
    assert f"OK oci:{layout}:40 [linux/arm64]" in result.out


def test_vm_boots_with_the_instancetype_its_image_names(qemu_user, registry):
    """One boot: a VirtualMachine naming no instance type gets the one its containerDisk's image hints."""
    import yaml

    from tests.conftest import run_diskkit
    from tests.testguest import ensure_testguest, parse_console

    ref = f"{registry.host}/launcher/hinted:v1"
    built = run_diskkit("build", "--tls-verify=false", "--no-lazy", ensure_testguest() / "testguest-poweroff.qcow2", "-t", ref,
                        "--default-instancetype", "tiny.2c", "--default-preference", "virtio-cores:VirtualMachinePreference")
    assert built.code == 0, built.err
    manifests = qemu_user.root / "hint-manifests"
    manifests.mkdir()
    (manifests / "types.yaml").write_text(yaml.safe_dump_all([
        {"apiVersion": V1B1, "kind": "VirtualMachineClusterInstancetype", "metadata": {"name": "tiny.2c"},
         "spec": {"cpu": {"guest": 2}, "memory": {"guest": "320Mi"}}},
        {"apiVersion": V1B1, "kind": "VirtualMachinePreference", "metadata": {"name": "virtio-cores", "namespace": "default"},
         "spec": {"cpu": {"preferredCPUTopology": "cores"}, "devices": {"preferredDiskBus": "virtio"}}},
    ]))
    manifests.chmod(0o755)
    path = _vm(qemu_user.root, ref)
    result = qemu_user.launcher("run", "--tls-verify=false", "--console", "--timeout", "240", "--manifests", manifests, path)
    assert result.code == 0, result.err
    console = parse_console(result.out)
    assert console["ready"] and console["done"], result.out
    assert console["cpus"] == 2
    assert 256 * 1024 < console["mem_kib"] <= 320 * 1024, console["mem_kib"]
    assert "vda" in console["disks"], console["disks"]  # the preference's virtio bus


def test_a_lazy_foreign_image_is_refused_too(tmp_path, registry, disks):
    """Through the node's disk server (a lazy image from a registry), the same one line."""
    from tests.conftest import run_diskkit
    from tests.lazyhost import stop_spawned_server

    arm = f"{registry.host}/multi/arm-lazy:v1"
    assert run_diskkit("build", "--tls-verify=false", "--lazy", "--platform", "linux/arm64", disks[1], "-t", arm).code == 0
    vmi = tmp_path / "vmi.json"
    vmi.write_text(json.dumps({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "arm"},
                               "spec": {"domain": {"devices": {}, "resources": {"requests": {"memory": "64Mi"}}},
                                        "volumes": [{"name": "root", "containerDisk": {"image": arm}}]}}))
    try:
        refused = _domain(tmp_path, "--tls-verify=false", "--lazy", vmi)
        assert refused.code != 0
        assert "image platform linux/arm64 is not the guest's linux/amd64" in refused.err.strip().splitlines()[-1]
    finally:
        stop_spawned_server(tmp_path / "cache")


def test_skip_if_label_per_platform(diskkit, registry, disks):
    """medius's rebuild check compares each architecture's own checksum label."""
    target = f"{registry.host}/multi/skip-{uuid.uuid4().hex[:6]}:40"
    both = ["--platform", f"linux/amd64={disks[0]}", "--platform", f"linux/arm64={disks[1]}", "-t", target, *FAST]
    sums = ["--label", "linux/amd64:shasum=aaa", "--label", "linux/arm64:shasum=bbb"]
    assert diskkit("build", *both, *sums).code == 0
    same = diskkit("build", *both, *sums, "--skip-if-label", "linux/amd64:shasum=aaa", "--skip-if-label", "linux/arm64:shasum=bbb")
    assert same.code == 0, same.err
    assert same.out.strip() == f"{target}: nothing done, its image already carries linux/amd64:shasum=aaa, linux/arm64:shasum=bbb"
    # One architecture's upstream changed: the build runs.
    changed = diskkit("build", *both, "--label", "linux/amd64:shasum=aaa", "--label", "linux/arm64:shasum=ccc",
                      "--skip-if-label", "linux/amd64:shasum=aaa", "--skip-if-label", "linux/arm64:shasum=ccc")
    assert changed.code == 0, changed.err
    assert changed.last_line.startswith("sha256:")
    arm = skopeo("inspect", "--config", "--tls-verify=false", "--override-arch", "arm64", f"docker://{target}")
    assert arm["config"]["Labels"] == {"shasum": "ccc"}

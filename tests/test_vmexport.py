"""KubeVirt VM exports as OCI images: `diskkit export` writes the layout of kubevirt
pkg/storage/oci/oci.go (Builder) with the config of pkg/storage/export/virt-exportserver/oci.go
(prepareVMConfig), and `launcher run` of such an export (oci-archive:, oci:, docker://) runs its
VirtualMachine with each claim made from the disk layer hack/oci-import.sh would upload for it.
The round trip boots the test guest from a pushed export and the guest sees the same disk."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
import zstandard

from diskkit.errors import DiskkitError
from diskkit.oci import vmexport as layout
from tests.conftest import launcher_command, run_diskkit
from tests.testguest import ensure_testguest, parse_console
from tests.vmhost import NOREG, QEMU_UID

MIB = 1 << 20


def _vm(path: Path, claim: str = "root.disk", serial: str = "exported-root") -> Path:
    """The test guest's VM as a cluster would have it: a DataVolume template and a dataVolume volume."""
    vm = {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "exported", "namespace": "team-a"},
        "spec": {
            "runStrategy": "Always",
            "dataVolumeTemplates": [{"metadata": {"name": claim}, "spec": {"source": {"blank": {}}, "storage": {"resources": {"requests": {"storage": "64Mi"}}}}}],
            "template": {"spec": {
                "domain": {"resources": {"requests": {"memory": "128Mi"}},
                           "devices": {"disks": [{"name": "root", "serial": serial, "disk": {"bus": "virtio"}}]}},
                "volumes": [{"name": "root", "dataVolume": {"name": claim}}],
            }},
        },
    }
    path.write_text(json.dumps(vm))
    return path


def _claim_dir(root: Path) -> Path:
    """A filesystem claim holding the test guest as raw disk.img (what CDI leaves in a claim)."""
    claim = root / "claim-root"
    claim.mkdir()
    subprocess.run(["qemu-img", "convert", "-O", "raw", ensure_testguest() / "testguest-poweroff.qcow2", claim / "disk.img"], check=True)
    return claim


def _tar_files(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


# --- the pure layout --------------------------------------------------------------------------------

def test_disk_size_annotation_is_a_binary_si_quantity_as_kubevirt_writes_it():
    # resource.NewQuantity(size, BinarySI).String() (apimachinery quantity.go CanonicalizeBytes):
    # exact powers of 1024 get Ki..Ei, anything else stays bytes; under 1024 it is DecimalSI.
    assert layout.binary_quantity(64 * MIB) == "64Mi"
    assert layout.binary_quantity(10 << 30) == "10Gi"
    assert layout.binary_quantity(1536) == "1536"
    assert layout.binary_quantity(3 * 1024 * 1000) == "3000Ki"
    assert layout.binary_quantity(512) == "512"
    assert layout.binary_quantity(1000) == "1k"


def test_config_is_the_vm_as_prepare_vm_config_makes_it():
    vm = json.loads(_vm_json())
    config = layout.vm_config(vm, "vm.yaml")
    assert list(config)[:2] == ["apiVersion", "kind"]
    assert "namespace" not in config["metadata"] and "dataVolumeTemplates" not in config["spec"]
    assert config["spec"]["template"]["spec"]["volumes"] == [{"name": "root", "persistentVolumeClaim": {"claimName": "root.disk"}}]
    assert vm["spec"]["dataVolumeTemplates"]  # the input is left alone


def _vm_json() -> str:
    return json.dumps({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "metadata": {"name": "x", "namespace": "n"},
                       "spec": {"dataVolumeTemplates": [{}], "template": {"spec": {"volumes": [{"name": "root", "dataVolume": {"name": "root.disk"}}]}}}})


GOLDEN = Path(__file__).parent / "golden" / "vmexport" / "manifest-and-index.json"


def test_manifest_and_index_bytes_are_what_go_writes_for_kubevirts_builder():
    # The golden file is Go 1.19's json.Marshal of ocispec.Manifest and ocispec.Index (image-spec
    # v1.1.0 as KubeVirt vendors it), filled as pkg/storage/oci/oci.go buildManifest/buildIndex fill them
    # for these descriptors: one line each.
    layer = layout.disk_descriptor("root-disk", "sha256:" + "a" * 64, 10, 64 * MIB)
    config = layout.descriptor(layout.MEDIA_TYPE_VM_CONFIG, "sha256:" + "b" * 64, 5)
    manifest, index = GOLDEN.read_bytes().split(b"\n")
    assert layout.manifest(config, [layer]) == manifest
    assert layout.index("sha256:" + "a" * 64, 611, "amd64", "2026-07-01T10:00:00Z") == index


def test_manifest_bytes_are_go_encoding_json_of_the_image_spec_structs():
    layer = layout.disk_descriptor("root-disk", "sha256:" + "a" * 64, 10, 64 * MIB)
    config = layout.descriptor(layout.MEDIA_TYPE_VM_CONFIG, "sha256:" + "b" * 64, 5)
    assert layout.manifest(config, [layer]) == (
        b'{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json",'
        b'"artifactType":"application/vnd.kubevirt.virtualmachine.v1",'
        b'"config":{"mediaType":"application/vnd.kubevirt.virtualmachine.config.v1+json","digest":"sha256:' + b"b" * 64 + b'","size":5},'
        b'"layers":[{"mediaType":"application/vnd.kubevirt.disk.raw+zstd","digest":"sha256:' + b"a" * 64 + b'","size":10,'
        b'"annotations":{"io.kubevirt.disk.name":"root-disk","io.kubevirt.disk.size":"64Mi",'
        b'"org.opencontainers.image.title":"root-disk.raw.zst"}}]}')
    # Go's encoder escapes HTML characters in strings
    assert layout.go_json({"a": "<&>"}) == b'{"a":"\\u003c\\u0026\\u003e"}'


def test_claims_map_to_disks_by_name_with_dots_as_dashes_and_an_unmapped_claim_is_refused():
    vm = layout.vm_config(json.loads(_vm_json()), "vm")
    disk = layout.ExportDisk("root-disk", {})
    assert layout.map_claims(vm, [disk], "x") == {"root.disk": disk}
    with pytest.raises(Exception, match="volume claim 'root.disk' has no disk layer in the export"):
        layout.map_claims(vm, [layout.ExportDisk("other", {})], "x")


# --- writing ----------------------------------------------------------------------------------------

def test_export_to_an_archive_is_kubevirts_layout_and_skopeo_reads_and_copies_it(tmp_path):
    claim = _claim_dir(tmp_path)
    archive = tmp_path / "vm.oci.tar"
    done = run_diskkit("export", _vm(tmp_path / "vm.yaml"), "--pvc", f"root.disk={claim}", "-t", f"oci-archive:{archive}", "--json")
    assert done.code == 0, done.err
    files = _tar_files(archive)
    assert files["oci-layout"] == b'{"imageLayoutVersion":"1.0.0"}'
    index = json.loads(files["index.json"])
    assert list(index) == ["schemaVersion", "mediaType", "artifactType", "manifests", "annotations"]
    assert index["artifactType"] == "application/vnd.kubevirt.virtualmachine.v1"
    assert index["manifests"][0]["platform"] == {"architecture": "amd64", "os": "linux"}
    assert "org.opencontainers.image.created" in index["annotations"]
    manifest_bytes = files["blobs/sha256/" + index["manifests"][0]["digest"].split(":")[1]]
    manifest = json.loads(manifest_bytes)
    assert manifest["config"]["mediaType"] == "application/vnd.kubevirt.virtualmachine.config.v1+json"
    (layer,) = manifest["layers"]
    assert layer["annotations"] == {"io.kubevirt.disk.name": "root-disk", "io.kubevirt.disk.size": "64Mi",
                                    "org.opencontainers.image.title": "root-disk.raw.zst"}
    blob = files["blobs/sha256/" + layer["digest"].split(":")[1]]
    assert zstandard.ZstdDecompressor().decompressobj().decompress(blob) == (claim / "disk.img").read_bytes()
    config = json.loads(files["blobs/sha256/" + manifest["config"]["digest"].split(":")[1]])
    assert config["spec"]["template"]["spec"]["volumes"][0] == {"name": "root", "persistentVolumeClaim": {"claimName": "root.disk"}}
    assert json.loads(done.out)["manifest"] == index["manifests"][0]["digest"]

    raw = subprocess.run(["skopeo", "inspect", "--raw", f"oci-archive:{archive}"], capture_output=True, check=True)
    assert raw.stdout == manifest_bytes
    copy = subprocess.run(["skopeo", "copy", "--multi-arch=all", f"oci-archive:{archive}", f"oci:{tmp_path / 'copied'}"], capture_output=True, text=True)
    assert copy.returncode == 0, copy.stderr
    assert (tmp_path / "copied" / "blobs" / "sha256" / layer["digest"].split(":")[1]).read_bytes() == blob


def test_export_refuses_a_claim_without_a_disk_and_writes_nothing(tmp_path):
    archive = tmp_path / "vm.oci.tar"
    done = run_diskkit("export", _vm(tmp_path / "vm.yaml"), "-t", f"oci-archive:{archive}")
    assert done.code != 0
    assert "volume claim 'root.disk' has no disk: give --pvc root.disk=DIR or --disk root.disk=FILE" in done.err
    assert len(done.err.strip().splitlines()) == 1
    assert not archive.exists() and not list(tmp_path.glob("*.tar*"))


def test_export_refuses_a_vm_file_with_yaml_aliases(tmp_path):
    vm = tmp_path / "vm.yaml"
    vm.write_text("kind: VirtualMachine\nmetadata: &m {name: a}\nspec: {template: {metadata: *m}}\n")
    done = run_diskkit("export", vm, "-t", f"oci-archive:{tmp_path / 'x.tar'}")
    assert done.code != 0 and "uses a YAML alias (*name)" in done.err and len(done.err.strip().splitlines()) == 1, done.err


def test_export_takes_a_disk_file_and_refuses_a_claim_no_volume_uses(tmp_path):
    disk = tmp_path / "root.img"
    disk.write_bytes(b"\x5a" * MIB)
    vm = _vm(tmp_path / "vm.yaml")
    layout_dir = tmp_path / "out"
    done = run_diskkit("export", vm, "--disk", f"root.disk={disk}", "-t", f"oci:{layout_dir}:v1", "--json")
    assert done.code == 0, done.err
    (row,) = json.loads(done.out)["disks"]
    assert row["name"] == "root-disk" and row["diskSize"] == MIB
    blob = (layout_dir / "blobs" / "sha256" / row["digest"][7:]).read_bytes()
    assert zstandard.ZstdDecompressor().decompressobj().decompress(blob) == disk.read_bytes()
    index = json.loads((layout_dir / "index.json").read_text())
    assert index["manifests"][0]["annotations"] == {"org.opencontainers.image.ref.name": "v1"}

    linked = tmp_path / "linked-claim"
    linked.mkdir()
    (linked / "disk.img").symlink_to(disk)  # a claim's writer cannot make root export another file
    refused = run_diskkit("export", vm, "--pvc", f"root.disk={linked}", "-t", f"oci:{tmp_path / 'out2'}")
    assert refused.code != 0 and "disk.img is not a regular file" in refused.err, refused.err
    extra = run_diskkit("export", vm, "--disk", f"root.disk={disk}", "--disk", f"other={disk}", "-t", f"oci:{tmp_path / 'out2'}")
    assert extra.code != 0 and f"--disk other: no volume of {vm} uses claim 'other'" in extra.err, extra.err
    assert not (tmp_path / "out2").exists()


# --- reading and running ----------------------------------------------------------------------------

def test_round_trip_export_push_run_and_the_guest_sees_the_same_disk(qemu_user, registry, tmp_path):
    claim = _claim_dir(tmp_path)
    ref = f"{registry.host}/vms/exported:v1"
    pushed = run_diskkit("export", _vm(tmp_path / "vm.yaml"), "--pvc", f"root.disk={claim}", "-t", f"docker://{ref}", NOREG)
    assert pushed.code == 0, pushed.err
    raw = subprocess.run(["skopeo", "inspect", "--raw", NOREG, f"docker://{ref}"], capture_output=True, check=True)
    assert json.loads(raw.stdout)["artifactType"] == "application/vnd.kubevirt.virtualmachine.v1"
    copy = subprocess.run(["skopeo", "copy", "--multi-arch=all", "--src-tls-verify=false", f"docker://{ref}", f"oci:{tmp_path / 'pulled'}"],
                          capture_output=True, text=True)
    assert copy.returncode == 0, copy.stderr

    ran = qemu_user.launcher("run", NOREG, "--console", "--timeout", "240", f"docker://{ref}")
    assert ran.code == 0, ran.err
    console = parse_console(ran.out)
    assert console["ready"] and console["done"], ran.out
    disks = {disk["serial"]: disk for disk in console["disks"].values()}
    assert disks["exported-root"]["size"] == (claim / "disk.img").stat().st_size
    assert disks["exported-root"]["head"].startswith("33c0")  # the guest's own boot sector: booted from the export

    # the run's claim is the export's disk, kept in the cache as a claim is: the guest's stamp went there
    (kept,) = (qemu_user.cache / "exports").glob("*/claims/root-disk/disk.img")
    original = (claim / "disk.img").read_bytes()
    written = kept.read_bytes()
    assert len(written) == len(original) and written[:512] == original[:512] and written[-512:] != original[-512:]


def _kubevirt_tar(path: Path, config: dict, disks: list[tuple[str, bytes, str | None]], compressed: dict[str, bytes] | None = None) -> Path:
    """An export as KubeVirt's Builder writes it (pkg/storage/oci/oci.go WriteTar): oci-layout,
    index.json, the manifest, the config, then each disk, as Go's encoding/json makes the JSON.
    `disks`: (name, raw bytes, a size annotation to state instead of the true one; "": none);
    `compressed`: a disk's zstd blob as given, for layers too large to hold raw."""
    import hashlib
    import io

    def digest(data: bytes) -> str:
        return "sha256:" + hashlib.sha256(data).hexdigest()

    def notes(name: str, raw: bytes, said: str | None) -> dict:
        out = {"io.kubevirt.disk.name": name, "io.kubevirt.disk.size": said or layout.binary_quantity(len(raw)),
               "org.opencontainers.image.title": f"{name}.raw.zst"}
        if said == "":
            del out["io.kubevirt.disk.size"]
        return out

    config_data = layout.go_json(config)
    blobs = [((compressed or {}).get(name) or zstandard.ZstdCompressor().compress(raw), name, raw, said) for name, raw, said in disks]
    layers = [layout.descriptor(layout.MEDIA_TYPE_DISK_RAW_ZSTD, digest(blob), len(blob), notes(name, raw, said))
              for blob, name, raw, said in blobs]
    manifest = layout.manifest(layout.descriptor(layout.MEDIA_TYPE_VM_CONFIG, digest(config_data), len(config_data)), layers)
    index = layout.index(digest(manifest), len(manifest), "amd64", "2026-07-01T10:00:00Z")
    entries = [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index),
               ("blobs/sha256/" + digest(manifest)[7:], manifest), ("blobs/sha256/" + digest(config_data)[7:], config_data),
               *(("blobs/sha256/" + digest(blob)[7:], blob) for blob, *_ in blobs)]
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    os.chown(path, QEMU_UID, QEMU_UID)
    return path


def _go_vm_config(claim: str = "root.disk") -> dict:
    """prepareVMConfig's output as Go marshals a VirtualMachine: null creationTimestamp, empty status."""
    return {"kind": "VirtualMachine", "apiVersion": "kubevirt.io/v1", "metadata": {"name": "fromkubevirt", "creationTimestamp": None},
            "spec": {"runStrategy": "Always", "template": {"metadata": {"creationTimestamp": None}, "spec": {
                "domain": {"devices": {"disks": [{"name": "root", "serial": "kubevirt-root", "disk": {"bus": "virtio"}}]},
                           "resources": {"requests": {"memory": "128Mi"}}},
                "volumes": [{"name": "root", "persistentVolumeClaim": {"claimName": claim}}]}}},
            "status": {}}


def test_run_boots_an_export_tar_as_kubevirt_writes_it(qemu_user, tmp_path):
    raw = (_claim_dir(tmp_path) / "disk.img").read_bytes()
    tar = _kubevirt_tar(qemu_user.root / "kubevirt.oci.tar", _go_vm_config(), [("root-disk", raw, None)])
    # A VM of the user's with the export's name has pins (launcher.node.pins): the export's own
    # VirtualMachine neither reads nor replaces them (a VM booted with none deletes its pin file).
    users_pins = qemu_user.cache / "pins" / "default_fromkubevirt.json"
    users_pins.parent.mkdir(exist_ok=True)
    pinned = json.dumps({"domain": "default_fromkubevirt", "volumes": {"root": {
        "image": "r.example/os:1", "pinned": "r.example/os@sha256:" + "a" * 64, "digest": "sha256:" + "a" * 64,
        "platform": "linux/amd64", "since": 1}}})
    users_pins.write_text(pinned)
    for path in (users_pins.parent, users_pins):
        os.chown(path, QEMU_UID, QEMU_UID)  # the user's, as its own run would have left them
    ran = qemu_user.launcher("run", "--console", "--timeout", "240", f"oci-archive:{tar}")
    assert ran.code == 0, ran.err
    assert users_pins.read_text() == pinned
    console = parse_console(ran.out)
    assert console["ready"] and console["done"], ran.out
    (disk,) = console["disks"].values()
    assert disk["serial"] == "kubevirt-root" and disk["size"] == len(raw) and disk["head"].startswith("33c0")


def test_domain_of_an_export_attaches_the_claims_made_from_its_disks(qemu_user):
    tar = _kubevirt_tar(qemu_user.root / "small.oci.tar", _go_vm_config("data.v1"), [("data-v1", b"\x02" * MIB, None)])
    shown = qemu_user.launcher("domain", "--json", f"oci-archive:{tar}")
    assert shown.code == 0, shown.err
    (claim,) = (qemu_user.cache / "exports").glob("*/claims/data-v1")
    assert f"{claim}/disk.img" in json.loads(shown.out)["xml"]
    assert (claim / "disk.img").read_bytes() == b"\x02" * MIB


def test_run_refuses_an_export_it_cannot_map_or_whose_disk_is_not_its_stated_size(qemu_user, registry, tmp_path):
    raw = b"\x01" * MIB
    unmapped = _kubevirt_tar(qemu_user.root / "unmapped.oci.tar", _go_vm_config("data"), [("root-disk", raw, None)])
    ran = qemu_user.launcher("run", f"oci-archive:{unmapped}")
    assert ran.code != 0 and len(ran.err.strip().splitlines()) == 1, ran.err
    assert "volume claim 'data' has no disk layer in the export (it has: root-disk)" in ran.err
    # pushed as hack/oci-import.sh says (skopeo copy of the tar): the tag names the manifest, no index
    ref = f"{registry.host}/vms/unmapped:v1"
    subprocess.run(["skopeo", "copy", "--multi-arch=all", "--dest-tls-verify=false", f"oci-archive:{unmapped}", f"docker://{ref}"],
                   check=True, capture_output=True)
    ran = qemu_user.launcher("run", NOREG, f"docker://{ref}")
    assert ran.code != 0 and "volume claim 'data' has no disk layer in the export (it has: root-disk)" in ran.err, ran.err

    lying = _kubevirt_tar(qemu_user.root / "lying.oci.tar", _go_vm_config(), [("root-disk", raw, "2Mi")])
    ran = qemu_user.launcher("run", f"oci-archive:{lying}")
    assert ran.code != 0 and len(ran.err.strip().splitlines()) == 1, ran.err
    assert f"is {MIB} bytes; its io.kubevirt.disk.size annotation says 2Mi" in ran.err
    assert not list((qemu_user.cache / "tmp").glob("*"))


def test_an_export_layer_inflates_no_further_than_its_size_annotation(qemu_user):
    """Attack (issue 38, 4): a 71 KB zstd layer wrote 2 GiB into <cache>/tmp before its size annotation
    was compared. The annotation (what hack/oci-import.sh makes the claim with: virtctl image-upload
    --size) now bounds the decompression itself: a 1 GiB bomb stated as 1Mi is refused after 1 MiB and
    a byte, under a file-size limit of 64 MiB that the old code hit (SIGXFSZ), leaving nothing."""
    piece, out = b"\x5a" * MIB, bytearray()
    squeeze = zstandard.ZstdCompressor(level=3).compressobj()
    for _ in range(1024):
        out += squeeze.compress(piece)
    out += squeeze.flush()
    assert len(out) < 128 * 1024
    tar = _kubevirt_tar(qemu_user.root / "bomb.oci.tar", _go_vm_config("bomb"), [("bomb", b"", "1Mi")], {"bomb": bytes(out)})
    command = ["prlimit", f"--fsize={64 * MIB}", "--", *launcher_command("domain", f"oci-archive:{tar}", user=str(QEMU_UID))]
    ran = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "CI": "true", **qemu_user.env}, timeout=300)
    lines = ran.stderr.strip().splitlines()
    assert ran.returncode == 1 and len(lines) == 1, (ran.returncode, ran.stderr[-2000:])
    assert f"disk bomb: inflates to more than the {MIB} bytes its io.kubevirt.disk.size annotation says; refused" in lines[0], lines[0]
    assert not list((qemu_user.cache / "tmp").glob("*"))
    assert not list((qemu_user.cache / "exports").glob(f"{_manifest_digest(tar)[7:]}*"))


def test_an_export_layer_without_a_size_annotation_is_refused_before_it_is_read(qemu_user):
    """Without io.kubevirt.disk.size nothing bounds what the layer inflates to (and KubeVirt's import
    could make no claim for it): refused in one line naming the disk."""
    tar = _kubevirt_tar(qemu_user.root / "unsized.oci.tar", _go_vm_config("unsized"), [("unsized", b"\x03" * MIB, "")])
    ran = qemu_user.launcher("domain", f"oci-archive:{tar}")
    assert ran.code == 1 and len(ran.err.strip().splitlines()) == 1, ran.err
    assert "disk unsized: its io.kubevirt.disk.size annotation '' is not a size" in ran.err, ran.err
    assert not list((qemu_user.cache / "tmp").glob("*"))


@pytest.mark.parametrize("field, volume, extra", [
    ("spec.template.spec.volumes[1].containerDisk", {"containerDisk": {"image": "IMAGE"}}, {}),
    ("spec.template.spec.volumes[1].cloudInitNoCloud.secretRef", {"cloudInitNoCloud": {"secretRef": {"name": "my-key"}}}, {}),
    ("spec.template.spec.volumes[1].hostDisk", {"hostDisk": {"path": "/etc/shadow", "type": "Disk"}}, {}),
    ("spec.template.spec.volumes[1].secret", {"secret": {"secretName": "my-key"}}, {}),
    ("spec.template.spec.accessCredentials", None, {"accessCredentials": [{"sshPublicKey": {"source": {"secret": {"secretName": "k"}},
                                                                                                  "propagationMethod": {"noCloud": {}}}}]}),
    ("spec.template.spec.domain.firmware.kernelBoot.container", None, {"domain": {"firmware": {"kernelBoot": {"container": {"image": "IMAGE"}}}}}),
])
def test_an_exports_vm_may_use_only_its_own_disks(field, volume, extra):
    """The export's VirtualMachine is its author's, run by another user: what it names beyond its own
    disks (another image, the user's Secrets, host paths) is refused in one line naming the field."""
    vm = _go_vm_config("data")
    tspec = vm["spec"]["template"]["spec"]
    if volume is not None:
        tspec["volumes"].append({"name": "extra", **volume})
    for key, value in extra.items():
        tspec[key] = {**tspec.get(key, {}), **value} if isinstance(value, dict) else value
    with pytest.raises(DiskkitError) as refused:
        layout.check_own_only(vm, "ex")
    assert refused.value.line().startswith(f"ex: config: {field}: a VM export's VirtualMachine may use only the export's own disks")
    own = _go_vm_config("data")
    own["spec"]["template"]["spec"]["volumes"] += [{"name": "scratch", "emptyDisk": {"capacity": "1Gi"}},
                                                   {"name": "ci", "cloudInitNoCloud": {"userData": "#cloud-config"}}]
    layout.check_own_only(own, "ex")
    own["spec"]["dataVolumeTemplates"] = [{"metadata": {"name": "data"}, "spec": {"source": {"registry": {"url": "docker://IMAGE"}}}}]
    with pytest.raises(DiskkitError, match="ex: config: spec.dataVolumeTemplates: a VM export's"):
        layout.check_own_only(own, "ex")


def test_an_exports_hook_sidecar_naming_the_users_configmap_is_refused():
    """The hook sidecar annotation (launcher.spec.hooks: KubeVirt's hooks.kubevirt.io/hookSidecars) names
    a ConfigMap among the user's objects whose script the node runs for the VM, behind the Sidecar
    gate: an export's author would pick the user's script for the export's guest."""
    vm = _go_vm_config("data")
    vm["spec"]["template"]["metadata"]["annotations"] = {
        "hooks.kubevirt.io/hookSidecars": json.dumps([{"args": ["--version", "v1alpha2"],
                                                       "configMap": {"name": "my-hooks", "key": "hook.sh", "hookPath": "/usr/bin/onDefineDomain"}}])}
    with pytest.raises(DiskkitError) as refused:
        layout.check_own_only(vm, "ex")
    assert refused.value.line().startswith("ex: config: spec.template.metadata.annotations[hooks.kubevirt.io/hookSidecars]: "
                                           "a VM export's VirtualMachine may use only the export's own disks"), refused.value.line()
    vm["spec"]["template"]["metadata"]["annotations"] = {"example.com/owner": "them"}  # any other annotation is the export's own
    layout.check_own_only(vm, "ex")


# launcher.volumes.vmstate keeps a VirtualMachine's persistent EFI store and TPM state by its namespace
# and name; libvirt keeps an emulated TPM's state by the domain's UUID (src/qemu/qemu_tpm.c:
# qemuTPMEmulatorCreateStorage runs the swtpm on a state directory it finds there, and
# qemuTPMEmulatorCleanupHost removes a TPM's without persistent_state when the domain goes); pkg/tpm
# HasDevice: `enabled: false` is no TPM.
@pytest.mark.parametrize("field, domain, rule", [
    ("spec.template.spec.domain.firmware.bootloader.efi.persistent", {"firmware": {"bootloader": {"efi": {"persistent": True}}}},
     "an export's spec may not keep state on this node; give a spec of your own with --spec"),
    ("spec.template.spec.domain.devices.tpm.persistent", {"devices": {"tpm": {"persistent": True}}},
     "an export's spec may not keep state on this node; give a spec of your own with --spec"),
    ("spec.template.spec.domain.devices.tpm", {"firmware": {"uuid": "5d307ca9-b3ef-428c-8861-06e72d69f223"}, "devices": {"tpm": {}}},
     "an export's spec may not have a TPM on this node, whose state is found by the VM's UUID"),
    ("spec.template.spec.domain.devices.tpm", {"devices": {"tpm": {"enabled": True, "persistent": False}}},
     "an export's spec may not have a TPM on this node, whose state is found by the VM's UUID"),
])
def test_an_exports_persistent_efi_or_tpm_state_is_refused(field, domain, rule):
    """An export runs as it came under its own metadata.name and firmware.uuid, and the state the node
    keeps for a VM is found by those: under the name (or UUID) of one of the user's VMs it would boot on
    that VM's EFI variables or TPM (its sealed keys), or leave its own there for the user's VM's next
    boot, or have libvirt remove the TPM state when it stops. Refused in one line naming the field."""
    vm = _go_vm_config("data")
    vm["metadata"]["name"] = "users-vm"
    target = vm["spec"]["template"]["spec"]["domain"]
    for key, value in domain.items():
        target[key] = {**target.get(key, {}), **value}
    with pytest.raises(DiskkitError) as refused:
        layout.check_own_only(vm, "ex")
    assert refused.value.line().startswith(f"ex: config: {field}: {rule}"), refused.value.line()
    # What keeps nothing is the export's own: a store made afresh for each run, a TPM turned off.
    target["firmware"] = {"bootloader": {"efi": {"persistent": False, "secureBoot": False}}, "serial": "its-own"}
    target["devices"]["tpm"] = {"enabled": False, "persistent": True}
    layout.check_own_only(vm, "ex")
    # KubeVirt's export server writes the VM expanded (virt-exportserver/oci.go getExpandedVM): a preference
    # or instance type it names is one of the user's, whose preferredTPM or preferredEfi would keep state.
    for key in ("preference", "instancetype"):
        named = {**vm, "spec": {**vm["spec"], key: {"kind": f"VirtualMachineCluster{key.capitalize()}", "name": "windows.11"}}}
        with pytest.raises(DiskkitError) as refused:
            layout.check_own_only(named, "ex")
        assert refused.value.line().startswith(f"ex: config: spec.{key}: a VM export's VirtualMachine may use only"), refused.value.line()


def test_run_refuses_an_exports_persistent_tpm_unless_the_user_gives_a_spec(qemu_user):
    """The refusal is the run's, before any layer is read, and the user's own spec runs the export's claims."""
    vm = _go_vm_config("kept.data")
    vm["spec"]["template"]["spec"]["domain"]["devices"]["tpm"] = {"persistent": True}
    tar = _kubevirt_tar(qemu_user.root / "kept.oci.tar", vm, [("kept-data", b"\x05" * MIB, None)])
    ran = qemu_user.launcher("domain", NOREG, f"oci-archive:{tar}")
    assert ran.code == 1 and len(ran.err.strip().splitlines()) == 1, ran.err
    assert ": config: spec.template.spec.domain.devices.tpm.persistent: an export's spec may not keep state on this node" in ran.err, ran.err
    assert not list((qemu_user.cache / "exports").glob(f"{_manifest_digest(tar)[7:]}*"))
    own = qemu_user.root / "own-kept.yaml"
    own.write_text(json.dumps({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "mine-kept"},
                               "spec": {k: v for k, v in vm["spec"]["template"]["spec"].items()}}))
    os.chown(own, QEMU_UID, QEMU_UID)
    shown = qemu_user.launcher("domain", NOREG, "--json", "--spec", own, f"oci-archive:{tar}")
    assert shown.code == 0, shown.err
    assert "<tpm " in json.loads(shown.out)["xml"]


def test_an_export_naming_another_image_is_refused_unless_the_user_gives_a_spec(qemu_user, registry, fault_proxy):
    """Attack (issue 38, 4): an export's containerDisk volume made the node pull another image with the
    user's credentials and attach it to the export's guest. Now nothing is asked of the registry; with
    --spec FILE of the user's own the export's claims run under it, and what that spec names is used."""
    other = f"{registry.host}/vms/other:v1"
    disk = qemu_user.root / "other.raw"
    disk.write_bytes(b"\x07" * MIB)
    built = run_diskkit("build", NOREG, "--no-lazy", disk, "-t", other)
    assert built.code == 0, built.err
    proxy = fault_proxy(registry)
    vm = _go_vm_config("named.data")
    vm["spec"]["template"]["spec"]["domain"]["devices"]["disks"].append({"name": "other", "disk": {"bus": "virtio"}})
    vm["spec"]["template"]["spec"]["volumes"].append({"name": "other", "containerDisk": {"image": f"{proxy.host}/vms/other:v1"}})
    tar = _kubevirt_tar(qemu_user.root / "naming.oci.tar", vm, [("named-data", b"\x04" * MIB, None)])
    ran = qemu_user.launcher("domain", NOREG, f"oci-archive:{tar}")
    assert ran.code == 1 and len(ran.err.strip().splitlines()) == 1, ran.err
    assert ": config: spec.template.spec.volumes[1].containerDisk: a VM export's VirtualMachine may use only" in ran.err, ran.err
    assert proxy.log == [] and not list((qemu_user.cache / "exports").glob(f"{_manifest_digest(tar)[7:]}*"))
    # The user's own spec: the export's claim by its name, and the image the user chose to name.
    own = qemu_user.root / "own.yaml"
    own.write_text(json.dumps({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "mine"},
                               "spec": {**{k: v for k, v in vm["spec"]["template"]["spec"].items()}}}))
    os.chown(own, QEMU_UID, QEMU_UID)
    shown = qemu_user.launcher("domain", NOREG, "--no-lazy", "--json", "--spec", own, f"oci-archive:{tar}")
    assert shown.code == 0, shown.err
    (claim,) = (qemu_user.cache / "exports").glob(f"{_manifest_digest(tar)[7:]}/claims/named-data")
    assert f"{claim}/disk.img" in json.loads(shown.out)["xml"]
    assert any("/v2/vms/other/manifests/v1" in path for _, path, _ in proxy.log)
    mine = qemu_user.launcher("domain", "--spec", own, own)
    assert mine.code != 0 and "--spec" in mine.err and "is for an EXPORT" in mine.err, mine.err


def test_run_refuses_a_tampered_export_disk_and_keeps_nothing(qemu_user, tmp_path):
    claim = _claim_dir(tmp_path)
    out = qemu_user.root / "tampered"
    # another serial: another config, so not an export this module's cache already holds
    done = run_diskkit("export", _vm(tmp_path / "vm.yaml", serial="tampered"), "--pvc", f"root.disk={claim}", "-t", f"oci:{out}")
    assert done.code == 0, done.err
    before = set((qemu_user.cache / "exports").glob("*"))
    manifest = json.loads((out / "blobs" / "sha256" / json.loads((out / "index.json").read_text())["manifests"][0]["digest"].split(":")[1]).read_bytes())
    blob = out / "blobs" / "sha256" / manifest["layers"][0]["digest"].split(":")[1]
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF  # the last byte: the zstd frame may still decode, the digest cannot hold
    blob.write_bytes(bytes(data))
    for path in [out, *out.rglob("*")]:
        os.chown(path, QEMU_UID, QEMU_UID)
    ran = qemu_user.launcher("run", NOREG, "--timeout", "60", f"oci:{out}")
    assert ran.code != 0
    assert len(ran.err.strip().splitlines()) == 1 and "sha256" in ran.err, ran.err
    assert set((qemu_user.cache / "exports").glob("*")) == before
    assert not list((qemu_user.cache / "tmp").glob("*"))


def test_run_refuses_an_image_that_is_not_a_vm_export(qemu_user, tmp_path):
    image = qemu_user.root / "plain"
    built = run_diskkit("build", ensure_testguest() / "testguest-poweroff.qcow2", "-t", f"oci:{image}")
    assert built.code == 0, built.err
    for path in [image, *image.rglob("*")]:
        os.chown(path, QEMU_UID, QEMU_UID)
    ran = qemu_user.launcher("run", NOREG, f"oci:{image}")
    assert ran.code != 0
    assert "is not a KubeVirt VM export" in ran.err and len(ran.err.strip().splitlines()) == 1, ran.err


# --- the node cache's exports: launcher ls and gc -----------------------------------------------------

def _manifest_digest(tar: Path) -> str:
    return json.loads(_tar_files(tar)["index.json"])["manifests"][0]["digest"]


def _exports_listed(qemu_user) -> dict[str, dict]:
    shown = qemu_user.launcher("ls", "--json")
    assert shown.code == 0, shown.err
    return {export["manifest"]: export for export in json.loads(shown.out)["exports"]}


def test_ls_lists_an_export_and_gc_removes_it_unless_a_launcher_holds_it_for_a_run(qemu_user):
    import fcntl

    tar = _kubevirt_tar(qemu_user.root / "gc.oci.tar", _go_vm_config("gc.data"), [("gc-data", b"\x03" * MIB, None)])
    digest = _manifest_digest(tar)
    assert qemu_user.launcher("domain", f"oci-archive:{tar}").code == 0
    export = qemu_user.cache / "exports" / digest.split(":")[1]
    listed = _exports_listed(qemu_user)[digest]
    assert listed["path"] == str(export) and listed["vm"] == "fromkubevirt" and listed["claims"] == ["gc-data"]
    assert listed["size"] >= MIB and listed["usedBy"] == []
    text = qemu_user.launcher("ls")
    assert text.code == 0 and f"fromkubevirt {digest[:19]}" in text.out, text.out
    # a name no VM may have (the run refuses it after the claims were made) is not printed
    config = _go_vm_config("gc.data")
    config["metadata"]["name"] = "\x1b[2Jevil"
    evil = _kubevirt_tar(qemu_user.root / "evil.oci.tar", config, [("gc-data", b"\x04" * MIB, None)])
    assert qemu_user.launcher("domain", f"oci-archive:{evil}").code != 0
    assert _exports_listed(qemu_user)[_manifest_digest(evil)]["vm"] is None
    assert "\x1b" not in qemu_user.launcher("ls").out

    # a launcher that made (or found) the export and has not recorded its VM yet holds its use lock
    lock = os.open(qemu_user.cache / "locks" / f"export-use-{export.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_SH)
        kept = qemu_user.launcher("gc", "--json")
        assert kept.code == 0, kept.err
        assert str(export) not in json.loads(kept.out)["removed"] and (export / "claims" / "gc-data" / "disk.img").exists()
    finally:
        os.close(lock)

    collected = qemu_user.launcher("gc", "--json")
    assert collected.code == 0, collected.err
    assert str(export) in json.loads(collected.out)["removed"] and not export.exists()
    assert digest not in _exports_listed(qemu_user)
    assert not list((qemu_user.cache / "exports").glob(".gone-*"))


def test_gc_keeps_the_export_a_running_vm_uses_and_removes_it_once_the_vm_stopped(qemu_user, tmp_path):
    raw = (_claim_dir(tmp_path) / "disk.img").read_bytes()
    tar = _kubevirt_tar(qemu_user.root / "running.oci.tar", _go_vm_config("running.disk"), [("running-disk", raw, None)])
    digest = _manifest_digest(tar)
    export = qemu_user.cache / "exports" / digest.split(":")[1]
    started = qemu_user.launcher("run", "--detach", "--timeout", "240", f"oci-archive:{tar}")
    assert started.code == 0, started.err
    try:
        assert _exports_listed(qemu_user)[digest]["usedBy"] == ["default_fromkubevirt"]
        kept = qemu_user.launcher("gc", "--json")
        assert kept.code == 0, kept.err
        assert str(export) not in json.loads(kept.out)["removed"] and export.is_dir()
    finally:
        stopped = qemu_user.launcher("stop", "fromkubevirt")
    assert stopped.code == 0, stopped.err
    collected = qemu_user.launcher("gc", "--json")
    assert collected.code == 0, collected.err
    assert str(export) in json.loads(collected.out)["removed"] and not export.exists()


def test_gc_max_size_counts_exports_and_a_reused_export_is_the_last_to_go(qemu_user):
    made = {}
    for name, fill in (("old-data", b"\x05"), ("new-data", b"\x06")):
        tar = _kubevirt_tar(qemu_user.root / f"{name}.oci.tar", _go_vm_config(name.replace("-", ".")), [(name, fill * (4 * MIB), None)])
        assert qemu_user.launcher("domain", f"oci-archive:{tar}").code == 0
        made[name] = (tar, qemu_user.cache / "exports" / _manifest_digest(tar).split(":")[1])
    # both older than anything else in the cache; the one made first is used again now
    os.utime(made["old-data"][1] / "vm.json", (2, 2))
    os.utime(made["new-data"][1] / "vm.json", (1, 1))
    assert qemu_user.launcher("domain", f"oci-archive:{made['new-data'][0]}").code == 0
    # exports count toward --max-size as disks do: 2 MiB over it, the oldest goes (4 MiB), nothing more
    shown = json.loads(qemu_user.launcher("ls", "--json").out)
    total = sum(d["size"] for d in shown["disks"]) + sum(e["size"] for e in shown["exports"])
    collected = qemu_user.launcher("gc", "--json", "--max-size", str(total - 2 * MIB))
    assert collected.code == 0, collected.err
    removed = json.loads(collected.out)["removed"]
    assert str(made["old-data"][1]) in removed and str(made["new-data"][1]) not in removed, removed
    assert made["new-data"][1].is_dir() and not made["old-data"][1].exists()

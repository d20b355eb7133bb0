"""Artifact containerDisks (issue 27 item 1): `diskkit build --artifact` writes an OCI 1.1 artifact
whose disk is one file blob named by its title, and every reader (verify, inspect, launcher pull,
the lazy disk server) takes the disk from such images, ours and one assembled by hand as `oras push
disk.img:TYPE` lays it out. Real registry, skopeo as the peer. KubeVirt's rules: the file CRI-O
puts at the layer's title in the image volume (cri-o internal/ociartifact/store.go), and the
volume's only entry as the disk (kubevirt pkg/virt-launcher/virtwrap/manager.go,
findDiskFileInImageVolume)."""

from __future__ import annotations

import gzip
import hashlib
import json
import subprocess
from pathlib import Path

import pytest
import zstandard

from tests.conftest import make_qcow2, run, run_diskkit, run_launcher
from tests.imagecraft import Member, dir_, put_blob, write_layout
from tests.lazyhost import control, disk_server, export_status, open_export, random_disk, stop_spawned_server, wait_for
from tests.testguest import ensure_testguest, parse_console
from tests.vmhost import assert_clean

NOREG = "--tls-verify=false"
MIB = 1 << 20
ARTIFACT_TYPE = "application/vnd.kubevirt.containerdisk.v1"
TITLE = "org.opencontainers.image.title"
SKIP = "kubevirt.io/image-volume-skip-digest-resolution"
EMPTY = "application/vnd.oci.empty.v1+json"


@pytest.fixture(scope="module")
def disk(tmp_path_factory) -> Path:
    return random_disk(tmp_path_factory.mktemp("artifact") / "guest.img", 6 * MIB)


def top_manifest(layout: Path, tag: str) -> tuple[dict, bytes]:
    index = json.loads((layout / "index.json").read_text())
    (entry,) = [m for m in index["manifests"] if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag]
    data = (layout / "blobs" / "sha256" / entry["digest"][7:]).read_bytes()
    return json.loads(data), data


def blob(layout: Path, digest: str) -> bytes:
    return (layout / "blobs" / "sha256" / digest[7:]).read_bytes()


def test_artifact_is_an_oci_1_1_artifact_with_the_disk_as_its_one_blob(tmp_path, disk):
    layout = tmp_path / "layout"
    built = run_diskkit("build", "--artifact", "--json", disk, "-t", f"oci:{layout}:v1")
    assert built.code == 0, built.err
    manifest, data = top_manifest(layout, "v1")
    assert manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert manifest["artifactType"] == ARTIFACT_TYPE
    assert manifest["config"]["mediaType"] == EMPTY and blob(layout, manifest["config"]["digest"]) == b"{}"
    (layer,) = manifest["layers"]
    # Uncompressed by default: CRI-O mounts the blob as it is, so this is what KubeVirt boots.
    assert layer["mediaType"] == "application/vnd.kubevirt.disk.raw"
    assert layer["annotations"] == {TITLE: "guest.img"}
    assert blob(layout, layer["digest"]) == disk.read_bytes()  # the disk itself, no tar around it
    assert manifest["annotations"][SKIP] == "true"
    assert manifest["annotations"]["io.diskkit.disk.path"] == "/guest.img"
    assert json.loads(built.out)["digest"] == "sha256:" + hashlib.sha256(data).hexdigest()

    verified = run_diskkit("verify", f"oci:{layout}:v1")
    assert verified.code == 0, verified.err
    assert "/guest.img is raw" in verified.out
    inspected = json.loads(run_diskkit("inspect", "--json", f"oci:{layout}:v1").out)
    assert inspected["artifactType"] == ARTIFACT_TYPE
    assert inspected["disk"]["path"] == "/guest.img" and inspected["disk"]["format"] == "raw"
    assert (inspected["disk"]["uid"], inspected["disk"]["mode"]) == (0, "0644")  # as CRI-O writes it

    # The peer: skopeo shows the manifest as written, and copies it to a layout and back unchanged.
    assert run("skopeo", "inspect", "--raw", f"oci:{layout}:v1").stdout.encode() == data
    run("skopeo", "copy", f"oci:{layout}:v1", f"oci:{tmp_path / 'peer'}:v1")
    run("skopeo", "copy", f"oci:{tmp_path / 'peer'}:v1", f"oci:{layout}:back")
    assert top_manifest(layout, "back")[1] == data
    assert run_diskkit("verify", f"oci:{tmp_path / 'peer'}:v1").code == 0

    # Reproducible as every build.
    again = run_diskkit("build", "--artifact", disk, "-t", f"oci:{tmp_path / 'again'}:v1")
    assert again.last_line == json.loads(built.out)["digest"]

    # No Docker schema2 form: refused as skopeo refuses it (containers/image internal/manifest/errors.go).
    words = 'creating an updated image manifest: unsupported image-specific operation on artifact with type "application/vnd.oci.empty.v1+json"'
    peer = subprocess.run(["skopeo", "copy", f"oci:{layout}:v1", f"docker-archive:{tmp_path / 'peer.tar'}:a/b:c"], capture_output=True, text=True)
    assert peer.returncode != 0 and words.replace('"', '\\"') in peer.stderr
    for dest in [f"docker-archive:{tmp_path / 'd.tar'}:a/b:c", f"dir:{tmp_path / 'v2s2'}"]:
        refused = run_diskkit("copy", *(["--format", "v2s2"] if dest.startswith("dir:") else []), f"oci:{layout}:v1", dest)
        assert refused.code != 0 and words in refused.err, refused.err
    assert not (tmp_path / "d.tar").exists()


@pytest.mark.parametrize("kind", ["gzip", "zstd"])
def test_compressed_artifacts_are_read_decompressed_with_a_note(tmp_path, disk, kind):
    layout = tmp_path / "layout"
    built = run_diskkit("build", "--artifact", "--compression", kind, disk, "-t", f"oci:{layout}:v1")
    assert built.code == 0, built.err
    assert "CRI-O puts an artifact's blob in the image volume as it is" in built.err
    manifest, _ = top_manifest(layout, "v1")
    (layer,) = manifest["layers"]
    assert layer["mediaType"] == f"application/vnd.kubevirt.disk.raw+{kind}"
    stored = blob(layout, layer["digest"])
    plain = gzip.decompress(stored) if kind == "gzip" else zstandard.ZstdDecompressor().stream_reader(stored).read()
    assert plain == disk.read_bytes()
    verified = run_diskkit("verify", f"oci:{layout}:v1")
    assert verified.code == 0, verified.err
    assert f"is {kind}-compressed in its layer" in verified.err and "KubeVirt would boot the compressed bytes" in verified.err
    pulled = run_launcher("pull", "--cache-dir", tmp_path / "cache", f"oci:{layout}:v1")
    assert pulled.code == 0, pulled.err
    assert Path(pulled.out.strip()).read_bytes() == disk.read_bytes()


def test_what_an_artifact_cannot_hold_is_refused_and_nothing_written(tmp_path, disk):
    for flags, words in [
        (["--kernel", str(disk)], "--artifact --kernel: not with an artifact"),
        (["--path", "/disk/x.img"], "--artifact --path: not with an artifact: the disk is the layer's title"),
        (["--label", "a=b"], "--artifact --label: not with an artifact: its config is empty"),
        (["--lazy"], "--artifact --lazy: not with an artifact"),
    ]:
        result = run_diskkit("build", "--artifact", *flags, disk, "-t", f"oci:{tmp_path / 'l'}:v1")
        assert result.code != 0 and words in result.err, (flags, result.err)
        assert len(result.err.strip().splitlines()) == 1
        assert not (tmp_path / "l").exists()
    docker = run_diskkit("build", "--artifact", disk, "-t", f"docker-archive:{tmp_path / 'd.tar'}")
    assert docker.code != 0 and "--artifact needs OCI manifests" in docker.err
    assert not (tmp_path / "d.tar").exists()


def oras_layout(root: Path, files: list[tuple[str, bytes, str]], tag: str = "t", name_key: str = TITLE) -> Path:
    """An OCI layout holding what `oras push REF FILE:TYPE ...` (ORAS 1.x, no --artifact-type) pushes:
    artifactType application/vnd.unknown.artifact.v1, the empty config with its data inline, each file
    a blob titled with its name, the manifest's created annotation; oras-go's JSON field order. A file
    given without :TYPE gets oras's default, application/vnd.oci.image.layer.v1.tar, over its bare bytes."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        return put_blob(blobs, data)

    layers = [{"mediaType": media, "digest": put(data), "size": len(data), "annotations": {name_key: name}} for name, data, media in files]
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": "application/vnd.unknown.artifact.v1",
        "config": {"mediaType": EMPTY, "digest": put(b"{}"), "size": 2, "data": "e30="},
        "layers": layers,
        "annotations": {"org.opencontainers.image.created": "2026-11-26T00:00:00Z"},
    }
    data = json.dumps(manifest, separators=(",", ":")).encode()
    entry = {"mediaType": manifest["mediaType"], "digest": put(data), "size": len(data), "annotations": {"org.opencontainers.image.ref.name": tag}}
    (root / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [entry]}))
    return root


def test_an_artifact_pushed_as_oras_pushes_it_is_pulled_verified_and_served(tmp_path, registry, disk):
    data = disk.read_bytes()
    layout = oras_layout(tmp_path / "oras", [("fedora.img", data, "application/vnd.kubevirt.disk.raw")])
    ref = f"{registry.host}/artifact/oras:v1"
    run("skopeo", "copy", "--dest-tls-verify=false", f"oci:{layout}:t", f"docker://{ref}")
    assert run("skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{ref}").stdout.encode() == top_manifest(layout, "t")[1]

    verified = run_diskkit("verify", NOREG, ref)
    assert verified.code == 0, verified.err
    assert "/fedora.img is raw" in verified.out
    cache = tmp_path / "cache"
    pulled = run_launcher("pull", "--cache-dir", cache, NOREG, "--json", ref)
    assert pulled.code == 0, pulled.err
    record = json.loads(pulled.out)
    assert record["member"] == "fedora.img" and Path(record["path"]).read_bytes() == data
    # containerDisk.path names the title, as KubeVirt joins it with the volume's root.
    by_path = run_launcher("pull", "--cache-dir", tmp_path / "c2", NOREG, "--path", "/fedora.img", ref)
    assert by_path.code == 0, by_path.err

    # The lazy disk server reads the blob at offsets: it is the disk, byte for byte.
    served = tmp_path / "served"
    served.mkdir()
    with disk_server(served):
        answer = open_export(served, ref)
        assert answer["member"] == "fedora.img"
        assert run("qemu-img", "compare", "-f", "raw", "-F", "raw", answer["url"], disk).stdout.strip() == "Images are identical."
        status = wait_for(lambda: (s := export_status(served, answer["export"]))["installed"] and s, 120, "the disk to be verified and installed")
        assert status["verified"]
    assert Path(status["installed"]).read_bytes() == data


ORAS_DEFAULT_MEDIA = "application/vnd.oci.image.layer.v1.tar"  # oras-go's DefaultBlobMediaType: a file pushed with no :TYPE


def test_plain_oras_push_of_a_qcow2_is_a_disk_by_its_title_whatever_the_layer_says(tmp_path, registry):
    # `oras push REG/x:v1 disk.qcow2`: the layer claims to be a tar but holds the file itself. CRI-O
    # mounts every layer of an artifact as a file at its title, whatever its media type (cri-o
    # internal/ociartifact/store.go, BlobMountPaths and artifactName, which falls back to
    # org.cncf.model.filepath); KubeVirt main boots the volume's only file (pkg/virt-launcher/virtwrap/
    # manager.go, findDiskFileInImageVolume). This was refused: "layer 0 ... is not a valid tar: bad checksum".
    qcow2 = make_qcow2(tmp_path / "disk.qcow2", size="24M", pattern=0x6D)
    data = qcow2.read_bytes()
    layout = oras_layout(tmp_path / "oras", [("disk.qcow2", data, ORAS_DEFAULT_MEDIA)])
    ref = f"{registry.host}/artifact/plain-oras:v1"
    run("skopeo", "copy", "--dest-tls-verify=false", f"oci:{layout}:t", f"docker://{ref}")
    manifest = json.loads(run("skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{ref}").stdout)
    assert manifest["layers"][0]["mediaType"] == ORAS_DEFAULT_MEDIA and manifest["config"]["mediaType"] == EMPTY

    verified = run_diskkit("verify", NOREG, ref)
    assert verified.code == 0, verified.err
    assert "/disk.qcow2 is qcow2" in verified.out, verified.out
    pulled = run_launcher("pull", "--cache-dir", tmp_path / "cache", NOREG, "--json", ref)
    assert pulled.code == 0, pulled.err
    record = json.loads(pulled.out)
    assert (record["member"], record["format"]) == ("disk.qcow2", "qcow2")
    assert Path(record["path"]).read_bytes() == data
    # Served lazily too: the blob is the file, read at offsets.
    served = tmp_path / "served"
    served.mkdir()
    with disk_server(served):
        answer = open_export(served, ref)
        assert answer["member"] == "disk.qcow2"
        assert run("qemu-img", "compare", "-F", "qcow2", answer["url"], qcow2).stdout.strip() == "Images are identical."
    # A model-spec file path names the file when no title does, as CRI-O's artifactName reads it.
    by_path = oras_layout(tmp_path / "model", [("weights.img", data, ORAS_DEFAULT_MEDIA)], name_key="org.cncf.model.filepath")
    named = run_launcher("pull", "--cache-dir", tmp_path / "cache2", "--json", f"oci:{by_path}:t")
    assert named.code == 0, named.err
    assert json.loads(named.out)["member"] == "weights.img"


def test_kubevirts_rules_for_which_file_is_the_disk(tmp_path, disk):
    data = disk.read_bytes()
    # Two titled files: the volume's root holds two entries, so KubeVirt falls back to /disk.
    two = oras_layout(tmp_path / "two", [("fedora.img", data, "application/vnd.kubevirt.disk.raw"), ("README", b"hi\n", "text/plain")])
    refused = run_launcher("pull", "--cache-dir", tmp_path / "c1", f"oci:{two}:t")
    assert refused.code != 0 and "failed to check /disk for disks" in refused.err
    chosen = run_launcher("pull", "--cache-dir", tmp_path / "c1", "--path", "/fedora.img", f"oci:{two}:t")
    assert chosen.code == 0, chosen.err
    # A layer without a title is not mountable in CRI-O: left out, the titled one is the only entry.
    untitled = oras_layout(tmp_path / "untitled", [("fedora.img", data, "application/vnd.kubevirt.disk.raw"), ("", b"x", "text/plain")])
    assert run_launcher("pull", "--cache-dir", tmp_path / "c2", f"oci:{untitled}:t").code == 0
    # A title leading out of the volume is refused, never followed.
    escaping = oras_layout(tmp_path / "esc", [("../fedora.img", data, "application/vnd.kubevirt.disk.raw")])
    bad = run_diskkit("verify", f"oci:{escaping}:t")
    assert bad.code == 8 and "title '../fedora.img' escapes the image root" in bad.err
    # A corrupt blob fails its digest as it streams; nothing lands in the cache.
    corrupt = oras_layout(tmp_path / "corrupt", [("fedora.img", data, "application/vnd.kubevirt.disk.raw")])
    manifest, _ = top_manifest(corrupt, "t")
    target = corrupt / "blobs" / "sha256" / manifest["layers"][0]["digest"][7:]
    target.write_bytes(b"\x00" + data[1:])
    broken = run_launcher("pull", "--cache-dir", tmp_path / "c3", f"oci:{corrupt}:t")
    assert broken.code != 0 and "digest" in broken.err
    assert not list((tmp_path / "c3" / "disks" / "sha256").iterdir())
    # In a plain image, a root holding a file and /disk is two entries too: /disk wins, as in KubeVirt.
    both = write_layout(tmp_path / "both", [[Member("notes.txt", b"not a disk\n", mode=0o644), dir_("disk"), Member("disk/d.img", data)]])
    result = run_launcher("pull", "--cache-dir", tmp_path / "c4", "--json", f"oci:{both}:t")
    assert result.code == 0, result.err
    assert json.loads(result.out)["member"] == "disk/d.img"


def test_built_artifact_goes_through_a_registry(tmp_path, registry, disk):
    ref = f"{registry.host}/artifact/built:v1"
    built = run_diskkit("build", NOREG, "--artifact", disk, "-t", ref)
    assert built.code == 0, built.err
    raw = json.loads(run("skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{ref}").stdout)
    assert raw["artifactType"] == ARTIFACT_TYPE and raw["layers"][0]["annotations"][TITLE] == "guest.img"
    assert run_diskkit("verify", NOREG, ref).code == 0
    described = json.loads(run_diskkit("inspect", NOREG, "--json", ref).out)
    assert described["disk"]["path"] == "/guest.img" and described["artifactType"] == ARTIFACT_TYPE
    pulled = run_launcher("pull", "--cache-dir", tmp_path / "cache", NOREG, ref)
    assert pulled.code == 0, pulled.err
    assert Path(pulled.out.strip()).read_bytes() == disk.read_bytes()
    # diskkit's own copy keeps it as it is, registry to layout.
    copied = run_diskkit("copy", NOREG, ref, f"oci:{tmp_path / 'copy'}:v1")
    assert copied.code == 0, copied.err
    assert run_diskkit("verify", f"oci:{tmp_path / 'copy'}:v1").code == 0


def test_launcher_run_boots_the_test_guest_from_a_built_artifact(qemu_user, registry):
    ref = f"{registry.host}/artifact/guest:qcow2"
    built = run_diskkit("build", NOREG, "--artifact", ensure_testguest() / "testguest-poweroff.qcow2", "-t", ref)
    assert built.code == 0, built.err
    vmi = qemu_user.write_vmi("artifact", ref)
    result = qemu_user.launcher("run", NOREG, "--console", "--timeout", "240", vmi)
    assert result.code == 0, result.err
    console = parse_console(result.out)
    assert console["done"], result.out
    assert console["disks"]["vda"]["size"] == 64 << 20
    assert console["disks"]["vda"]["head"].startswith("33c0")  # the guest's own MBR
    assert_clean(qemu_user, "default_artifact")


def test_launcher_run_boots_an_oras_style_artifact_lazily(qemu_user, registry, tmp_path):
    raw = tmp_path / "guest.img"
    run("qemu-img", "convert", "-O", "raw", ensure_testguest() / "testguest-poweroff.qcow2", raw)
    layout = oras_layout(tmp_path / "oras", [("guest.img", raw.read_bytes(), "application/vnd.kubevirt.disk.raw")])
    ref = f"{registry.host}/artifact/guest:oras"
    run("skopeo", "copy", "--dest-tls-verify=false", f"oci:{layout}:t", f"docker://{ref}")
    vmi = qemu_user.write_vmi("oras", ref)
    try:
        result = qemu_user.launcher("run", NOREG, "--lazy", "--console", "--timeout", "300", vmi)
        assert result.code == 0, result.err
        console = parse_console(result.out)
        assert console["done"], result.out
        assert console["disks"]["vda"]["size"] == 64 << 20 and console["disks"]["vda"]["head"].startswith("33c0")
        exports = control(qemu_user.cache, {"op": "status"})["exports"]
        assert [e["member"] for e in exports] == ["guest.img"], exports  # served by the disk server, not pulled
    finally:
        stop_spawned_server(qemu_user.cache)
    assert_clean(qemu_user, "default_oras")

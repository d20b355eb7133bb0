"""diskkit build into every local transport, read back by skopeo and umoci as independent clients."""

from __future__ import annotations

import json
import os
import tarfile

import pytest

from tests.conftest import make_qcow2, run


def skopeo_inspect(ref: str, raw: bool = False) -> dict:
    args = ["skopeo", "inspect", *(["--raw"] if raw else []), ref]
    return json.loads(run(*args).stdout)


def test_oci_layout_is_read_by_skopeo_and_umoci(diskkit, qcow2, tmp_path):
    layout = tmp_path / "layout"
    result = diskkit("build", qcow2, "-t", f"oci:{layout}:v1")
    assert result.code == 0, result.err
    digest = result.last_line
    assert digest.startswith("sha256:")

    info = skopeo_inspect(f"oci:{layout}:v1")
    assert info["Digest"] == digest
    assert info["Os"] == "linux" and info["Architecture"] == "amd64"
    manifest = skopeo_inspect(f"oci:{layout}:v1", raw=True)
    assert manifest["mediaType"] == "application/vnd.oci.image.manifest.v1+json"
    assert [layer["mediaType"] for layer in manifest["layers"]] == ["application/vnd.oci.image.layer.v1.tar+gzip"]

    bundle = tmp_path / "bundle"
    run("umoci", "unpack", "--image", f"{layout}:v1", bundle)
    disk_dir = bundle / "rootfs" / "disk"
    disk = disk_dir / "disk.qcow2"
    st_dir, st_disk = disk_dir.stat(), disk.stat()
    assert (st_dir.st_uid, st_dir.st_gid, st_dir.st_mode & 0o7777) == (107, 107, 0o555)
    assert (st_disk.st_uid, st_disk.st_gid, st_disk.st_mode & 0o7777) == (107, 107, 0o440)
    assert disk.read_bytes() == qcow2.read_bytes()
    assert sorted(os.listdir(bundle / "rootfs")) == [".diskkit", "disk"]  # the lazy TOC, outside /disk


def test_layer_tar_headers_name_qemu_not_the_host_user(diskkit, qcow2, tmp_path):
    layout = tmp_path / "layout"
    assert diskkit("build", qcow2, "-t", f"oci:{layout}").code == 0
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads((layout / "blobs/sha256" / index["manifests"][0]["digest"][7:]).read_text())
    layer = layout / "blobs/sha256" / manifest["layers"][0]["digest"][7:]
    with tarfile.open(layer, "r:gz") as tar:
        members = [(m.name, m.type, m.uid, m.gid, m.uname, m.gname, m.mode, m.mtime) for m in tar]
    assert members == [
        ("disk", tarfile.DIRTYPE, 107, 107, "qemu", "qemu", 0o555, 0),
        ("disk/disk.qcow2", tarfile.REGTYPE, 107, 107, "qemu", "qemu", 0o440, 0),
        (".diskkit", tarfile.DIRTYPE, 107, 107, "qemu", "qemu", 0o555, 0),
        (".diskkit/lazy-toc.json", tarfile.REGTYPE, 107, 107, "qemu", "qemu", 0o444, 0),
    ]


def test_skopeo_copies_our_layout_into_a_docker_archive(diskkit, qcow2, tmp_path):
    layout = tmp_path / "layout"
    assert diskkit("build", qcow2, "-t", f"oci:{layout}:v1").code == 0
    archive = tmp_path / "copy.tar"
    run("skopeo", "copy", f"oci:{layout}:v1", f"docker-archive:{archive}:example.com/disks/test:v1")
    with tarfile.open(archive) as tar:
        manifest = json.load(tar.extractfile("manifest.json"))
    assert manifest[0]["RepoTags"] == ["example.com/disks/test:v1"]
    verified = diskkit("verify", f"docker-archive:{archive}")
    assert verified.code == 0, verified.err


def test_building_twice_gives_the_same_digest(diskkit, qcow2, tmp_path):
    first = diskkit("build", qcow2, "-t", f"oci:{tmp_path / 'a'}")
    second = diskkit("build", qcow2, "-t", f"oci-archive:{tmp_path / 'b.tar'}")
    third = diskkit("build", qcow2, "-t", f"oci:{tmp_path / 'c'}", env={"SOURCE_DATE_EPOCH": "1700000000"})
    fourth = diskkit("build", qcow2, "-t", f"oci:{tmp_path / 'd'}", env={"SOURCE_DATE_EPOCH": "1700000000"})
    assert first.last_line == second.last_line
    assert third.last_line == fourth.last_line != first.last_line
    info = skopeo_inspect(f"oci:{tmp_path / 'c'}")
    assert info["Created"].startswith("2023-11-14T22:13:20")


@pytest.mark.parametrize("compression,media", [("zstd", "tar+zstd"), ("none", "tar"), ("gzip", "tar+gzip")])
def test_oci_archive_with_each_compression_is_read_by_skopeo(diskkit, qcow2, tmp_path, compression, media):
    archive = tmp_path / "image.tar"
    result = diskkit("build", qcow2, "--compression", compression, "-t", f"oci-archive:{archive}:t")
    assert result.code == 0, result.err
    manifest = skopeo_inspect(f"oci-archive:{archive}:t", raw=True)
    assert manifest["layers"][0]["mediaType"] == f"application/vnd.oci.image.layer.v1.{media}"
    # skopeo decompresses and checks the digest of every blob on copy.
    run("skopeo", "copy", f"oci-archive:{archive}:t", f"oci:{tmp_path / 'copied'}:t")
    assert diskkit("verify", f"oci:{tmp_path / 'copied'}:t").code == 0


def test_docker_archive_is_loadable_layout(diskkit, qcow2, tmp_path):
    archive = tmp_path / "docker.tar"
    result = diskkit("build", qcow2, "-t", f"docker-archive:{archive}:quay.io/me/fedora:40")
    assert result.code == 0, result.err
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        manifest = json.load(tar.extractfile("manifest.json"))
        repositories = json.load(tar.extractfile("repositories"))
        layer = tar.extractfile(manifest[0]["Layers"][0])
        with tarfile.open(fileobj=layer, mode="r|") as inner:
            inner_names = [m.name for m in inner]
    assert manifest[0]["RepoTags"] == ["quay.io/me/fedora:40"]
    assert set(names) == {"manifest.json", "repositories", manifest[0]["Config"], manifest[0]["Layers"][0]}
    assert inner_names == ["disk", "disk/disk.qcow2"]
    assert list(repositories) == ["quay.io/me/fedora"]
    # skopeo reads it as `docker load` would, checking the layer against the config's diff_ids.
    run("skopeo", "copy", f"docker-archive:{archive}", f"oci:{tmp_path / 'fromdocker'}:x")
    assert diskkit("verify", f"oci:{tmp_path / 'fromdocker'}:x").code == 0


def test_custom_path_and_kernel_boot_artifacts(diskkit, qcow2, tmp_path):
    kernel = tmp_path / "vmlinuz"
    kernel.write_bytes(b"kernel" * 100)
    initrd = tmp_path / "initrd"
    initrd.write_bytes(b"initrd" * 100)
    layout = tmp_path / "layout"
    result = diskkit(
        "build", qcow2, "--path", "/images/root/vm.qcow2", "--kernel", kernel, "--initrd", f"/boot/init.gz={initrd}",
        "-t", f"oci:{layout}:kb", "--json",
    )
    assert result.code == 0, result.err
    out = json.loads(result.out)
    assert out["disk"] == {"path": "/images/root/vm.qcow2", "format": "qcow2", "virtualSize": 64 << 20}
    bundle = tmp_path / "bundle"
    run("umoci", "unpack", "--image", f"{layout}:kb", bundle)
    root = bundle / "rootfs"
    assert (root / "images/root/vm.qcow2").read_bytes() == qcow2.read_bytes()
    assert (root / "boot/vmlinuz").read_bytes() == kernel.read_bytes()
    assert (root / "boot/init.gz").read_bytes() == initrd.read_bytes()
    assert not (root / "disk").exists()
    for p in ("images", "images/root", "boot"):
        assert (root / p).stat().st_mode & 0o7777 == 0o555
    assert diskkit("verify", "--path", "/images/root/vm.qcow2", f"oci:{layout}:kb").code == 0
    # Without --path KubeVirt would look in /disk, and so does verify.
    missing = diskkit("verify", f"oci:{layout}:kb")
    assert missing.code == 8 and "failed to check /disk for disks" in missing.err


def test_config_labels_env_annotations_and_json(diskkit, qcow2, tmp_path):
    layout = tmp_path / "layout"
    result = diskkit(
        "build", qcow2, "-t", f"oci:{layout}:meta", "--json", "--platform", "linux/arm64",
        "--label", "shasum=abc", "--env", "INSTANCETYPE_KUBEVIRT_IO_DEFAULT_INSTANCETYPE=u1.small",
        "--annotation", "org.opencontainers.image.source=https://example.com/repo",
    )
    assert result.code == 0, result.err
    out = json.loads(result.out)
    assert set(out) >= {"digest", "mediaType", "layers", "disk"}
    assert out["disk"]["format"] == "qcow2" and out["disk"]["path"] == "/disk/disk.qcow2"
    info = skopeo_inspect(f"oci:{layout}:meta")
    assert info["Digest"] == out["digest"]
    assert info["Architecture"] == "arm64"
    assert info["Labels"] == {"shasum": "abc"}
    assert info["Env"] == ["INSTANCETYPE_KUBEVIRT_IO_DEFAULT_INSTANCETYPE=u1.small"]
    manifest = skopeo_inspect(f"oci:{layout}:meta", raw=True)
    assert manifest["annotations"]["org.opencontainers.image.source"] == "https://example.com/repo"
    assert manifest["annotations"]["org.opencontainers.image.created"] == "1970-01-01T00:00:00Z"


def test_format_conversions(diskkit, raw_disk, qcow2, tmp_path):
    kept = diskkit("build", raw_disk, "-t", f"oci:{tmp_path / 'raw'}", "--json")
    assert kept.code == 0 and json.loads(kept.out)["disk"]["format"] == "raw"
    assert "--format qcow2" in kept.err  # the hint that qcow2 is smaller

    to_qcow2 = diskkit("build", raw_disk, "--format", "qcow2", "-t", f"oci:{tmp_path / 'q'}", "--json")
    out = json.loads(to_qcow2.out)
    assert out["disk"] == {"path": "/disk/disk.qcow2", "format": "qcow2", "virtualSize": 32 << 20}
    assert out["layers"][0]["size"] < json.loads(kept.out)["layers"][0]["size"] * 2

    to_raw = diskkit("build", qcow2, "--format", "raw", "-t", f"oci:{tmp_path / 'r'}", "--json")
    assert json.loads(to_raw.out)["disk"] == {"path": "/disk/disk.img", "format": "raw", "virtualSize": 64 << 20}
    assert diskkit("verify", f"oci:{tmp_path / 'r'}").code == 0

    vmdk = tmp_path / "disk.vmdk"
    run("qemu-img", "convert", "-O", "vmdk", qcow2, vmdk)
    converted = diskkit("build", vmdk, "-t", f"oci:{tmp_path / 'v'}", "--json")
    assert converted.code == 0, converted.err
    assert json.loads(converted.out)["disk"]["path"] == "/disk/disk.qcow2"
    assert "converting vmdk to qcow2" in converted.err


def test_existing_layout_gains_a_tag_and_keeps_others(diskkit, tmp_path):
    layout = tmp_path / "layout"
    first = make_qcow2(tmp_path / "a.qcow2", pattern=1)
    second = make_qcow2(tmp_path / "b.qcow2", pattern=2)
    a = diskkit("build", first, "-t", f"oci:{layout}:a").last_line
    b = diskkit("build", second, "-t", f"oci:{layout}:b").last_line
    assert skopeo_inspect(f"oci:{layout}:a")["Digest"] == a
    assert skopeo_inspect(f"oci:{layout}:b")["Digest"] == b
    # Retagging replaces the entry, as skopeo copy does.
    assert diskkit("build", second, "-t", f"oci:{layout}:a").last_line == b
    index = json.loads((layout / "index.json").read_text())
    assert sorted(m["annotations"]["org.opencontainers.image.ref.name"] for m in index["manifests"]) == ["a", "b"]
    ambiguous = diskkit("inspect", f"oci:{layout}")
    assert ambiguous.code == 1 and "name one with :TAG" in ambiguous.err

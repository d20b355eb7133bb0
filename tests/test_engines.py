"""docker-daemon: against a private dockerd and a private podman service, side by side with skopeo's
docker-daemon transport (containers/image docker/daemon) on the same engine."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import make_qcow2, run_diskkit, run_launcher


def skopeo(engine, *args) -> subprocess.CompletedProcess:
    # skopeo 1.9 does not read DOCKER_HOST: it takes --src/--dest-daemon-host.
    proc = subprocess.run(["skopeo", *args], capture_output=True, text=True, env={**os.environ, **engine.env})
    assert proc.returncode == 0, proc.stderr
    return proc


def layout_image(layout: Path, tag: str) -> tuple[dict, dict]:
    """(manifest, config) of the image tagged `tag` in an OCI layout."""
    index = json.loads((layout / "index.json").read_text())
    entry = next(m for m in index["manifests"] if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag)
    manifest = json.loads(blob(layout, entry["digest"]))
    return manifest, json.loads(blob(layout, manifest["config"]["digest"]))


def blob(layout: Path, digest: str) -> bytes:
    return (layout / "blobs" / "sha256" / digest.split(":")[1]).read_bytes()


def layer_diff_ids(layout: Path, manifest: dict) -> list[str]:
    """The digest of each layer's uncompressed tar, whatever compression the writer chose."""
    out = []
    for layer in manifest["layers"]:
        data = blob(layout, layer["digest"])
        if data[:2] == b"\x1f\x8b":
            import gzip

            data = gzip.decompress(data)
        out.append("sha256:" + hashlib.sha256(data).hexdigest())
    return out


@pytest.fixture(scope="module")
def disk(tmp_path_factory) -> Path:
    return make_qcow2(tmp_path_factory.mktemp("engines") / "disk.qcow2", "32M", 0x5C)


def image_tags(engine) -> set[str]:
    return {tag for image in engine.client().images.list() for tag in image.tags}


def test_build_into_engine_and_copy_out_as_skopeo_does(engine, disk, tmp_path):
    name = f"example.com/vm/{engine.kind}-built:v1"
    built = run_diskkit("build", disk, "-t", f"docker-daemon:{name}", env=engine.env)
    assert built.code == 0, built.err
    assert name in image_tags(engine) or f"{name}" in {t.removeprefix("docker.io/") for t in image_tags(engine)}

    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    out = run_diskkit("push", f"docker-daemon:{name}", f"oci:{ours}:v1", env={**engine.env, "TMPDIR": str(tmp_path)})
    assert out.code == 0, out.err
    skopeo(engine, "copy", "--src-daemon-host", engine.host, f"docker-daemon:{name}", f"oci:{theirs}:v1")
    our_manifest, our_config = layout_image(ours, "v1")
    their_manifest, their_config = layout_image(theirs, "v1")
    # The same config and every layer's content arrive on both paths. skopeo re-serialises the config
    # when it converts the manifest to OCI; ours keeps its bytes, so its digest stays the image ID.
    assert our_config == their_config
    assert our_manifest["config"]["digest"] == engine.client().images.get(name).id
    assert layer_diff_ids(ours, our_manifest) == layer_diff_ids(theirs, their_manifest) == our_config["rootfs"]["diff_ids"]
    # The spooled save stream is gone once the copy ends.
    assert not list(tmp_path.glob("diskkit-engine-*"))

    verify = run_diskkit("verify", f"oci:{ours}:v1")
    assert verify.code == 0, verify.out + verify.err


def test_image_loaded_by_skopeo_reads_back_and_by_id(engine, disk, tmp_path):
    src = tmp_path / "src"
    assert run_diskkit("build", disk, "-t", f"oci:{src}:v1").code == 0
    name = f"example.com/vm/{engine.kind}-skopeo:v2"
    skopeo(engine, "copy", "--dest-daemon-host", engine.host, f"oci:{src}:v1", f"docker-daemon:{name}")
    _, src_config = layout_image(src, "v1")
    image_id = engine.client().images.get(name).id

    for i, ref in enumerate((f"docker-daemon:{name}", f"docker-daemon:{image_id}")):
        out = tmp_path / f"out{i}"
        result = run_diskkit("push", ref, f"oci:{out}:v1", env=engine.env)
        assert result.code == 0, result.err
        manifest, config = layout_image(out, "v1")
        assert manifest["config"]["digest"] == image_id
        assert config["rootfs"]["diff_ids"] == src_config["rootfs"]["diff_ids"]


def test_pushed_into_engine_is_what_skopeo_reads(engine, disk, tmp_path):
    src = tmp_path / "src"
    assert run_diskkit("build", disk, "-t", f"oci:{src}:v1").code == 0
    name = f"example.com/vm/{engine.kind}-pushed:v3"
    result = run_diskkit("push", f"oci:{src}:v1", f"docker-daemon:{name}", env=engine.env)
    assert result.code == 0, result.err
    back = tmp_path / "back"
    skopeo(engine, "copy", "--src-daemon-host", engine.host, f"docker-daemon:{name}", f"oci:{back}:v1")
    src_manifest, src_config = layout_image(src, "v1")
    manifest, config = layout_image(back, "v1")
    assert config == src_config
    assert engine.client().images.get(name).id == src_manifest["config"]["digest"]
    assert layer_diff_ids(back, manifest) == src_config["rootfs"]["diff_ids"]


def test_launcher_pulls_from_the_engine(dockerd, disk, tmp_path):
    name = "example.com/vm/pulled:v1"
    assert run_diskkit("build", disk, "-t", f"docker-daemon:{name}", env=dockerd.env).code == 0
    result = run_launcher("pull", "--cache-dir", tmp_path / "cache", f"docker-daemon:{name}", env=dockerd.env)
    assert result.code == 0, result.err
    assert Path(result.out.strip()).read_bytes() == disk.read_bytes()


def test_missing_image_and_unreachable_engine_fail_in_one_line(dockerd, tmp_path):
    missing = run_diskkit("push", "docker-daemon:example.com/none:v1", f"oci:{tmp_path / 'x'}:v1", env=dockerd.env)
    assert missing.code != 0 and "no such image" in missing.err and len(missing.err.strip().splitlines()) == 1
    gone = run_diskkit("push", "docker-daemon:example.com/none:v1", f"oci:{tmp_path / 'x'}:v1", env={"DOCKER_HOST": f"unix://{tmp_path}/no.sock"})
    assert gone.code != 0 and "cannot reach the container engine" in gone.err and "DOCKER_HOST" in gone.err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "ref, words",
    [
        ("docker-daemon:example.com/x", "has neither a tag nor a digest"),
        ("docker-daemon:x:v1@sha256:" + "0" * 64, "references with both a tag and digest are currently not supported"),
        ("docker-daemon:sha256:abc", "invalid"),
    ],
)
def test_references_skopeo_refuses(ref, words, tmp_path):
    result = run_diskkit("push", ref, f"oci:{tmp_path / 'x'}:v1", env={"DOCKER_HOST": f"unix://{tmp_path}/no.sock"})
    assert result.code != 0 and words.lower() in result.err.lower(), result.err


def test_destination_must_be_name_and_tag(tmp_path, disk):
    result = run_diskkit("build", disk, "-t", "docker-daemon:x@sha256:" + "0" * 64, env={"DOCKER_HOST": f"unix://{tmp_path}/no.sock"})
    assert result.code != 0 and "a destination must be a name:tag" in result.err, result.err


# --- containers-storage: podman's store through its service; skopeo opens the same store directly ---

def storage_env(podman) -> dict:
    return {**podman.env, "CONTAINER_HOST": podman.host}


def test_built_into_podman_store_is_what_skopeo_reads_there(podman, disk, tmp_path):
    built = run_diskkit("build", disk, "-t", "containers-storage:example.com/vm/stored:v1", env=storage_env(podman))
    assert built.code == 0, built.err
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    out = run_diskkit("push", "containers-storage:example.com/vm/stored:v1", f"oci:{ours}:v1", env=storage_env(podman))
    assert out.code == 0, out.err
    skopeo(podman, "copy", "containers-storage:example.com/vm/stored:v1", f"oci:{theirs}:v1")
    our_manifest, our_config = layout_image(ours, "v1")
    their_manifest, their_config = layout_image(theirs, "v1")
    assert our_config == their_config
    assert layer_diff_ids(ours, our_manifest) == layer_diff_ids(theirs, their_manifest) == our_config["rootfs"]["diff_ids"]
    pulled = run_launcher("pull", "--cache-dir", tmp_path / "cache", "containers-storage:example.com/vm/stored:v1", env=storage_env(podman))
    assert pulled.code == 0, pulled.err
    assert Path(pulled.out.strip()).read_bytes() == disk.read_bytes()


def test_short_names_mean_docker_io_library_and_latest(podman, disk, tmp_path):
    src = tmp_path / "src"
    assert run_diskkit("build", disk, "-t", f"oci:{src}:v1").code == 0
    skopeo(podman, "copy", f"oci:{src}:v1", "containers-storage:shortdisk")
    _, src_config = layout_image(src, "v1")
    for ref in ("containers-storage:shortdisk", "containers-storage:docker.io/library/shortdisk:latest"):
        out = tmp_path / ref.rpartition(":")[2].replace("/", "_")
        result = run_diskkit("push", ref, f"oci:{out}:v1", env=storage_env(podman))
        assert result.code == 0, result.err
        assert layout_image(out, "v1")[1] == src_config
    assert "docker.io/library/shortdisk:latest" in image_tags(podman)
    # Written by us under a short name, skopeo finds it under the long one.
    assert run_diskkit("push", f"oci:{src}:v1", "containers-storage:shortdisk2", env=storage_env(podman)).code == 0
    skopeo(podman, "inspect", "containers-storage:docker.io/library/shortdisk2:latest")


def test_store_specifiers_are_refused(tmp_path):
    result = run_diskkit("push", "containers-storage:[vfs@/tmp/g+/tmp/r]x:v1", f"oci:{tmp_path / 'x'}:v1")
    assert result.code != 0 and "store specifiers" in result.err and "CONTAINER_HOST" in result.err

"""dir: as skopeo writes and reads it (containers/image directory/), side by side on the same images."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import make_qcow2, run_diskkit, run_launcher


def files(root: Path) -> dict[str, str]:
    """Every file of a directory (hidden ones too) and its sha256."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in root.iterdir()}


def skopeo(*args) -> None:
    proc = subprocess.run(["skopeo", *args], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("dirt")
    disk = make_qcow2(root / "disk.qcow2", "32M", 0x3D)
    single, multi = root / "single", root / "multi"
    assert run_diskkit("build", disk, "-t", f"oci:{single}:v1").code == 0
    built = run_diskkit("build", "--platform", f"linux/amd64={disk}", "--platform", f"linux/arm64={disk}", "-t", f"oci:{multi}:v1")
    assert built.code == 0, built.err
    return {"disk": disk, "single": f"oci:{single}:v1", "multi": f"oci:{multi}:v1"}


@pytest.mark.parametrize("kind, flags", [("single", []), ("multi", ["--all"]), ("multi", [])])
def test_written_file_for_file_as_skopeo_writes_it(images, tmp_path, kind, flags):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    result = run_diskkit("push", *flags, images[kind], f"dir:{ours}")
    assert result.code == 0, result.err
    skopeo("copy", *flags, images[kind], f"dir:{theirs}")
    assert files(ours) == files(theirs)
    assert (ours / "version").read_bytes() == b"Directory Transport Version: 1.1\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_skopeo_dir_reads_back_with_the_same_digest(images, tmp_path):
    theirs = tmp_path / "theirs"
    skopeo("copy", "--all", images["multi"], f"dir:{theirs}")
    for flags in ([], ["--all"]):
        out = tmp_path / f"out{len(flags)}"
        result = run_diskkit("push", *flags, f"dir:{theirs}", f"oci:{out}:v1")
        assert result.code == 0, result.err
    index = json.loads((tmp_path / "out1" / "index.json").read_text())
    assert index["manifests"][0]["digest"] == "sha256:" + hashlib.sha256((theirs / "manifest.json").read_bytes()).hexdigest()
    verify = run_diskkit("verify", f"dir:{theirs}")
    assert verify.code == 0, verify.out + verify.err
    pulled = run_launcher("pull", "--cache-dir", tmp_path / "cache", f"dir:{theirs}")
    assert pulled.code == 0, pulled.err
    assert Path(pulled.out.strip()).read_bytes() == images["disk"].read_bytes()


def test_foreign_directory_is_never_overwritten(images, tmp_path):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    result = run_diskkit("push", images["single"], f"dir:{target}")
    assert result.code != 0 and "not a containers image directory, don't want to overwrite important data" in result.err
    assert [p.name for p in target.iterdir()] == ["notes.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["precious"]


def test_previous_dir_image_is_replaced_whole(images, tmp_path):
    target = tmp_path / "img"
    assert run_diskkit("push", "--all", images["multi"], f"dir:{target}").code == 0
    assert run_diskkit("push", images["single"], f"dir:{target}").code == 0
    theirs = tmp_path / "theirs"
    skopeo("copy", images["single"], f"dir:{theirs}")
    assert files(target) == files(theirs)  # no stale blobs of the old image
    assert sorted(p.name for p in tmp_path.iterdir()) == ["img", "theirs"]  # nor the old image set aside


def test_corrupt_source_keeps_the_old_image(images, tmp_path):
    good, bad = tmp_path / "good", tmp_path / "bad"
    assert run_diskkit("push", images["single"], f"dir:{good}").code == 0
    before = files(good)
    skopeo("copy", images["single"], f"dir:{bad}")
    manifest = json.loads((bad / "manifest.json").read_text())
    layer = bad / manifest["layers"][0]["digest"].split(":")[1]
    data = bytearray(layer.read_bytes())
    data[len(data) // 2] ^= 0xFF
    layer.write_bytes(bytes(data))
    result = run_diskkit("push", f"dir:{bad}", f"dir:{good}")
    assert result.code != 0 and len(result.err.strip().splitlines()) == 1
    assert files(good) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "good"]

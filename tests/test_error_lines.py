"""What users read when something is wrong: one line, the reference once, the flag that helps, and
an exit code that says whether a problem was found."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import make_qcow2, run_diskkit
from tests.imagecraft import put_blob


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lines")
    disk = make_qcow2(root / "d.qcow2", "16M", 0x21)
    custom = root / "custom"
    assert run_diskkit("build", disk, "--path", "/images/root.qcow2", "-t", f"oci:{custom}:v1").code == 0
    plain = root / "plain"
    assert run_diskkit("build", disk, "-t", f"oci:{plain}:v1").code == 0
    return {"custom": f"oci:{custom}:v1", "plain": f"oci:{plain}:v1", "root": root}


def test_custom_path_image_is_inspected_where_its_disk_is(images):
    result = run_diskkit("inspect", images["custom"])
    assert result.code == 0, result.out + result.err
    assert "Disk:         /images/root.qcow2" in result.out and "Problem" not in result.out


def test_inspect_exits_1_when_it_lists_a_problem(images):
    result = run_diskkit("inspect", "--path", "/disk/missing.qcow2", images["plain"])
    assert result.code == 1 and "Problem:" in result.out


def foreign_layout(root: Path) -> str:
    """An ordinary container image (no /disk, no created time, no diskkit annotations)."""
    import hashlib
    import io
    import json
    import tarfile

    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        return put_blob(blobs, data)

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("etc/hostname")
        info.size = 4
        tar.addfile(info, io.BytesIO(b"box\n"))
    layer = buf.getvalue()
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]}}).encode()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": put(config), "size": len(config)},
                           "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": put(layer), "size": len(layer)}]}).encode()
    (root / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    (root / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": put(manifest), "size": len(manifest)}]}))
    return f"oci:{root}"


def test_foreign_image_is_described_without_none(tmp_path):
    result = run_diskkit("inspect", foreign_layout(tmp_path / "foreign"))
    assert "None" not in result.out, result.out
    assert "Problem:      failed to check /disk for disks" in result.out and result.code == 1


def test_foreign_image_in_a_registry_is_described_without_none(registry, tmp_path):
    target = f"{registry.host}/lines/foreign:v1"
    assert run_diskkit("push", "--tls-verify=false", foreign_layout(tmp_path / "foreign"), target).code == 0
    result = run_diskkit("inspect", "--tls-verify=false", target)
    assert result.code == 0, result.err
    assert "None" not in result.out and "Disk:         not described" in result.out, result.out


def test_verify_names_the_reference_once(images):
    ref = images["plain"].replace(":v1", ":nope")
    result = run_diskkit("verify", ref)
    assert result.code == 5  # Exit.NOT_FOUND
    line = result.err.strip()
    assert line.count(ref) == 1 and "no image tagged 'nope'" in line, line


def test_plain_http_registry_gets_the_flag_that_helps(registry, images):
    result = run_diskkit("push", images["plain"], f"{registry.host}/lines/x:v1")
    assert result.code == 1
    assert "answered in plain HTTP" in result.err and "--tls-verify=false" in result.err
    assert "--cert-dir" not in result.err and "SSLError" not in result.err
    assert len(result.err.strip().splitlines()) == 1


def test_tls_failure_reason_is_openssls_words(tls_registry, images):
    result = run_diskkit("push", images["plain"], f"{tls_registry.host}/lines/x:v1")
    assert result.code == 1 and "certificate verify failed" in result.err and "SSLError(" not in result.err

"""Disks, not anything (issue 30 item 2): compressed and archived disks are unwrapped as CDI's importer
does (containerized-data-importer pkg/image/filefmt.go and pkg/importer/format-readers.go: the magic
numbers; pkg/importer/transport.go: a tar's regular file), files that are no disk are refused with what
to do, and `verify` flags an image that already holds one."""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile

import pytest

from diskkit.disk import payload
from tests.conftest import run
from tests.imagecraft import Member, dir_, write_layout

COMPRESSORS = {
    "xz": (["xz", "-k", "-T1"], ".xz"),
    "gzip": (["gzip", "-k"], ".gz"),
    "zstd": (["zstd", "-q"], ".zst"),
    "bzip2": (["bzip2", "-k"], ".bz2"),
}


def _compress(path, kind):
    tool, suffix = COMPRESSORS[kind]
    assert shutil.which(tool[0]), f"{tool[0]} is needed by this test"
    run(*tool, path)
    return path.with_name(path.name + suffix)


def _unpacked_disk(tmp_path, layout: str):
    """The /disk file of a built layout, read back by umoci (another client)."""
    bundle = tmp_path / "bundle"
    shutil.rmtree(bundle, ignore_errors=True)
    run("umoci", "unpack", "--image", layout[len("oci:"):], bundle)
    files = list((bundle / "rootfs" / "disk").iterdir())
    assert len(files) == 1
    return files[0]


def _digest(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@pytest.mark.parametrize("kind", sorted(COMPRESSORS))
@pytest.mark.parametrize("which", ["qcow2", "raw"])
def test_compressed_disks_are_built_decompressed(diskkit, qcow2, raw_disk, tmp_path, kind, which):
    disk = qcow2 if which == "qcow2" else raw_disk
    packed = _compress(disk, kind)
    layout = f"oci:{tmp_path / 'layout'}:v1"
    result = diskkit("build", packed, "-t", layout, "--json")
    assert result.code == 0, result.err
    out = json.loads(result.out)
    assert out["disk"]["path"] == f"/disk/{disk.name}"  # the name without its compression suffix
    assert out["disk"]["format"] == which
    assert f"{kind} unwrapped" in result.err
    assert _digest(_unpacked_disk(tmp_path, layout)) == _digest(disk)
    # the same image as from the disk itself
    assert diskkit("build", disk, "-t", f"oci:{tmp_path / 'plain'}:v1").last_line == out["digest"]
    assert diskkit("verify", layout).code == 0


def test_a_disk_alone_in_a_tar_gz_is_taken_out(diskkit, raw_disk, tmp_path):
    archive = tmp_path / "disk.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(raw_disk, arcname="images/disk.img")
    layout = f"oci:{tmp_path / 'layout'}:v1"
    result = diskkit("build", archive, "-t", layout, "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["disk"]["path"] == "/disk/disk.img"
    assert _digest(_unpacked_disk(tmp_path, layout)) == _digest(raw_disk)


def test_a_tar_of_several_files_is_refused(diskkit, raw_disk, qcow2, tmp_path):
    archive = tmp_path / "two.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(raw_disk, arcname="a.img")
        tar.add(qcow2, arcname="b.qcow2")
    result = diskkit("build", archive, "-t", f"oci:{tmp_path / 'layout'}")
    assert result.code == 1
    assert result.err.strip() == f"diskkit: {archive}: the archive holds 2 files (a.img, b.qcow2), not one disk; unpack it and give the disk file"
    assert not (tmp_path / "layout").exists()


def test_files_that_are_no_disk_are_refused_with_what_to_do(diskkit, tmp_path):
    yaml = tmp_path / "vmi.yaml"
    yaml.write_text("apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\n" + "# padding\n" * 100)
    elf = tmp_path / "true"
    shutil.copy("/bin/true", elf)
    small = tmp_path / "small"
    small.write_bytes(bytes(range(100)))
    expected = {
        yaml: "is a text file (it starts 'apiVersion: kubevirt.io/v1'), not a disk image; give the disk file itself (raw, qcow2, vmdk, vdi, vpc or vhdx)",
        elf: "is an ELF executable, not a disk image; give a disk (raw, qcow2, vmdk, vdi, vpc or vhdx), and a kernel with --kernel",
        small: "is 100 bytes, less than one 512-byte sector: not a disk image; give the disk file itself",
    }
    for path, rule in expected.items():
        built = diskkit("build", path, "-t", f"oci:{tmp_path / 'layout'}")
        assert (built.code, built.err.strip()) == (1, f"diskkit: {path}: {rule}")
        assert "--format qcow2" not in built.err
        converted = diskkit("convert", path, tmp_path / "out.qcow2")
        assert (converted.code, converted.err.strip()) == (1, f"diskkit: {path}: {rule}")
    assert not (tmp_path / "layout").exists() and not list(tmp_path.glob("out.qcow2*"))
    # Inside a compression the unwrapped file is judged the same way.
    packed = _compress(yaml, "gzip")
    built = diskkit("build", packed, "-t", f"oci:{tmp_path / 'layout'}")
    assert built.code == 1 and built.err.strip().startswith(f"diskkit: {packed} (unwrapped gzip: vmi.yaml): is a text file")


def test_convert_takes_a_compressed_disk(diskkit, qcow2, tmp_path):
    packed = _compress(qcow2, "xz")
    out = tmp_path / "out.img"
    result = diskkit("convert", "-O", "raw", packed, out)
    assert result.code == 0, result.err
    reference = tmp_path / "ref.img"
    run("qemu-img", "convert", "-O", "raw", qcow2, reference)
    assert _digest(out) == _digest(reference)


@pytest.mark.parametrize("what", ["xz", "yaml", "tar"])
def test_verify_flags_an_image_that_holds_no_disk(diskkit, qcow2, tmp_path, what):
    if what == "xz":
        data, rule = _compress(qcow2, "xz").read_bytes(), "is xz-compressed data, not a disk: KubeVirt would boot it as a raw disk of those bytes"
    elif what == "yaml":
        data, rule = b"apiVersion: v1\nkind: ConfigMap\n" * 40, "is a text file (it starts 'apiVersion: v1'), not a disk image"
    else:
        with tarfile.open(tmp_path / "d.tar", "w") as tar:
            tar.add(qcow2, arcname="disk.qcow2")
        data, rule = (tmp_path / "d.tar").read_bytes(), "is a tar archive, not a disk"
    layout = write_layout(tmp_path / "l", [[dir_("disk"), Member("disk/guest.img", data, mode=0o444)]])
    result = diskkit("verify", f"oci:{layout}:t")
    assert result.code == 8
    assert f"/disk/guest.img: {rule}" in result.err, result.err
    inspected = diskkit("inspect", f"oci:{layout}:t")
    assert inspected.code == 1 and f"Problem:      /disk/guest.img: {rule}" in inspected.out, inspected.out


def test_classify_knows_cdis_magic_numbers():
    assert payload.classify(b"\xfd7zXZ\x00" + bytes(600), 1 << 20) == "xz"
    assert payload.classify(b"\x1f\x8b\x08" + bytes(600), 1 << 20) == "gzip"
    assert payload.classify(b"\x28\xb5\x2f\xfd" + bytes(600), 1 << 20) == "zstd"
    assert payload.classify(b"BZh91AY&SY" + bytes(600), 1 << 20) == "bzip2"
    assert payload.classify(bytes(257) + b"ustar" + bytes(300), 1 << 20) == "tar"
    assert payload.classify(b"QFI\xfb" + bytes(600), 1 << 20) == "qcow2"
    assert payload.classify(bytes(4096), 1 << 20) == "raw"
    assert payload.classify(bytes(4096), 100) == "small"
    assert payload.classify(b"\x7fELF\x02\x01" + bytes(600), 1 << 20) == "elf"
    assert payload.classify(b"# Disk DescriptorFile\n" + b"x" * 600, 1 << 20) == "vmdk"
    assert payload.classify(b"BZh9" + bytes(600), 1 << 20) == "raw"  # "BZh" alone is not bzip2
    assert payload.classify(b"apiVersion: v1\n" * 300, 1 << 20) == "text"
    assert payload.classify(b"gnhl pc hde " * 400, 1 << 20) == "raw"  # words but no lines: a raw disk may hold any bytes
    assert payload.classify(b"\x11" * 4096, 1 << 20) == "raw"  # control bytes: a pattern-filled disk, not text

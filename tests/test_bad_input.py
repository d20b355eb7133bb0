"""Every refusal is one line naming the file and the rule, a non-zero exit, and nothing left behind."""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import make_qcow2, run


def assert_refused(result, *needles: str) -> None:
    assert result.code != 0
    lines = result.err.strip().splitlines()
    assert len(lines) == 1, result.err
    assert lines[0].startswith("diskkit: ")
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert result.out == ""


def leftovers(directory: Path, before: set[str]) -> set[str]:
    return set(os.listdir(directory)) - before


@pytest.fixture
def outdir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    return out


def build_refused(diskkit, src, outdir, *extra, needles=()):
    before = set(os.listdir(outdir))
    for dest in (f"oci:{outdir / 'layout'}", f"oci-archive:{outdir / 'image.tar'}", f"docker-archive:{outdir / 'd.tar'}"):
        result = diskkit("build", src, *extra, "-t", dest)
        assert_refused(result, *needles)
    assert leftovers(outdir, before) == set()


def test_missing_source(diskkit, tmp_path, outdir):
    build_refused(diskkit, tmp_path / "nope.qcow2", outdir, needles=("nope.qcow2", "does not exist"))


def test_directory_source(diskkit, tmp_path, outdir):
    build_refused(diskkit, tmp_path, outdir, needles=(str(tmp_path), "is a directory"))


def test_zero_length_source(diskkit, tmp_path, outdir):
    empty = tmp_path / "empty.img"
    empty.touch()
    build_refused(diskkit, empty, outdir, needles=("empty.img", "empty (0 bytes)"))


def test_truncated_qcow2(diskkit, tmp_path, outdir):
    disk = make_qcow2(tmp_path / "trunc.qcow2")
    subprocess.run(["qemu-io", "-c", "write -P 7 32M 8M", str(disk)], check=True, capture_output=True)
    os.truncate(disk, 1 << 20)
    build_refused(diskkit, disk, outdir, needles=("trunc.qcow2", "corrupt or truncated"))


def test_corrupt_qcow2_l1_table(diskkit, tmp_path, outdir):
    disk = make_qcow2(tmp_path / "corrupt.qcow2")
    with open(disk, "r+b") as f:
        header = f.read(104)
        l1_offset = struct.unpack(">Q", header[40:48])[0]
        f.seek(l1_offset)
        f.write(struct.pack(">Q", (1 << 63) | 0x7FFF0000))  # an L2 table far beyond the end of the file
    build_refused(diskkit, disk, outdir, needles=("corrupt.qcow2", "corrupt or truncated"))


def test_qcow2_that_qemu_img_cannot_open_leaves_no_check_running(tmp_path, monkeypatch):
    # `qemu-img check` starts beside `qemu-img info` once the header shows nothing outside the file;
    # when info refuses the image, the check is stopped and reaped, not left behind.
    from diskkit.errors import DiskkitError
    from diskkit.ops.build import examine_disk

    disk = make_qcow2(tmp_path / "bigclusters.qcow2")
    with open(disk, "r+b") as f:
        f.seek(20)
        f.write(struct.pack(">I", 40))  # cluster_bits: qemu opens 2^9 to 2^21 only
    started = []
    real = subprocess.Popen.__init__

    def record(self, *args, **kwargs):
        real(self, *args, **kwargs)
        started.append(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", record)
    with pytest.raises(DiskkitError, match="Unsupported cluster size"):
        examine_disk(disk)
    monkeypatch.undo()
    assert sorted(p.args[1] for p in started) == ["check", "info"]
    assert all(p.returncode is not None for p in started)  # both ended and reaped


def test_qcow2_with_backing_file(diskkit, tmp_path, outdir):
    disk = tmp_path / "backed.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", "-b", "/etc/passwd", "-F", "raw", disk)
    build_refused(diskkit, disk, outdir, needles=("backed.qcow2", "expected no backing file, but found /etc/passwd"))


def test_qcow2_with_external_data_file(diskkit, tmp_path, outdir):
    disk = tmp_path / "external.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", "-o", f"data_file={tmp_path / 'data.raw'}", disk, "16M")
    build_refused(diskkit, disk, outdir, needles=("external.qcow2", "expected no external data file"))


@pytest.mark.parametrize(
    "path,rule",
    [
        ("/disk/../etc/x", "must be an absolute path to a file without relative components"),
        ("disk/x.qcow2", "must be an absolute path to a file without relative components"),
        ("/disk//x.qcow2", "must be an absolute path to a file without relative components"),
        ("/disk/", "names a directory; give the disk file's path, e.g. /disk/disk.qcow2"),
        ("/", "must not point to root"),
    ],
)
def test_unclean_path(diskkit, qcow2, outdir, path, rule):
    build_refused(diskkit, qcow2, outdir, "--path", path, needles=(f"--path {path}", rule))


def test_destination_directory_missing(diskkit, qcow2, tmp_path):
    result = diskkit("build", qcow2, "-t", f"oci-archive:{tmp_path / 'no/such/dir/x.tar'}")
    assert_refused(result, "no/such/dir", "does not exist")


@pytest.fixture
def public_tmp():
    # setpriv'd processes need to traverse the directory; pytest's own tmp root is 0700.
    with tempfile.TemporaryDirectory(prefix="diskkit-public-") as name:
        os.chmod(name, 0o755)
        yield Path(name)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="drops privileges with setpriv, which needs root")


@needs_root
def test_unreadable_source(diskkit, public_tmp):
    disk = make_qcow2(public_tmp / "secret.qcow2")
    os.chmod(disk, 0o600)
    out = public_tmp / "out"
    out.mkdir(mode=0o777)
    os.chmod(out, 0o777)
    result = diskkit("build", disk, "-t", f"oci:{out / 'layout'}", user="65534")
    assert_refused(result, "secret.qcow2", "cannot be read")
    assert os.listdir(out) == []


@needs_root
def test_unwritable_destination(diskkit, public_tmp):
    disk = make_qcow2(public_tmp / "ok.qcow2")
    os.chmod(disk, 0o644)
    out = public_tmp / "readonly"
    out.mkdir()
    os.chmod(out, 0o755)
    for dest in (f"oci:{out / 'layout'}", f"oci-archive:{out / 'x.tar'}", f"docker-archive:{out / 'd.tar'}"):
        result = diskkit("build", disk, "-t", dest, user="65534")
        assert_refused(result, str(out), "not writable")
    assert os.listdir(out) == []


def test_sigterm_mid_build_leaves_nothing(tmp_path):
    big = tmp_path / "big.img"
    with open(big, "wb") as f:  # incompressible enough that packaging takes a while
        for _ in range(256):
            f.write(os.urandom(1 << 20))
    out = tmp_path / "out"
    out.mkdir()
    for dest in (f"oci:{out / 'layout'}", f"oci-archive:{out / 'x.tar'}"):
        proc = subprocess.Popen(
            [sys.executable, "-m", "diskkit", "build", str(big), "--compression", "zstd", "--level", "19", "-t", dest],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 60
        while not os.listdir(out) and time.monotonic() < deadline:  # wait until staging has begun
            time.sleep(0.02)
        assert os.listdir(out), "build never started writing"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode != 0
        assert b"interrupted" in err
        assert os.listdir(out) == []


@pytest.mark.parametrize("transport", ["oci", "oci-archive", "dir", "docker-archive"])
def test_a_stop_signal_while_the_staging_is_made_is_raised_once_it_can_be_aborted(tmp_path, transport):
    """The signal lands in the one window the subprocess test above can only hit by chance: the
    staging exists and no `with` holds it yet. Held until the destination can abort, it unwinds
    as any other SIGTERM and leaves nothing."""
    from diskkit import interrupts
    from diskkit.oci.reference import parse_ref
    from diskkit.transports import open_destination

    dest = open_destination(parse_ref(f"{transport}:{tmp_path / 'out'}" + (":x:1" if transport == "docker-archive" else "")))
    made = type(dest).begin

    def begin_then_signalled(self):
        made(self)
        assert any(p.name.startswith(".out.diskkit-") for p in tmp_path.iterdir())
        os.kill(os.getpid(), signal.SIGTERM)

    dest.begin = begin_then_signalled.__get__(dest)
    previous = signal.signal(signal.SIGTERM, interrupts.unwind)
    try:
        with pytest.raises(KeyboardInterrupt):
            with dest:
                pytest.fail("the body ran although SIGTERM arrived before it")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert list(tmp_path.iterdir()) == []


def test_convert_refuses_bad_input_and_writes_atomically(diskkit, tmp_path):
    backed = tmp_path / "backed.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", "-b", "/etc/passwd", "-F", "raw", backed)
    before = set(os.listdir(tmp_path))
    assert_refused(diskkit("convert", backed, tmp_path / "out.qcow2"), "backed.qcow2", "expected no backing file")
    assert_refused(diskkit("convert", tmp_path / "missing.vmdk", tmp_path / "out.qcow2"), "missing.vmdk", "does not exist")
    assert leftovers(tmp_path, before) == set()

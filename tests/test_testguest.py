"""The test guest itself: build output shape, disk reporting, stamp persistence."""

import hashlib
import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

try:
    from . import testguest as tg
except ImportError:
    import testguest as tg

MIB = 1024 * 1024
DATA_HEAD = b"DISKKIT-DATA-01\n"  # 16 bytes
ISO_FILES = {
    "meta-data": "instance-id: iid-testguest\nlocal-hostname: testguest\n",
    "user-data": "#cloud-config\nhostname: testguest\n",
}


@pytest.fixture(scope="module")
def guest_dir() -> Path:
    return tg.ensure_testguest()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_qemu_system_available():
    assert shutil.which("qemu-system-x86_64"), "qemu-system-x86_64 missing (apt-get install qemu-system-x86)"


def test_qcow2_shape(guest_dir):
    info = json.loads(subprocess.check_output(
        ["qemu-img", "info", "--output=json", str(guest_dir / "testguest.qcow2")]))
    assert info["format"] == "qcow2"
    assert info["virtual-size"] == 64 * MIB
    assert "backing-filename" not in info
    assert "full-backing-filename" not in info
    for name in ("vmlinuz", "initrd.img"):
        assert (guest_dir / name).stat().st_size > 0


def test_the_suites_key_for_a_built_guest_is_the_one_build_sh_wrote(guest_dir):
    # Every file build.sh puts in its key must be in tests/testguest.py's too: otherwise the guest is
    # never current to the suite, and every ensure_testguest() runs build.sh again (1-2 s each, hundreds of calls).
    assert (guest_dir / "recipe.sha256").is_file()
    assert tg.guest_is_current(guest_dir), (guest_dir / "recipe.sha256").read_text()


def test_a_fresh_build_says_nothing_a_newcomer_reads_as_a_failure(guest_dir, tmp_path):
    # scripts/demo.sh builds the guest first; the cloud kernel's missing AHCI, which the guest does
    # without (its VMs use virtio), was printed as "WARNING: not available in linux-image-...".
    out = tmp_path / "guest"
    (out / "cache").mkdir(parents=True)
    for deb in (guest_dir / "cache").glob("linux-image-*.deb"):
        shutil.copy(deb, out / "cache" / deb.name)  # the kernel package as downloaded: no network needed
    built = subprocess.run(["bash", str(tg.BUILD_SH), str(out)], capture_output=True, text=True, timeout=600,
                           env={k: v for k, v in os.environ.items() if k != "TESTGUEST_KERNEL_FLAVOR"})
    assert built.returncode == 0, built.stderr
    assert "WARNING" not in built.stderr, built.stderr
    assert ("build.sh: note: the cloud-amd64 kernel has no AHCI (libahci ahci), as expected: this guest sees no SATA disks or"
            " CD-ROMs; its test VMs use virtio (TESTGUEST_KERNEL_FLAVOR=amd64 has AHCI)") in built.stderr.splitlines(), built.stderr
    for disk in ("testguest.qcow2", "testguest-poweroff.qcow2"):
        assert sha256(out / disk) == sha256(guest_dir / disk)  # the same guests, reproducibly


@pytest.fixture
def disks(guest_dir, tmp_path):
    overlay = tmp_path / "boot.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b",
                    str(guest_dir / "testguest-poweroff.qcow2"), "-F", "qcow2", str(overlay)], check=True)
    data = tmp_path / "data.raw"
    with open(data, "wb") as f:
        f.write(DATA_HEAD)
        f.truncate(4 * MIB)
    src = tmp_path / "iso"
    src.mkdir()
    for name, content in ISO_FILES.items():
        (src / name).write_text(content)
    iso = tmp_path / "seed.iso"
    subprocess.run(["xorriso", "-as", "mkisofs", "-quiet", "-V", "cidata", "-J", "-r",
                    "-o", str(iso), str(src)], check=True, capture_output=True)
    return [
        (overlay, {"format": "qcow2"}),
        (data, {"format": "raw", "serial": "DKDATA1"}),
        (iso, {"format": "raw", "if": "ide-cd"}),
    ]


def test_boot_reports_disks_and_persists_stamps(guest_dir, disks):
    base_sum = sha256(guest_dir / "testguest-poweroff.qcow2")

    first = tg.parse_console(tg.boot_qemu(disks))
    assert first["ready"] and first["done"], first
    assert first["warnings"] == []

    assert set(first["disks"]) == {"vda", "vdb", "sr0"}
    boot = first["disks"]["vda"]
    assert boot["size"] == 64 * MIB and not boot["ro"]
    assert boot["head"][:4] == "33c0"  # syslinux mbr.bin: xor ax,ax
    data = first["disks"]["vdb"]
    assert data == {"size": 4 * MIB, "ro": False, "serial": "DKDATA1", "head": DATA_HEAD.hex()}
    assert first["disks"]["sr0"]["ro"]

    assert set(first["isos"]) == {"sr0"}
    iso = first["isos"]["sr0"]
    assert iso["label"] == "cidata"
    assert iso["files"] == {"/" + k: v for k, v in ISO_FILES.items()}
    assert iso["sizes"] == {"/" + k: len(v) for k, v in ISO_FILES.items()}

    assert first["stamps"] == {"vda": (0, 1), "vdb": (0, 1)}
    # one vCPU and the 256 MiB qemu was given, less what the kernel keeps for itself
    assert first["cpus"] == 1 and 200 * 1024 < first["mem_kib"] <= 256 * 1024, first

    second = tg.parse_console(tg.boot_qemu(disks))
    assert second["ready"] and second["done"], second
    assert second["stamps"] == {"vda": (1, 2), "vdb": (1, 2)}
    assert second["isos"] == first["isos"]

    # the stamp is really in the data disk's last sector, the first bytes untouched
    raw = disks[1][0].read_bytes()
    assert raw[-512:].startswith(b"DKSTAMP 2\n") and raw[:16] == DATA_HEAD
    # the built image is never modified
    assert sha256(guest_dir / "testguest-poweroff.qcow2") == base_sum


def test_kernel_boot(guest_dir, tmp_path):
    data = tmp_path / "scsi.raw"
    with open(data, "wb") as f:
        f.write(DATA_HEAD)
        f.truncate(1 * MIB)
    out = tg.parse_console(tg.boot_qemu(
        [(data, {"format": "raw", "if": "scsi-hd", "serial": "SCSI0"})],
        kernel=guest_dir / "vmlinuz", initrd=guest_dir / "initrd.img"))
    assert out["ready"] and out["done"], out
    assert out["disks"] == {"sda": {"size": MIB, "ro": False, "serial": "SCSI0",
                                    "head": DATA_HEAD.hex()}}
    assert out["stamps"] == {"sda": (0, 1)}


def _qmp(sock: Path, command: str) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(sock))
        f = s.makefile("rw")
        f.readline()  # the greeting
        for cmd in ("qmp_capabilities", command):
            f.write(json.dumps({"execute": cmd}) + "\n")
            f.flush()
            while "return" not in (answer := json.loads(f.readline())) and "error" not in answer:
                pass  # events before the answer
            assert "return" in answer, answer


def test_the_guest_stays_up_until_its_power_button_is_pressed(guest_dir, tmp_path):
    # What a user boots (the demo, the examples) behaves as a real guest: it reports, then waits.
    overlay = tmp_path / "up.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(guest_dir / "testguest.qcow2"), "-F", "qcow2", str(overlay)], check=True)
    qmp = tmp_path / "qmp.sock"
    guest = tg.start_qemu([(overlay, {"format": "qcow2"})], extra_args=["-qmp", f"unix:{qmp},server=on,wait=off"])
    try:
        guest.wait_for("HOLD seconds=forever")
        assert guest.proc.poll() is None
        _qmp(qmp, "system_powerdown")  # the ACPI power button
        guest.proc.wait(timeout=120)
    finally:
        guest.stop()
    report = tg.parse_console(guest.text())
    assert report["done"] and report["acpi_poweroff"], guest.text()

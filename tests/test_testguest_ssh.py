"""The test guest's ssh server (dropbear), alone under qemu's user-mode network with a host forward.

The keys reach the guest where KubeVirt's accessCredentials put them (pkg/cloud-init/cloud-init.go:
NoCloud meta-data `public-keys`, ConfigDrive meta_data.json `public_keys`) and where a cloud-config
user writes them (user-data `ssh_authorized_keys`).
"""

import json
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

try:
    from . import testguest as tg
except ImportError:
    import testguest as tg


@pytest.fixture(scope="module")
def guest_dir() -> Path:
    return tg.ensure_testguest()


def keypair(directory: Path, name: str) -> tuple[Path, str]:
    key = directory / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)], check=True)
    return key, (directory / f"{name}.pub").read_text().strip()


def iso(directory: Path, label: str, files: dict[str, str]) -> Path:
    src = directory / f"{label}-src"
    for name, content in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(content)
    out = directory / f"{label}.iso"
    subprocess.run(["xorriso", "-as", "mkisofs", "-quiet", "-V", label, "-J", "-r", "-o", str(out), str(src)],
                   check=True, capture_output=True)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ssh(port: int, key: Path, command: str) -> subprocess.CompletedProcess:
    assert shutil.which("ssh"), "ssh missing (apt-get install openssh-client)"
    return subprocess.run(
        ["ssh", "-F", "/dev/null", "-i", str(key), "-p", str(port), "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
         "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "ConnectTimeout=60",
         "root@127.0.0.1", command], capture_output=True, text=True, timeout=180)


def boot(guest_dir: Path, tmp_path: Path, seed: Path, *extra: tuple[Path, dict]):
    overlay = tmp_path / "boot.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(guest_dir / "testguest-poweroff.qcow2"),
                    "-F", "qcow2", str(overlay)], check=True)
    port = free_port()
    vm = tg.start_qemu([(overlay, {"format": "qcow2"}), (seed, {"format": "raw", "if": "ide-cd"}), *extra],
                       extra_args=["-netdev", f"user,id=n0,hostfwd=tcp:127.0.0.1:{port}-:22",
                                   "-device", "virtio-net-pci,netdev=n0"])
    return vm, port


def test_nocloud_keys_from_meta_data_and_user_data(guest_dir, tmp_path):
    meta_key, meta_pub = keypair(tmp_path, "meta")
    user_key, user_pub = keypair(tmp_path, "user")
    seed = iso(tmp_path, "cidata", {
        "meta-data": json.dumps({"instance-id": "i", "local-hostname": "ssh-host", "public-keys": {"0": meta_pub + "\n"}}, separators=(",", ":")),
        "user-data": f"#cloud-config\nhostname: g\nssh_authorized_keys:\n  - {user_pub}\nruncmd: []\n",
    })
    vm, port = boot(guest_dir, tmp_path, seed)
    try:
        console = tg.parse_console(vm.wait_for("DISKKIT-TESTGUEST DONE"))
        assert console["ssh"] == {"keys": 2, "started": True, "why": ""}, vm.text()
        done = ssh(port, meta_key, "echo hello")
        assert (done.returncode, done.stdout) == (0, "hello\n"), done.stderr
        done = ssh(port, user_key, "exit 7")
        assert done.returncode == 7, done.stderr
    finally:
        vm.stop()


def test_configdrive_keys(guest_dir, tmp_path):
    key, pub = keypair(tmp_path, "cd")
    seed = iso(tmp_path, "config-2", {
        "openstack/latest/meta_data.json": json.dumps({"instance_id": "i", "uuid": "u", "public_keys": {"0": pub}}),
        "openstack/latest/user_data": "#cloud-config\n",
    })
    vm, port = boot(guest_dir, tmp_path, seed)
    try:
        vm.wait_for("DISKKIT-TESTGUEST DONE")
        done = ssh(port, key, "cat /root/.ssh/authorized_keys")
        assert (done.returncode, done.stdout) == (0, pub + "\n"), done.stderr
    finally:
        vm.stop()


def test_no_ssh_disk_keeps_dropbear_off(guest_dir, tmp_path):
    _, pub = keypair(tmp_path, "k")
    seed = iso(tmp_path, "cidata", {"meta-data": "{}", "user-data": f"#cloud-config\nssh_authorized_keys:\n  - {pub}\n"})
    marker = tmp_path / "marker.raw"
    marker.write_bytes(b"\0" * 1024 * 1024)
    vm, port = boot(guest_dir, tmp_path, seed, (marker, {"format": "raw", "serial": "no-ssh"}))
    try:
        text = vm.wait_for("DISKKIT-TESTGUEST DONE")
        assert tg.parse_console(text)["ssh"] == {"keys": 1, "started": False, "why": "no-ssh disk"}, text
        vm.proc.wait(timeout=60)  # without ssh the -poweroff guest powers off once it has reported
    finally:
        vm.stop()

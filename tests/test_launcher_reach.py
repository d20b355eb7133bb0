"""Reaching a running guest as virtctl users do, end to end as the qemu user (UID 107): `launcher ssh`
with a key from spec.accessCredentials (pkg/cloud-init/cloud-init.go puts it in the cloud-init meta
data; the test guest's dropbear reads it there), and `launcher test`, the boot smoke test."""

from __future__ import annotations

import base64
import json
import os
import pwd
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.testguest import parse_console
from tests.vmhost import NOREG, QEMU_UID, assert_clean


def no_forwards_left(user) -> None:
    """No `launcher port-forward` (ssh's ProxyCommand) of this user's cache outlives the ssh it served
    (another file's `launcher test`, running meanwhile on another worker, has forwards of its own)."""
    mine = f"DISKKIT_CACHE={user.cache}".encode()
    left = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if proc.name.isdigit() and b"port-forward" in cmdline and b"--stdio" in cmdline and mine in environ:
            left.append(b" ".join(cmdline).decode())
    assert not left, left


def keypair(directory: Path, name: str) -> tuple[Path, str]:
    key = directory / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(key)], check=True)
    gid = pwd.getpwuid(QEMU_UID).pw_gid
    for path in (key, directory / f"{name}.pub"):
        os.chown(path, QEMU_UID, gid)  # ssh takes a private key only from its owner
    return key, (directory / f"{name}.pub").read_text().strip()


def credential_vmi(qemu_user, name: str, image: str, method: str) -> Path:
    """The test guest with a cloud-init disk of `method`'s kind and the Secret `keys` as its access credential."""
    kind = {"noCloud": "cloudInitNoCloud", "configDrive": "cloudInitConfigDrive"}[method]
    path = qemu_user.write_vmi(name, image, extra=[({"name": "ci", "disk": {"bus": "virtio"}},
                                                    {"name": "ci", kind: {"userData": "#cloud-config\n"}})])
    doc = json.loads(path.read_text())
    doc["spec"]["accessCredentials"] = [{"sshPublicKey": {"source": {"secret": {"secretName": "keys"}},
                                                          "propagationMethod": {method: {}}}}]
    path.write_text(json.dumps(doc))
    return path


def manifests(qemu_user, public_key: str) -> Path:
    directory = qemu_user.root / "manifests"
    directory.mkdir(exist_ok=True)
    (directory / "secret.yaml").write_text(json.dumps({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "keys", "namespace": "default"},
        "data": {"ed25519": base64.b64encode(public_key.encode()).decode()}}))
    return directory


@dataclass
class CredentialGuest:
    """The test guest booted with a key as its access credential, up and serving ssh; its console at
    that point. One boot per propagation method answers every check of it below."""
    method: str
    name: str
    key: Path
    public: str
    console: str


@pytest.fixture(scope="module", params=["noCloud", "configDrive"])
def credential_guest(request, qemu_user, guest_image) -> CredentialGuest:
    method = request.param
    key, public = keypair(qemu_user.root, f"key-{method}")
    name = f"cred-{method.lower()}"
    vmi = credential_vmi(qemu_user, name, guest_image, method)
    started = qemu_user.launcher("run", NOREG, "--manifests", manifests(qemu_user, public), "--console", "--wait-for", "SSH keys=1 started",
                                 "--timeout", "240", vmi)
    try:
        assert started.code == 0, started.out[-1500:] + started.err
        yield CredentialGuest(method, name, key, public, started.out)
    finally:
        qemu_user.launcher("stop", name)
    assert_clean(qemu_user, f"default_{name}")
    no_forwards_left(qemu_user)


def test_access_credentials_reach_the_guests_cloud_init_disk(credential_guest):
    path = {"noCloud": "/meta-data", "configDrive": "/openstack/latest/meta_data.json"}[credential_guest.method]
    isos = parse_console(credential_guest.console)["isos"]
    meta = next(iso["files"][path] for iso in isos.values() if path in iso["files"])
    key = "public-keys" if credential_guest.method == "noCloud" else "public_keys"
    assert json.loads(meta)[key] == {"0": credential_guest.public}


def test_ssh_with_a_key_from_access_credentials(qemu_user, credential_guest):
    key, name = credential_guest.key, credential_guest.name
    # No host key options: the test guest prints no keys (no cloud-init), so the first key its
    # server shows is trusted for this VM alone, said in one line, and kept in its run directory.
    hello = qemu_user.launcher("ssh", "-i", key, f"root@vmi/{name}", "--", "echo", "hello")
    assert (hello.code, hello.out) == (0, "hello\n"), hello.err
    known_hosts = qemu_user.cache / "run" / f"default_{name}" / "known_hosts"
    assert f"{name}: no host keys on its console (they come from cloud-init); trusting the key its ssh server shows first, " \
           f"for this VM only ({known_hosts})" in hello.err.splitlines()[0], hello.err
    status = qemu_user.launcher("ssh", "-i", key, "-l", "root", "-c", "exit 7", name)
    assert status.code == 7, status.err
    assert "trusting the key" not in status.err  # once trusted, checked
    alias, kind, _ = known_hosts.read_text().split()[:3]  # as ssh wrote it (maybe hashed)
    other = qemu_user.root / f"other-{credential_guest.method}"  # a man in the middle's key of the same type
    key_type = {"ssh-ed25519": "ed25519", "ssh-rsa": "rsa"}.get(kind, "ecdsa")
    subprocess.run(["ssh-keygen", "-q", "-t", key_type, "-N", "", "-f", str(other)], check=True)
    known_hosts.write_text(f"{alias} {kind} {other.with_suffix('.pub').read_text().split()[1]}\n")
    changed = qemu_user.launcher("ssh", "-i", key, "-c", "true", f"root@{name}")
    assert changed.code == 255 and "Host key verification failed" in changed.err, changed
    no_forwards_left(qemu_user)


@pytest.mark.parametrize("credential_guest", ["noCloud"], indirect=True)  # one dump of this file's guests is enough
def test_an_unprivileged_launchers_vm_dumps_its_memory_into_the_users_claim(qemu_user, credential_guest):
    """`launcher memory-dump get` from a launcher that is not root: its own libvirt writes the dump,
    which lands in the user's claim as the user's file (the root-started case, and planted links, are
    tests/test_trust_vmview.py's)."""
    claim = qemu_user.root / "dump-claim"
    claim.mkdir()
    os.chown(claim, QEMU_UID, QEMU_UID)
    dumped = qemu_user.launcher("memory-dump", "get", credential_guest.name, "--claim-name", "dumps", "--pvc", f"dumps={claim}", "--json")
    assert dumped.code == 0, dumped.err
    answer = json.loads(dumped.out)
    path = Path(answer["path"])
    assert path.parent == claim and path.name.startswith(f"{credential_guest.name}-dumps-") and path.name.endswith(".memory.dump")
    st = os.lstat(path)
    assert (st.st_uid, oct(st.st_mode & 0o777), st.st_size) == (QEMU_UID, "0o600", answer["size"]) and st.st_size > 0
    with open(path, "rb") as dump:
        assert dump.read(4) == b"\x7fELF"
    removed = qemu_user.launcher("memory-dump", "remove", "--json", credential_guest.name)
    assert removed.code == 0 and json.loads(removed.out)["claimName"] == "dumps", removed.err


def test_ssh_to_a_vm_that_is_not_there(qemu_user):
    result = qemu_user.launcher("ssh", "root@vmi/nowhere", "--", "true")
    assert result.code != 0
    assert result.err.strip().splitlines() == ["launcher: nowhere: no VM of this name was started from this cache (yet)"]


def test_launcher_test_passes_on_the_test_guest(qemu_user, guest_image):
    result = qemu_user.launcher("test", NOREG, "--json", "--timeout", "240", "--memory", "128Mi", guest_image)
    assert result.code == 0, result.err
    out = json.loads(result.out)
    assert out["result"] == "pass" and out["exitStatus"] == 0 and out["stdout"] == "hello\n", out
    assert out["command"] == "echo hello" and out["bootToSshSeconds"] > 0
    assert out["images"][guest_image].startswith("sha256:")
    # The accelerator and why, in the result and in the one line the run says.
    assert out["accel"]["accelerator"] in ("kvm", "tcg") and out["accel"]["reason"], out
    assert f"launcher: accelerator: {'KVM' if out['accel']['accelerator'] == 'kvm' else 'TCG (software emulation)'}: {out['accel']['reason']}" in result.err.splitlines()
    # Who it logged in as, and why: the test guest names no user (no label, no cloud-init), so root.
    said = [line for line in result.err.splitlines() if ": logging in as " in line]
    assert said and said[0].endswith(": logging in as root: neither a label io.diskkit.default-user nor cloud-init's console names the image's user"), result.err
    assert_clean(qemu_user, out["vmi"].replace("/", "_"))
    failed = qemu_user.launcher("test", NOREG, "--timeout", "240", "--memory", "128Mi", guest_image, "--", "exit", "5")
    assert failed.code == 1, failed.err
    assert failed.err.strip().splitlines()[-1].endswith(": the command exited with 5")
    no_forwards_left(qemu_user)


def no_ssh_vmi(qemu_user, name, image, *serials):
    extra = [({"name": f"d{i}", "serial": serial, "disk": {"bus": "virtio"}}, {"name": f"d{i}", "emptyDisk": {"capacity": "1Mi"}})
             for i, serial in enumerate(serials)]
    return qemu_user.write_vmi(name, image, extra=extra)


def test_launcher_test_fails_on_a_guest_without_ssh(qemu_user, guest_image):
    # the test guest with dropbear off powers off by itself: the VM stopped before ssh answered
    vmi = no_ssh_vmi(qemu_user, "nossh", guest_image, "no-ssh")
    result = qemu_user.launcher("test", NOREG, "--timeout", "240", vmi)
    assert result.code == 3, result.err
    assert result.err.strip().splitlines()[-1] == "launcher: FAIL default/nossh: the VM stopped before ssh answered"
    assert_clean(qemu_user, "default_nossh")


def test_launcher_test_times_out_on_a_guest_that_stays_up_without_ssh(qemu_user, guest_image):
    vmi = no_ssh_vmi(qemu_user, "silent", guest_image, "no-ssh", "hold-600")
    result = qemu_user.launcher("test", NOREG, "--json", "--timeout", "12", vmi)  # meant to expire: either reason below
    assert result.code == 4, result.err
    out = json.loads(result.out)
    assert out["result"] == "fail" and out["exitStatus"] is None, out
    assert out["reason"].startswith(("no ssh login within --timeout", "the VM did not start within --timeout")), out
    assert_clean(qemu_user, "default_silent")

"""The real cloud test guest (images/cloudguest): Debian 12 with systemd, cloud-init, sshd,
qemu-guest-agent and sudo. A boot costs about a minute of CPU under TCG, so checks share one boot.

    ensure_cloudguest()   build it once per machine (/var/cache/diskkit-test/cloudguest, or $DISKKIT_CLOUDGUEST_DIR), keyed
                          by build.sh's sha256, under a file lock so parallel workers build it once
    booted(registry)      push it, boot it through the launcher as the qemu user (KubeVirt's NoCloud disk
                          and accessCredentials: the default user's key through cloud-init, root's through
                          the guest agent), wait for `login:`, ssh in at once; yields a CloudGuest
    cloud_guest           the pytest fixture around booted(), module-scoped: import it into a test module.
                          For one boot across modules, import it into conftest.py (as the registries are)
                          and make it session-scoped; its checks read `first_ssh` or ssh in again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pwd
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from tests.conftest import Result, run_diskkit
from tests.testguest import build_once
from tests.vmhost import NOREG, QEMU_UID, QemuUser, qemu_scratch

REPO = Path(__file__).resolve().parent.parent
MACHINE_CACHE = Path(os.environ.get("DISKKIT_TEST_CACHE", "/var/cache/diskkit-test"))
BUILD_SH = REPO / "images" / "cloudguest" / "build.sh"
IMAGE = "cloudguest.qcow2"
NAME = "cloudguest"
# What the first ssh runs, one KEY=VALUE line each: the checks of the boot read them.
FIRST_SSH = ("echo user=$(id -un); echo cloud-init=$(cloud-init status --wait | tail -n 1); "
             "echo sudo=$(sudo -n id -un); echo agent=$(dpkg-query -W -f='${Status}' qemu-guest-agent); "
             "echo ed25519=$(cut -d' ' -f1,2 /etc/ssh/ssh_host_ed25519_key.pub)")


def cloudguest_dir() -> Path:
    """Outside the checkout, so a fresh clone on the same machine (CI's) does not build it again: a
    minute or two of mmdebstrap and mke2fs. The recipe's hash decides whether it is current."""
    env = os.environ.get("DISKKIT_CLOUDGUEST_DIR")
    return Path(env).resolve() if env else MACHINE_CACHE / "cloudguest"


def _is_current(out: Path) -> bool:
    try:
        recipe = (out / "recipe.sha256").read_text().strip()
    except FileNotFoundError:
        return False
    return (out / IMAGE).is_file() and recipe == hashlib.sha256(BUILD_SH.read_bytes()).hexdigest()


def ensure_cloudguest() -> Path:
    """The directory holding cloudguest.qcow2 and default-user, built by images/cloudguest/build.sh when missing or stale."""
    return build_once(cloudguest_dir(), BUILD_SH, _is_current)


@dataclass
class CloudGuest:
    user: QemuUser
    image: str  # the containerDisk it booted
    key: Path  # the private key its accessCredential gave cloud-init
    public_key: str
    default_user: str  # cloud-init's, as the build read it from the image
    agent_key: Path  # the private key root's qemuGuestAgent accessCredential gives, through the guest agent
    manifests: Path  # the --manifests directory the VM was started with (Secrets cloudguest-key, agent-key)
    started: Result  # launcher run --detach --wait-for login:
    first_ssh: Result  # launcher ssh straight after, with no ssh options

    @property
    def run_dir(self) -> Path:
        return self.user.cache / "run" / f"default_{NAME}"

    def ssh(self, command: str, *options: str) -> Result:
        return self.user.launcher("ssh", f"{self.default_user}@vmi/{NAME}", "-i", self.key, *options, "-c", command)

    def console(self) -> str:
        return self.user.launcher("logs", NAME).out

    def reported(self) -> dict[str, str]:
        """What the first ssh printed, KEY=VALUE lines."""
        return dict(line.split("=", 1) for line in self.first_ssh.out.splitlines() if "=" in line)


def _keypair(directory: Path, name: str = "cloudguest-key") -> tuple[Path, str]:
    key = directory / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "cloudguest-test", "-f", str(key)], check=True)
    for path in (key, key.with_suffix(".pub")):
        os.chown(path, QEMU_UID, pwd.getpwuid(QEMU_UID).pw_gid)  # ssh takes a private key only from its owner
    return key, key.with_suffix(".pub").read_text().strip()


def write_secret(manifests: Path, name: str, data: dict[str, str]) -> None:
    """A Secret in the VM's --manifests directory, written whole (what `kubectl apply` of a changed Secret is here)."""
    path = manifests / f"{name}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": data}))
    tmp.replace(path)


@contextlib.contextmanager
def booted(registry) -> Iterator[CloudGuest]:
    built = ensure_cloudguest()
    image = f"{registry.host}/launcher/cloudguest:v1"
    pushed = run_diskkit("build", NOREG, "--no-lazy", built / IMAGE, "-t", image)
    assert pushed.code == 0, pushed.err
    with qemu_scratch("cloud-") as root:
        user = QemuUser(root)
        key, public = _keypair(root)
        manifests = root / "manifests"
        manifests.mkdir()
        (manifests / "key.json").write_text(json.dumps({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "cloudguest-key"},
                                                        "stringData": {"key": public}}))
        agent_key, agent_public = _keypair(root, "agent-key")
        write_secret(manifests, "agent-key", {"key": agent_public})
        vmi = root / "cloudguest.json"
        vmi.write_text(json.dumps({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": NAME},
            "spec": {"domain": {"resources": {"requests": {"memory": "1Gi"}},
                                "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}, {"name": "cloudinit", "disk": {"bus": "virtio"}}]}},
                     "accessCredentials": [{"sshPublicKey": {"source": {"secret": {"secretName": "cloudguest-key"}},
                                                             "propagationMethod": {"noCloud": {}}}},
                                           {"sshPublicKey": {"source": {"secret": {"secretName": "agent-key"}},
                                                             "propagationMethod": {"qemuGuestAgent": {"users": ["root"]}}}}],
                     "volumes": [{"name": "root", "containerDisk": {"image": image}},
                                 {"name": "cloudinit", "cloudInitNoCloud": {"userData": "#cloud-config\ntimezone: UTC\n"}}]}}))
        started = user.launcher("run", NOREG, "--manifests", manifests, "--detach", "--wait-for", "login:", "--timeout", "600", vmi, timeout=660)
        try:
            assert started.code == 0, started.out[-2000:] + started.err
            default_user = (built / "default-user").read_text().strip()
            first = user.launcher("ssh", f"{default_user}@vmi/{NAME}", "-i", key, "-c", FIRST_SSH)
            yield CloudGuest(user, image, key, public, default_user, agent_key, manifests, started, first)
        finally:
            user.launcher("stop", NAME)


@pytest.fixture(scope="module")
def cloud_guest(registry) -> Iterator[CloudGuest]:
    with booted(registry) as guest:
        yield guest

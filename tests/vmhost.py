"""The unprivileged side of the launcher tests: the qemu user (UID 107), its libvirt session
daemon (one per test module, through a HOME of its own) and a cache, and VMIs written for it."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from tests import leftovers, libvmi
from tests.conftest import launcher_command, run_diskkit, run_launcher
from tests.testguest import ensure_testguest

QEMU_UID = 107
NOREG = "--tls-verify=false"
DONE = "DISKKIT-TESTGUEST DONE"


CAPS = Path(".cache/libvirt/qemu/cache/capabilities")


def _capabilities_seed() -> Path:
    """QEMU's capabilities as a session daemon of this process first probed them (seconds of qemu
    runs under load), for every later HOME: libvirt checks a cached file against the binary, the
    kernel and the host CPU before it believes it, so a seeded daemon starts in a fraction of a second."""
    seed = Path(tempfile.gettempdir()) / "libvirt-capabilities"
    if any(seed.glob("*.xml")):
        return seed
    with tempfile.TemporaryDirectory(prefix="caps-") as probe:
        home = Path(probe) / "home"
        home.mkdir()
        os.chown(home, QEMU_UID, pwd.getpwuid(QEMU_UID).pw_gid)
        os.chmod(probe, 0o755)
        cmd = ["setpriv", f"--reuid={QEMU_UID}", f"--regid={QEMU_UID}", "--clear-groups", "virsh", "-c", "qemu:///session", "uri"]
        subprocess.run(cmd, env={**os.environ, "HOME": str(home), "XDG_RUNTIME_DIR": "", "XDG_CACHE_HOME": "", "XDG_CONFIG_HOME": ""},
                       capture_output=True, check=True, timeout=120)
        leftovers.end_processes_of(Path(probe))
        seed.mkdir(exist_ok=True)
        for xml in (home / CAPS).glob("*.xml"):
            shutil.copy2(xml, seed / xml.name)
    return seed


def seed_capabilities(home: Path) -> None:
    """Give a new HOME of the qemu user the probed capabilities before its session daemon starts."""
    gid = pwd.getpwuid(QEMU_UID).pw_gid
    target = home
    for part in CAPS.parts:
        target = target / part
        target.mkdir(exist_ok=True)
        os.chown(target, QEMU_UID, gid)
    for xml in _capabilities_seed().glob("*.xml"):
        shutil.copy2(xml, target / xml.name)
        os.chown(target / xml.name, QEMU_UID, gid)


class QemuUser:
    """Where the qemu user works: a HOME (one libvirt session daemon for the whole run) and a cache."""

    def __init__(self, root: Path):
        self.root = root
        self.home = root / "home"
        self.cache = root / "cache"
        for d in (self.home, self.cache):
            d.mkdir()
            os.chown(d, QEMU_UID, pwd.getpwuid(QEMU_UID).pw_gid)
        seed_capabilities(self.home)
        self.env = {"HOME": str(self.home), "XDG_RUNTIME_DIR": "", "XDG_CACHE_HOME": "", "DISKKIT_CACHE": str(self.cache)}

    def launcher(self, *args, timeout: float = 300):
        return run_launcher(*args, env=self.env, user=str(QEMU_UID), timeout=timeout)

    def popen(self, *args) -> subprocess.Popen:
        return subprocess.Popen(launcher_command(*args, user=str(QEMU_UID)), env={**os.environ, "CI": "true", **self.env},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def virsh(self, *args) -> str:
        cmd = ["setpriv", f"--reuid={QEMU_UID}", f"--regid={QEMU_UID}", "--clear-groups", "virsh", "-c", "qemu:///session", *args]
        return subprocess.run(cmd, env={**os.environ, **self.env}, capture_output=True, text=True, check=True).stdout

    def write_vmi(self, name: str, image: str, path: str | None = None, serial: str | None = None,
                  extra: list[tuple[dict, dict]] = (), domain: dict | None = None) -> Path:
        """A VMI booting `image` from a virtio containerDisk, plus `extra` (disk, volume) pairs."""
        vmi = libvmi.new(name, libvmi.with_container_disk("root", image, path=path, serial=serial), libvmi.with_domain(**(domain or {})))
        for disk, volume in extra:
            vmi["spec"]["domain"]["devices"]["disks"].append(disk)
            vmi["spec"]["volumes"].append(volume)
        return libvmi.write(vmi, self.root)


@contextlib.contextmanager
def qemu_scratch(prefix: str) -> Iterator[Path]:
    """A directory for the qemu user under /tmp, world-traversable (pytest's own tmp dirs are
    private to root); the libvirt session daemons started with a HOME inside it are stopped after."""
    try:
        pwd.getpwuid(QEMU_UID)
    except KeyError:
        pytest.fail("no user with UID 107 (scripts/setup.sh creates `qemu`)")
    root = Path(tempfile.mkdtemp(prefix=prefix))
    leftovers.scratch_made(root)
    root.chmod(0o755)
    try:
        yield root
    finally:
        # The session daemons with their HOME here, and qemu and virtiofsd processes they left.
        leftovers.remove_scratch(root)


@pytest.fixture(scope="module")
def qemu_user():
    with qemu_scratch("e2e-") as root:
        yield QemuUser(root)



@pytest.fixture
def root_side(qemu_user) -> tuple[Path, str]:
    """A root launcher's cache and the URI of the qemu user's session daemon (qemu runs as 107, fast;
    `qemu:///session` as root would be the system daemon)."""
    qemu_user.virsh("list")  # starts the session daemon
    sock = qemu_user.home / ".cache" / "libvirt" / "libvirt-sock"
    assert sock.exists(), "the qemu user's libvirt session daemon did not start"
    cache = qemu_user.root / "root-cache"
    cache.mkdir(exist_ok=True)
    cache.chmod(0o755)
    return cache, f"qemu+unix:///session?socket={sock}"


@pytest.fixture(scope="module")
def guest_image(registry) -> str:
    ref = f"{registry.host}/launcher/guest:v1"
    # --no-lazy: these tests boot from a full pull (lazy boots are test_lazy_run's), and builds are lazy by default.
    result = run_diskkit("build", NOREG, "--no-lazy", ensure_testguest() / "testguest-poweroff.qcow2", "-t", ref)
    assert result.code == 0, result.err
    return ref


def assert_clean(user: QemuUser, domain: str) -> None:
    """Nothing of the VM is left: no run directory, no record, no libvirt domain."""
    assert not (user.cache / "run" / domain).exists()
    assert not (user.cache / "vms" / f"{domain}.json").exists()
    assert domain not in user.virsh("list", "--all", "--name").split()

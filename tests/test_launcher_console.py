"""virtctl's habits, as root on a host with no system libvirt daemon: `launcher run` boots through a
session daemon of the qemu user it starts for the VM itself, `console` attaches to the running guest (output and
input, detach with Ctrl-] as pkg/virtctl/console/console.go), `logs [-f]` prints its console log,
`stop` takes several names and says a VM that is not running is not (exit 0). gc removes stale
VM lock files."""

from __future__ import annotations

import fcntl
import json
import os
import select
import stat
import subprocess
import time
from pathlib import Path

from launcher.node.cache import Cache
from launcher.runtime import sessiond
from launcher.runtime.vmuser import VMS_DIR
from tests.conftest import launcher_command, run_diskkit, run_launcher
from tests.testguest import ensure_testguest
from tests.vmhost import DONE, NOREG, QEMU_UID

# A host with no system daemon: whatever this machine runs, the launcher is started in a mount
# namespace of its own with an empty /run/libvirt, where the system daemon's sockets would be.
NO_SYSTEM_DAEMON = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    'if [ -d /run/libvirt ]; then mount -t tmpfs tmpfs /run/libvirt; fi; exec "$@"', "sh"]


def as_root_here(cache: Path, *args) -> list[str]:
    return [*NO_SYSTEM_DAEMON, *launcher_command(*args, "--cache-dir", cache)]


def root_launcher(cache: Path, *args, timeout: float = 400):
    proc = subprocess.run(as_root_here(cache, *args), capture_output=True, text=True, timeout=timeout, env={**os.environ, "CI": "true"})
    return proc


def popen(cache: Path, *args, stdin=subprocess.DEVNULL) -> subprocess.Popen:
    return subprocess.Popen(as_root_here(cache, *args), stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "CI": "true"})


def read_until(stream, needle: bytes, timeout: float = 120) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        left = deadline - time.monotonic()
        assert left > 0, f"{needle!r} did not come within {timeout} s; got {seen[-2000:]!r}"
        ready, _, _ = select.select([stream], [], [], min(left, 1))
        if ready:
            chunk = os.read(stream.fileno(), 4096)
            assert chunk, f"the stream ended before {needle!r}; got {seen[-2000:]!r}"
            seen += chunk
    return seen


def vm_uid(cache: Path, domain: str) -> int | None:
    """The host uid the VM's own session daemon and qemu run as (its record says), while it is recorded."""
    try:
        return json.loads((cache / "vms" / f"{domain}.json").read_text())["vmUser"]["uid"]
    except (OSError, ValueError, KeyError):
        return None


def processes_of_uid(uid: int) -> list[int]:
    """The live processes of `uid` (a zombie init has yet to reap runs nothing)."""
    found = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid and Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(pid))
        except (OSError, IndexError):
            continue
    return found


def test_root_with_no_system_daemon_boots_attaches_follows_and_stops(qemu_user, guest_image):
    assert os.geteuid() == 0, "this test is about a root launcher"
    cache = qemu_user.root / "embedded-cache"
    vmi = qemu_user.write_vmi("embedded", guest_image, serial="hold-240-echo")
    started = root_launcher(cache, "run", NOREG, "--wait-for", "ECHO ready", "--timeout", "300", vmi)
    try:
        assert started.returncode == 0, started.stderr
        # One line says which libvirt runs it, then one short block: name, console, how to stop it.
        assert "no libvirt system daemon answers here" in started.stderr, started.stderr
        assert "launcher console embedded" in started.stderr and "launcher stop embedded" in started.stderr
        record = json.loads((cache / "vms" / "default_embedded.json").read_text())
        uid = record["vmUser"]["uid"]
        assert record["uri"] == f"qemu+unix:///session?socket={VMS_DIR}/{uid}/.cache/libvirt/libvirt-sock"
        # The VM's own daemon: the qemu user (107) in its user namespace, a uid of the VM's own outside.
        [daemon] = [pid for pid in processes_of_uid(uid) if Path(f"/proc/{pid}/comm").read_text().strip() == "libvirtd"]
        assert Path(f"/proc/{daemon}/uid_map").read_text().split() == [str(QEMU_UID), str(uid), "1"]
        status = root_launcher(cache, "status", "embedded")
        assert (status.returncode, status.stdout.strip()) == (0, "running"), status.stderr
        # ls names the disk by the image it came from, not by a cut path.
        listed = root_launcher(cache, "ls")
        assert listed.returncode == 0, listed.stderr
        [row] = [line for line in listed.stdout.splitlines() if "default_embedded" in line and "Mi" in line]
        assert row.split()[0] == f"docker://{guest_image}" and str(cache) not in listed.stdout, listed.stdout
        [disk] = json.loads(root_launcher(cache, "ls", "--json").stdout)["disks"]
        assert disk["images"] == [f"docker://{guest_image}"] and disk["usedBy"] == ["default_embedded"]

        # console: the guest's output, and a line typed reaches the guest (it answers ECHO <line>).
        attached = popen(cache, "console", "embedded", stdin=subprocess.PIPE)
        try:
            assert b"Successfully connected to embedded console. The escape sequence is ^]" in read_until(attached.stderr, b"^]\n")
            attached.stdin.write(b"hello console\n")
            attached.stdin.flush()
            read_until(attached.stdout, b"ECHO hello console")
            attached.stdin.write(b"\x1d")  # Ctrl-]: detach, the VM keeps running
            attached.stdin.flush()
            assert attached.wait(timeout=60) == 0, attached.stderr.read()
        finally:
            attached.kill()
        assert root_launcher(cache, "status", "embedded").stdout.strip() == "running"

        logs = root_launcher(cache, "logs", "embedded")
        assert logs.returncode == 0, logs.stderr
        assert DONE in logs.stdout and "ECHO hello console" in logs.stdout

        following = popen(cache, "logs", "-f", "embedded")
        read_until(following.stdout, b"ECHO hello console")  # what came before, then it follows
        # stop, found again on the session daemon, takes several names; one not running is no error.
        stopped = root_launcher(cache, "stop", "embedded", "never-started")
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.splitlines() == ["VM embedded was stopped", "VM never-started is not running"]
        assert following.wait(timeout=60) == 0, following.stderr.read()  # -f ends with the VM
    finally:
        root_launcher(cache, "stop", "embedded")
    assert processes_of_uid(uid) == [] and not (VMS_DIR / str(uid)).exists()  # stop gave the VM's uid back
    again = root_launcher(cache, "stop", "embedded")
    assert (again.returncode, again.stdout.strip()) == (0, "VM embedded is not running"), again.stderr
    assert not (cache / "run" / "default_embedded").exists()
    gone = root_launcher(cache, "logs", "embedded")
    assert gone.returncode != 0 and "VM is not running" in gone.stderr and gone.stderr.count("\n") == 1, gone.stderr


def test_gc_removes_lock_files_no_process_holds(tmp_path):
    cache_dir = tmp_path / "cache"
    cache = Cache(cache_dir)
    with cache.lock("vm-default_gone"):
        pass  # a VM that ran once: its lock file stays behind
    with cache.lock("pull-keeps"):
        pass
    locks = cache_dir / "locks"
    with cache.lock("vm-default_starting"):  # a launcher starting this VM right now
        result = run_launcher("gc", "--json", "--cache-dir", cache_dir)
        assert result.code == 0, result.err
        assert json.loads(result.out)["locks_removed"] == [str(locks / "vm-default_gone.lock")]
        assert (locks / "vm-default_starting.lock").exists()
    assert not (locks / "vm-default_gone.lock").exists()
    assert (locks / "pull-keeps.lock").exists()  # only VM locks: one per name ever run
    # A lock taken again after gc removed its file is a fresh file, held.
    with cache.lock("vm-default_gone"):
        fd = os.open(locks / "vm-default_gone.lock", os.O_RDWR)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                raise AssertionError("the lock is not held")
            except BlockingIOError:
                pass
        finally:
            os.close(fd)


def test_connect_still_wins_over_the_embedded_default(qemu_user):
    cache = qemu_user.root / "connect-cache"
    vmi = qemu_user.write_vmi("chosen", "127.0.0.1:1/none:v1")
    refused = root_launcher(cache, "run", "--connect", "qemu:///system", vmi)
    assert refused.returncode != 0
    assert refused.stderr.startswith("launcher: qemu:///system: cannot connect to libvirt") and refused.stderr.count("\n") == 1, refused.stderr
    assert "no libvirt system daemon answers here" not in refused.stderr


def test_a_lazy_image_boots_through_the_embedded_daemon(qemu_user, registry):
    """qemu runs as the VM's own uid, outside the group of the root disk server's nbd.sock: the root
    launcher asks for the socket of that uid instead, which goes with the VM (a later VM given the uid
    reads nothing the first one was answered with)."""
    ref = f"{registry.host}/embedded/lazy:v1"
    built = run_diskkit("build", NOREG, ensure_testguest() / "testguest-poweroff.qcow2", "-t", ref)  # lazy by default
    assert built.code == 0, built.err
    cache = qemu_user.root / "lazy-cache"
    vmi = qemu_user.write_vmi("lazy-embedded", ref)
    booted = None
    try:
        booted = popen(cache, "run", NOREG, "--console", "--timeout", "300", vmi)
        read_until(booted.stdout, DONE.encode(), timeout=300)
        uid = vm_uid(cache, "default_lazy-embedded")
        served = cache / "serve" / f"nbd-{uid}.sock"
        assert stat.S_ISSOCK(served.lstat().st_mode) and served.lstat().st_uid == uid
        assert booted.wait(timeout=300) == 0, booted.stderr.read()
        assert b"no libvirt system daemon answers here" in booted.stderr.read()
    finally:
        if booted is not None:
            booted.kill()
        root_launcher(cache, "stop", "lazy-embedded")
    assert not served.exists() and processes_of_uid(uid) == []


def test_kvm_for_the_qemu_user_is_what_it_may_open_not_what_root_may():
    kvm = 1000
    assert not sessiond.qemu_user_has_kvm(0o20600, 0, ())  # root's alone (this machine's): TCG, though root may probe KVM
    assert not sessiond.qemu_user_has_kvm(0o20660, kvm, ())  # the kvm group's, a daemon without it
    assert sessiond.qemu_user_has_kvm(0o20660, kvm, (kvm,))  # the embedded daemon is given /dev/kvm's group
    assert sessiond.qemu_user_has_kvm(0o20666, 0, ())
    assert not sessiond.is_ours("qemu:///session") and not sessiond.is_ours(f"qemu+unix:///session?socket={VMS_DIR}/x/.cache/libvirt/libvirt-sock")

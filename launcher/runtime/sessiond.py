"""A root launcher's own libvirt: one session daemon per VM, when no system daemon answers.

Where no libvirtd runs as root (no systemd, socket activation off, a container), a root launcher runs
each VM the way the launcher pod does: through a libvirt session daemon of the qemu user (107), which
starts qemu as that user. Each VM has its own, as each VMI has its own virt-launcher pod, run in a user
namespace where it is 107 and, outside, the VM's own uid (launcher.runtime.vmuser): its HOME
(/run/diskkit/vms/<uid>/, 0700) holds its sockets, config and logs and its one qemu's monitor, which
no other VM's qemu and no other local user can reach. The VM's record keeps the daemon's URI and its
identity, so every later verb (stop, status, console, logs, ls, gc) finds it by its socket, and starts
it again when it has gone while the VM runs. Not in the cache: qemu's monitor socket lies five levels
below that HOME, and a unix socket's path is 107 bytes at most. Under /run it goes with a reboot, as
the VMs do.

libvirt probes qemu's capabilities for each new daemon (about 2 s here) unless its HOME already holds
them: each new HOME gets a copy of the last ones a daemon probed before any VM of its uid ran
(`keep_capabilities`, called once the domain is defined and before it starts), which libvirt checks
against qemu's and its own binaries as it would its own cache.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path

from diskkit.errors import DiskkitError
from launcher.node.cache import QEMU_ID
from launcher.runtime.vmuser import RUN_DIR, VMS_DIR, VmUser, give_home, kept

# Where a system daemon listens: the monolithic libvirtd's socket, and virtqemud's where the
# modular daemons run (libvirt's remote driver tries the latter first for qemu:///system).
SYSTEM_SOCKETS = ("/var/run/libvirt/virtqemud-sock", "/var/run/libvirt/libvirt-sock")
# What libvirt's own autostart of a session daemon gives it (src/rpc/virnetsocket.c, which spawns it with --timeout=120).
IDLE_TIMEOUT = 120
START_TIMEOUT = 60
KVM_DEVICE = Path("/dev/kvm")
CAPS_TEMPLATE = RUN_DIR / "qemu-caps"
CAPS_IN_HOME = Path(".cache/libvirt/qemu/cache/capabilities")  # under HOME, with XDG_CACHE_HOME unset
CAPS_MAX = 4 << 20  # one emulator's capabilities are ~80 KiB


def _answers(path: str | Path) -> bool:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    try:
        sock.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        sock.close()


def kvm_group() -> int | None:
    """/dev/kvm's group where the device is open to it (Debian's kvm, 0660): the daemon, and the qemu
    it starts, get that group, as a KubeVirt device plugin hands a pod /dev/kvm."""
    try:
        st = os.stat(KVM_DEVICE)
    except OSError:
        return None
    return st.st_gid if st.st_gid != 0 and st.st_mode & 0o060 == 0o060 else None


def qemu_user_has_kvm(mode: int, gid: int, groups: tuple[int, ...]) -> bool:
    """Whether qemu as the qemu user, with supplementary `groups`, opens a /dev/kvm of this mode and
    group read-write. Root's own access proves nothing here: root probes KVM, 107 runs qemu."""
    return mode & 0o006 == 0o006 or (gid in groups and mode & 0o060 == 0o060)


def kvm_for(connect_uri: str) -> bool:
    """Whether a root launcher's VM on a session daemon may be a KVM domain: with a VM's own daemon,
    /dev/kvm's group counts (the daemon has it); with another session daemon only what any user may
    open does."""
    try:
        st = os.stat(KVM_DEVICE)
    except OSError:
        return False
    group = kvm_group() if is_ours(connect_uri) else None
    return qemu_user_has_kvm(st.st_mode, st.st_gid, () if group is None else (group,))


def system_daemon_answers() -> bool:
    """Whether a system libvirt daemon accepts connections here (an absent or refusing socket: no)."""
    return any(_answers(path) for path in SYSTEM_SOCKETS)


def socket_path(user: VmUser) -> Path:
    # With XDG_RUNTIME_DIR unset a session daemon listens under $HOME/.cache/libvirt.
    return user.home / ".cache" / "libvirt" / "libvirt-sock"


def uri(user: VmUser) -> str:
    return f"qemu+unix:///session?socket={socket_path(user)}"


_OURS = re.compile(rf"^qemu\+unix:///session\?socket={re.escape(str(VMS_DIR))}/(\d+)/\.cache/libvirt/libvirt-sock$")


def is_ours(connect_uri: str) -> bool:
    """Whether `connect_uri` is a VM's own session daemon, one a root launcher starts."""
    return os.geteuid() == 0 and _OURS.match(connect_uri) is not None


def start(user: VmUser) -> str:
    """The VM's daemon in a fresh HOME (launcher.runtime.vmuser made it, root's): the capabilities
    libvirt probed before put in, the HOME given to the VM's uid, the daemon started; its URI."""
    caps = user.home / CAPS_IN_HOME
    caps.mkdir(parents=True, mode=0o755)
    with contextlib.suppress(FileNotFoundError):
        for probed in CAPS_TEMPLATE.iterdir():
            if probed.suffix == ".xml" and probed.is_file() and not probed.is_symlink():
                shutil.copyfile(probed, caps / probed.name)
    give_home(user)
    _launch(user)
    return uri(user)


def ensure(connect_uri: str, user: VmUser | None) -> None:
    """A VM's daemon that has gone (killed, or exited idle) while its VM may still run is started
    again in the HOME it left, as long as the slot is still this VM's; it finds the VM's qemu there."""
    if not is_ours(connect_uri) or user is None or connect_uri != uri(user) or _answers(socket_path(user)):
        return
    with kept(user) as ours:
        if ours and not _answers(socket_path(user)):
            _launch(user)


def _launch(user: VmUser) -> None:
    libvirtd = shutil.which("libvirtd") or shutil.which("libvirtd", path="/usr/sbin:/sbin")
    if libvirtd is None:
        raise DiskkitError("libvirtd", "not installed: with no system daemon a root launcher runs VMs through the qemu user's "
                                       "session daemon (apt-get install libvirt-daemon)")
    # XDG_* unset: the daemon keeps everything under its HOME, where later verbs look for its socket.
    env = {"HOME": str(user.home), "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LC_ALL": "C"}
    group = kvm_group()
    groups = ["--clear-groups"] if group is None else [f"--groups={group}"]
    # The VM's uid makes the namespace and maps itself to 107 (the qemu user libvirt looks up in
    # /etc/passwd); root's ids stay unmapped in it. --daemon: the parent returns once the daemon is
    # ready (or has failed), and the daemon, in a session of its own, outlives this launcher.
    cmd = ["setpriv", f"--reuid={user.uid}", f"--regid={user.uid}", *groups, "--",
           "unshare", "--user", f"--map-user={QEMU_ID}", f"--map-group={QEMU_ID}", "--",
           libvirtd, "--daemon", f"--timeout={IDLE_TIMEOUT}"]
    try:
        proc = subprocess.run(cmd, env=env, cwd="/", stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=START_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DiskkitError(user.home, f"cannot start the VM's session daemon here: {getattr(exc, 'strerror', None) or exc}") from None
    deadline = time.monotonic() + START_TIMEOUT
    while not _answers(socket_path(user)):
        if proc.returncode != 0 or time.monotonic() > deadline:
            said = " ".join((proc.stderr or proc.stdout or "").split())[:300] or f"exit status {proc.returncode}"
            raise DiskkitError(f"{libvirtd} as uid {user.uid} (the qemu user, {QEMU_ID}, in its user namespace)",
                               f"the session daemon did not start: {said}")
        time.sleep(0.02)


def keep_capabilities(user: VmUser) -> None:
    """The capabilities the VM's daemon holds once it has defined the domain (probed now, or the copy
    it was given and found current) become the next daemons' copy. Called before the domain starts:
    nothing of a guest has run as the VM's uid yet, so what is in its HOME is libvirt's own."""
    caps = user.home / CAPS_IN_HOME
    try:
        CAPS_TEMPLATE.mkdir(mode=0o755, exist_ok=True)
        st = os.lstat(CAPS_TEMPLATE)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            return  # not root's own: left alone, and no copy is given out of it either
        names = [p.name for p in caps.iterdir() if p.suffix == ".xml"]
    except OSError:
        return
    for name in names:
        data = _read_regular(caps / name)
        if data is None:
            continue
        kept = CAPS_TEMPLATE / name
        with contextlib.suppress(OSError):
            if kept.read_bytes() == data:
                continue
        tmp = CAPS_TEMPLATE / f".{name}.{os.getpid()}.tmp"
        with contextlib.suppress(OSError):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            os.rename(tmp, kept)


def _read_regular(path: Path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > CAPS_MAX:
            return None
        data = b""
        while len(data) <= CAPS_MAX and (piece := os.read(fd, CAPS_MAX + 1 - len(data))):
            data += piece
        return data if len(data) <= CAPS_MAX else None
    finally:
        os.close(fd)

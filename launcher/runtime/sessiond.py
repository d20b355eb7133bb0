"""A root launcher's own libvirt: KubeVirt's qemu user's session daemon, when no system daemon answers.

Where no libvirtd runs as root (no systemd, socket activation off, a container), a root launcher runs
its VMs the way the launcher pod does: through a libvirt session daemon of the qemu user (107),
which starts qemu as that user. The daemon's HOME (its sockets, config and logs under .cache/ and
.config/) is named after the cache, /run/diskkit/libvirt-<hash of the cache's path>, so every later
verb on the same cache (stop, status, console, logs, ls, gc) finds it again by its socket, and
starts it again when it has gone. Not in the cache itself: qemu's monitor socket lies five levels
below that HOME, and a unix socket's path is 107 bytes at most. Under /run it goes with a reboot,
as the VMs do.
It is started on demand with --timeout: a session daemon exits once idle, and libvirt keeps it
alive while one of its domains runs.
What must outlive a reboot of the node is kept in the cache instead: libvirt keeps a persistent TPM's
state (swtpm's, per domain UUID; launcher.volumes.vmstate) in its configuration directory, under the
HOME, where the monitor sockets are too; so that directory's `libvirt/qemu/swtpm` is a link, made by
the qemu user in its own HOME, to the cache's `state/swtpm/`, as the system daemon keeps it in
/var/lib/libvirt.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import time
from pathlib import Path

from diskkit.errors import DiskkitError
from launcher.hostfs import asowner
from launcher.node.cache import Cache, key
from launcher.volumes.files import KUBEVIRT_QEMU

# Where a system daemon listens: the monolithic libvirtd's socket, and virtqemud's where the
# modular daemons run (libvirt's remote driver tries the latter first for qemu:///system).
SYSTEM_SOCKETS = ("/var/run/libvirt/virtqemud-sock", "/var/run/libvirt/libvirt-sock")
# What libvirt's own autostart of a session daemon gives it (src/rpc/virnetsocket.c, which spawns it with --timeout=120).
IDLE_TIMEOUT = 120
START_TIMEOUT = 60
# sockaddr_un.sun_path, less its terminating NUL.
MAX_SOCKET_PATH = 107
KVM_DEVICE = Path("/dev/kvm")


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


def kvm_for(connect_uri: str, cache: Cache) -> bool:
    """Whether a root launcher's VM on a session daemon may be a KVM domain: with this cache's own
    daemon, /dev/kvm's group counts (the daemon has it); with another session daemon only what any
    user may open does."""
    try:
        st = os.stat(KVM_DEVICE)
    except OSError:
        return False
    group = kvm_group() if is_ours(cache, connect_uri) else None
    return qemu_user_has_kvm(st.st_mode, st.st_gid, () if group is None else (group,))


def system_daemon_answers() -> bool:
    """Whether a system libvirt daemon accepts connections here (an absent or refusing socket: no)."""
    return any(_answers(path) for path in SYSTEM_SOCKETS)


RUN_DIR = Path("/run/diskkit")


def home(cache: Cache) -> Path:
    return RUN_DIR / f"libvirt-{key(str(cache.root.resolve()))[:16]}"


def socket_path(cache: Cache) -> Path:
    # With XDG_RUNTIME_DIR unset a session daemon listens under $HOME/.cache/libvirt.
    return home(cache) / ".cache" / "libvirt" / "libvirt-sock"


def uri(cache: Cache) -> str:
    return f"qemu+unix:///session?socket={socket_path(cache)}"


def is_ours(cache: Cache, connect_uri: str) -> bool:
    """Whether `connect_uri` is this cache's own session daemon (one `ensure` may start again)."""
    return os.geteuid() == 0 and connect_uri == uri(cache)


def ensure(cache: Cache) -> str:
    """The URI of the cache's session daemon, started first when it does not answer."""
    sock = socket_path(cache)
    if len(str(sock).encode()) > MAX_SOCKET_PATH:
        raise DiskkitError(sock, f"longer than a unix socket path may be ({MAX_SOCKET_PATH} bytes); use a shorter --cache-dir")
    if _answers(sock):
        return uri(cache)
    with cache.lock("libvirtd"):  # two launchers starting at once start one daemon
        if not _answers(sock):
            try:
                _start(cache)
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise DiskkitError(home(cache), f"cannot start the qemu user's session daemon here: {getattr(exc, 'strerror', None) or exc}") from None
    return uri(cache)


def _home_dir(cache: Cache) -> Path:
    """The daemon's HOME: made by root in root's /run/diskkit, then the qemu user's alone. One found
    there already must be a directory of root's or qemu's, not a link (only root can write
    /run/diskkit)."""
    try:
        os.mkdir(RUN_DIR, 0o755)
    except FileExistsError:
        pass
    st = os.lstat(RUN_DIR)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise DiskkitError(RUN_DIR, "must be a directory root alone may write (the session daemons' homes are made there)")
    path = home(cache)
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid not in (0, KUBEVIRT_QEMU[0]):
        raise DiskkitError(path, "is not a directory of root's or the qemu user's; remove it, the launcher makes it afresh")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchown(fd, *KUBEVIRT_QEMU)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def _tpm_states(cache: Cache, where: Path) -> None:
    """`<cache>/state/swtpm`, made by root in the cache's own state/ and then the qemu user's alone (one
    found there must be a directory of root's or qemu's, not a link), and the daemon's swtpm directory a
    link to it, made by the qemu user in its own HOME (root never acts on a name there) unless one is
    there already."""
    path = cache.root / "state" / "swtpm"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        if os.fstat(fd).st_uid not in (0, KUBEVIRT_QEMU[0]):
            raise DiskkitError(path, "is not a directory of root's or the qemu user's; remove it, the launcher makes it afresh")
        os.fchown(fd, *KUBEVIRT_QEMU)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)

    def link(_send) -> dict:
        qemu_dir = where / ".config" / "libvirt" / "qemu"
        os.makedirs(qemu_dir, 0o700, exist_ok=True)
        if not os.path.lexists(qemu_dir / "swtpm"):
            os.symlink(path, qemu_dir / "swtpm")
        return {}

    asowner.run_as(KUBEVIRT_QEMU, link)


def _start(cache: Cache) -> None:
    libvirtd = shutil.which("libvirtd") or shutil.which("libvirtd", path="/usr/sbin:/sbin")
    if libvirtd is None:
        raise DiskkitError("libvirtd", "not installed: with no system daemon a root launcher runs VMs through the qemu user's "
                                       "session daemon (apt-get install libvirt-daemon)")
    where = _home_dir(cache)
    _tpm_states(cache, where)
    # XDG_* unset: the daemon keeps everything under its HOME, where later verbs look for its socket.
    env = {"HOME": str(where), "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "LC_ALL": "C"}
    # --daemon: the parent returns once the daemon is ready (or has failed), and the daemon,
    # in a session of its own, outlives this launcher.
    group = kvm_group()
    proc = subprocess.run([libvirtd, "--daemon", f"--timeout={IDLE_TIMEOUT}"], env=env, cwd=where, user=KUBEVIRT_QEMU[0],
                          group=KUBEVIRT_QEMU[1], extra_groups=[] if group is None else [group], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=START_TIMEOUT)
    deadline = time.monotonic() + START_TIMEOUT
    while not _answers(socket_path(cache)):
        if proc.returncode != 0 or time.monotonic() > deadline:
            said = " ".join((proc.stderr or proc.stdout or "").split())[:300] or f"exit status {proc.returncode}"
            raise DiskkitError(f"{libvirtd} as uid {KUBEVIRT_QEMU[0]}", f"the session daemon did not start: {said}")
        time.sleep(0.1)

"""One VM, one host uid: the identity a root launcher's VM runs under on a session daemon of its own.

Every qemu used to run as KubeVirt's qemu user, 107, so any one of them (a guest that escaped into its
qemu), and any local process of uid 107, could read the node's pulled disks, every other VM's overlays,
and every other VM's monitor (and through it, or through ptrace and /proc/PID/mem, its RAM). In
KubeVirt each qemu is 107 too, and the pod keeps them apart: namespaces, and the node's SELinux
categories per pod. A mount namespace of the same uid is no wall on this kind of node (no SELinux,
AppArmor or Yama): a process of that uid reads another's files through /proc/PID/root and attaches to
it with ptrace. So each VM gets a uid of its own on the host, as a pod with `hostUsers: false` gets a
range of its own from the kubelet (pkg/kubelet/userns_manager.go: blocks of 65536 ids, the first one
the host's, at most 1024 of them). Inside its user namespace qemu is still 107, the qemu user of
/etc/passwd: VM N is host uid and gid N*65536 + 107.

A slot is taken by a directory under /run/diskkit/vms/ (the VM's session daemon's HOME) and a
root-owned lease file naming the VM; the launcher that takes it holds the lease's lock until the VM
runs, and from then on the VM's own processes (its daemon, qemu) are what keep it taken. A slot whose
lock is free and whose uid runs nothing is free again: the next VM may have it, and a record that
still names it releases nothing of the next VM's (its token differs). Slots whose ids a user, a group
or a subordinate id range (/etc/subuid, /etc/subgid) already names are never used: whoever holds
those ids could act as the VM.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import json
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from diskkit.errors import DiskkitError
from launcher.hostfs.dirfd import DIR_NOFOLLOW
from launcher.node.cache import QEMU_ID

BLOCK = 1 << 16  # the kubelet's user namespace length
SLOTS = range(1, 1025)  # the first block is the host's; the kubelet's limit of pods with user namespaces
RUN_DIR = Path("/run/diskkit")
VMS_DIR = RUN_DIR / "vms"
SUBORDINATE = (Path("/etc/subuid"), Path("/etc/subgid"))


@dataclass(frozen=True)
class VmUser:
    """A VM's host identity: `uid` (and the same gid) outside, QEMU_ID inside its user namespace."""

    uid: int
    token: str

    @property
    def ids(self) -> tuple[int, int]:
        return self.uid, self.uid

    @property
    def home(self) -> Path:
        return VMS_DIR / str(self.uid)

    def to_json(self) -> dict:
        return {"uid": self.uid, "token": self.token}

    @classmethod
    def from_json(cls, data) -> VmUser | None:
        if isinstance(data, dict) and isinstance(data.get("uid"), int) and isinstance(data.get("token"), str):
            return cls(data["uid"], data["token"])
        return None


def host_uid(slot: int) -> int:
    return slot * BLOCK + QEMU_ID


def subordinate_ranges(text: str) -> list[tuple[int, int]]:
    """(start, count) of every `name:start:count` line of /etc/subuid or /etc/subgid."""
    ranges = []
    for line in text.splitlines():
        parts = line.strip().split(":")
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            ranges.append((int(parts[1]), int(parts[2])))
    return ranges


def usable(slot: int, named_uids: set[int], named_gids: set[int], ranges: list[tuple[int, int]]) -> bool:
    """Whether no user, group or subordinate range on the host already names one of the slot's ids."""
    first, uid = slot * BLOCK, host_uid(slot)
    if uid in named_uids or uid in named_gids:
        return False
    return not any(start < first + BLOCK and first < start + count for start, count in ranges)


def _host_names() -> tuple[set[int], set[int], list[tuple[int, int]]]:
    ranges = []
    for path in SUBORDINATE:
        with contextlib.suppress(FileNotFoundError):
            ranges += subordinate_ranges(path.read_text())
    return {e.pw_uid for e in pwd.getpwall()}, {e.gr_gid for e in grp.getgrall()}, ranges


def runs_anything(uid: int) -> bool:
    """Whether any live process (a zombie holds nothing) has `uid` as its real, effective or saved uid."""
    wanted = str(uid).encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f if line[:4] in (b"Stat", b"Uid:"))
        except (OSError, ValueError):
            continue  # gone meanwhile
        if not fields.get(b"State", b"").strip().startswith(b"Z") and wanted in fields.get(b"Uid", b"").split()[:3]:
            return True
    return False


def _root_dir(path: Path, mode: int) -> None:
    """`path`, a directory root alone writes (made if missing); anything else there is refused."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, mode)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise DiskkitError(path, "must be a directory root alone may write (the VMs' identities are kept there)")


def _lease(uid: int) -> Path:
    return VMS_DIR / f"{uid}.json"


def _lock(uid: int) -> Path:
    return VMS_DIR / f"{uid}.lock"


@contextlib.contextmanager
def _flock(path: Path, blocking: bool = True) -> Iterator[int | None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield None
            return
        yield fd
    finally:
        os.close(fd)


def _read_lease(uid: int) -> dict:
    try:
        fd = os.open(_lease(uid), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return {}
    try:
        data = json.loads(os.read(fd, 65536) or b"{}")
    except ValueError:
        return {}
    finally:
        os.close(fd)
    return data if isinstance(data, dict) else {}


def holds(user: VmUser) -> bool:
    """Whether the slot is still this VM's (not released, not taken by a later VM)."""
    return _read_lease(user.uid).get("token") == user.token


@contextlib.contextmanager
def kept(user: VmUser) -> Iterator[bool]:
    """Whether the slot is this VM's, and stays so for the block: no release or allocation runs meanwhile
    (a daemon started again in it is never one a release is ending)."""
    if not VMS_DIR.is_dir():
        yield False  # gone with a reboot, and the VM with it
        return
    with _flock(VMS_DIR / "allocate.lock"):
        yield holds(user)


class Allocation:
    """A slot taken for one VM; its lock is held until `close`, once the VM has started: from then on
    the VM's own processes keep it."""

    def __init__(self, user: VmUser, lock_fd: int):
        self.user, self._fd = user, lock_fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def allocate(domain: str, cache_root: Path) -> Allocation:
    """The first free slot, cleared of whatever a VM that had it before left."""
    _root_dir(RUN_DIR, 0o755)
    _root_dir(VMS_DIR, 0o711)  # each VM's daemon passes through to its own HOME, and lists nothing
    named = _host_names()
    with _flock(VMS_DIR / "allocate.lock"):
        for slot in SLOTS:
            if not usable(slot, *named):
                continue
            uid = host_uid(slot)
            fd = os.open(_lock(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # a launcher is starting a VM under it
            if runs_anything(uid):
                os.close(fd)
                continue
            try:
                user = VmUser(uid, secrets.token_hex(16))
                _clear(uid)
                _make_home(user, domain, cache_root)
            except BaseException:
                os.close(fd)
                raise
            return Allocation(user, fd)
    raise DiskkitError(VMS_DIR, f"all {len(SLOTS)} VM identities are in use; stop a VM first")


def _make_home(user: VmUser, domain: str, cache_root: Path) -> None:
    """The lease first (root's), then the daemon's HOME: root's while it is filled, then the VM's, 0700."""
    data = json.dumps({"token": user.token, "domain": domain, "cache": str(cache_root), "since": int(time.time())}).encode()
    tmp = VMS_DIR / f".{user.uid}.json.tmp"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.rename(tmp, _lease(user.uid))
    os.mkdir(user.home, 0o700)


def give_home(user: VmUser) -> None:
    """Everything root put in the HOME (while nothing of the VM's uid ran) becomes the VM's."""
    for top, dirs, files in os.walk(user.home):
        for name in [*dirs, *files]:
            os.chown(os.path.join(top, name), *user.ids, follow_symlinks=False)
    fd = os.open(user.home, DIR_NOFOLLOW)
    try:
        os.fchown(fd, *user.ids)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _clear(uid: int) -> None:
    """What a VM that had the slot left: what its cache's disk server granted its uid, its taps, its HOME
    and its lease. Nothing runs as its uid any more, so nothing can change the tree while it goes (rmtree
    follows no link)."""
    # Here, not at the top: every lookup of a VM (launcher.runtime.lookup) needs this module, and none
    # needs the disk server's client or the bridge's spec checks, 0.3 CPU-s of imports.
    from launcher.diskserver.client import forget
    from launcher.network.linuxbridge import remove_taps

    cache = _read_lease(uid).get("cache")
    if isinstance(cache, str) and cache.startswith("/"):
        forget(Path(cache), uid)
    remove_taps(uid)  # a bridge network's, in this network namespace (launcher.network.linuxbridge)
    home = VMS_DIR / str(uid)
    if os.path.lexists(home):
        if stat.S_ISDIR(os.lstat(home).st_mode):
            shutil.rmtree(home)
        else:
            os.unlink(home)
    _lease(uid).unlink(missing_ok=True)


def end_processes(uid: int) -> None:
    """Every process of the uid ends: kill(-1) as that uid reaches exactly them (the VM's daemon, its
    log daemon, a qemu left behind, a virtiofsd), and what they start meanwhile too. Root never signals
    a pid a file of theirs names."""
    for _ in range(50):
        if not runs_anything(uid):
            return
        subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", "kill", "-KILL", "-1"],
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        time.sleep(0.05)
    raise DiskkitError(f"uid {uid}", "its processes did not end")


def release(user: VmUser) -> None:
    """The VM is gone: its uid's processes end, its HOME and lease go, the slot is free. A slot a later
    VM has taken (another token) is left alone."""
    if not VMS_DIR.is_dir():
        return
    with _flock(VMS_DIR / "allocate.lock"):
        if not holds(user):
            return
        with _flock(_lock(user.uid), blocking=False) as fd:
            if fd is None:
                return  # a launcher holds it: its own VM is being started under it
            end_processes(user.uid)
            _clear(user.uid)

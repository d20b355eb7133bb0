"""A VM's run directory (`<cache>/run/<domain>/`) as a root launcher hands it to qemu: root's own, so
that root never creates, writes or chowns through a name the qemu user could have replaced.

qemu (KubeVirt's 107 on a session daemon, qemu.conf's user under the system daemon) must open the
overlays, generated ISOs, console log and virtiofs sockets in it. It used to get the directory
itself; then any process of that uid (another VM's qemu after a guest escape, a launcher user who is
107) could plant a link under a name root was about to write (domain.xml, an ISO, a socket) and have
root write, truncate or chown the file of its choosing. Instead:

- while the VM is prepared the run directory and everything in it is root's, 0700, made by root
  (`create`, private_dirs): no one else can reach it, let alone put a name in it;
- `open_to_qemu` then makes each of root's directories root:<qemu's group> 0710 (qemu traverses, never
  lists, creates, renames or removes an entry) and gives the files in them to the qemu user with
  owner-only modes, each entry itself (lchown, so never a link's target; the directory is root's, so none is there);
  a config volume's share tree (virtiofs-shares/NAME) goes to the qemu user whole, as virtiofsd
  serves it as that user. The console log is the exception: its log daemon (virtlogd of a session
  daemon runs as qemu's user) must create and rename files to rotate it past its max_size, so it
  lives in a directory of qemu's own, `console/` (0700), made by root and given to qemu by fd with an
  empty console.log in it; the launcher reads it through that directory's fd, never following a link
  (launcher.runtime.console). Likewise `tpm/`, the state directory of the swtpm a root launcher runs
  as the VM's uid (launcher.runtime.swtpm), which writes its state files there: the VM's uid's, 0700,
  with the files root put in it (a kept state, or a new TPM's) given to it;
- what root adds later (domain.xml, the virtiofs sockets) goes into directories only root can
  write, so plain paths are safe there;
- the sockets qemu listens on itself, VNC's and the guest agent's channel, are made by qemu in
  `console/` too (KubeVirt's virt-launcher keeps virt-vnc beside its serial console's log). A unix
  socket's path holds 107 bytes: where `console/`'s is longer, a link root makes beside the run
  directory, `run/.KEY` (run/ is root's), names it in fewer (socket_dir).

Opening every write relative to a directory fd (launcher.hostfs.dirfd) would guard each writer on its
own, but the writers here are qemu-img, the ISO and metrics-disk writers and libvirt, all of which take
paths; taking the qemu user's write access to the directory away guards them all, and any added later.
An unprivileged launcher is unaffected: everything is its own, and qemu runs as it.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from diskkit.errors import DiskkitError
from launcher.hostfs.dirfd import DIR_NOFOLLOW, NOFOLLOW
from launcher.node.cache import key
from launcher.volumes.filesystems import SHARES_DIR
from launcher.volumes.vmstate import TPM_DIR

TRAVERSE = 0o710  # root's directories: qemu's group may pass through, nothing more
CONSOLE_DIR = "console"  # qemu's: its log daemon rotates the log in it, qemu makes its sockets in it
CONSOLE_LOG = "console.log"
VNC_SOCKET = "virt-vnc"  # KubeVirt's name (converter/compute/graphics.go)
AGENT_SOCKET = "virt-agent"  # the guest agent's channel (KubeVirt lets libvirt name it)
SOCKET_PATH_MAX = 107  # sun_path, less its terminating NUL


def inside(path: Path | str, run_dir: Path) -> bool:
    """Whether `path` lies in the run directory (what the launcher made there for this VM alone)."""
    resolved, top = Path(os.path.abspath(path)), Path(os.path.abspath(run_dir))
    return resolved == top or top in resolved.parents


def console_log(run_dir: Path) -> Path:
    return run_dir / CONSOLE_DIR / CONSOLE_LOG


def _short_link(run_dir: Path) -> Path:
    return run_dir.parent / f".{key(run_dir.name)[:16]}"


def socket_dir(run_dir: Path) -> Path | None:
    """Where qemu makes its VNC and guest-agent sockets: `console/`, or the short link to it when
    that path is too long for a socket; None when both are (a cache path of some 70 bytes and more):
    then libvirt names them."""
    for candidate in (run_dir / CONSOLE_DIR, _short_link(run_dir)):
        if all(len(str(candidate / name).encode()) <= SOCKET_PATH_MAX for name in (VNC_SOCKET, AGENT_SOCKET)):
            return candidate
    return None


def qemu_socket(run_dir: Path, name: str) -> str | None:
    """The path of qemu's socket `name` (VNC_SOCKET, AGENT_SOCKET), or None: libvirt's choice."""
    directory = socket_dir(run_dir)
    return None if directory is None else str(directory / name)


def _short_sockets_link(run_dir: Path, sub: str) -> Path:
    return run_dir.parent / f".{key(run_dir.name)[:16]}-{sub}"


def sockets_dir(run_dir: Path, sub: str, longest: str) -> Path:
    """Where the sockets of `run_dir/sub` are named (the pod switches'): that directory, or a short link to
    it beside the run directory when a socket `longest` in it would be too long a path."""
    if len(str(run_dir / sub / longest).encode()) <= SOCKET_PATH_MAX:
        return run_dir / sub
    return _short_sockets_link(run_dir, sub)


def link_sockets_dir(run_dir: Path, sub: str, longest: str) -> Path:
    """sockets_dir, with its short link made (root's, in run/) when it is one."""
    named = sockets_dir(run_dir, sub, longest)
    if named != run_dir / sub:
        _link(named, f"{run_dir.name}/{sub}")
    return named


def remove(run_dir: Path) -> None:
    """The run directory and its short links, if there are any."""
    shutil.rmtree(run_dir, ignore_errors=True)
    for link in (_short_link(run_dir), *run_dir.parent.glob(f".{key(run_dir.name)[:16]}-*")):
        if link.is_symlink():
            link.unlink(missing_ok=True)


def create(run_dir: Path) -> Path:
    """A fresh run directory of our own, 0700: whatever is left under its name (a killed launcher's,
    removed just before) is refused, never reused."""
    try:
        os.mkdir(run_dir, 0o700)
        fd = os.open(run_dir, DIR_NOFOLLOW)
    except OSError as exc:
        raise DiskkitError(run_dir, f"cannot be made afresh ({exc.strerror}); a VM's run directory is always new") from None
    try:
        os.fchmod(fd, 0o700)  # whatever the umask
        os.mkdir(CONSOLE_DIR, 0o700, dir_fd=fd)
    except OSError as exc:
        raise DiskkitError(run_dir, f"cannot be made afresh ({exc.strerror})") from None
    finally:
        os.close(fd)
    sockets = socket_dir(run_dir)
    if sockets is not None and sockets.name != CONSOLE_DIR:
        _link(sockets, f"{run_dir.name}/{CONSOLE_DIR}")
    return run_dir


def _link(link: Path, target: str) -> None:
    """A short link to a directory of the run (`console/`, `net/`), in place of any left by a killed run (only links are replaced)."""
    try:
        if link.is_symlink():
            link.unlink()
        os.symlink(target, link)
    except OSError as exc:
        raise DiskkitError(link, f"cannot be made as a link to {target} ({exc.strerror})") from None


def open_to_qemu(run_dir: Path, owner: tuple[int, int]) -> None:
    """Hand the prepared run directory to qemu (see the module's docstring); nothing as unprivileged."""
    if os.geteuid() != 0:
        return
    try:
        fd = os.open(run_dir, DIR_NOFOLLOW)
    except OSError as exc:
        raise DiskkitError(run_dir, f"cannot be opened as a directory ({exc.strerror}; a symbolic link is not followed)") from None
    try:
        _hand_over(fd, run_dir, owner)
        _console_dir(fd, run_dir, owner)
        _tpm_dir(fd, run_dir, owner)
    except OSError as exc:
        raise DiskkitError(run_dir, f"cannot be handed to uid {owner[0]} ({exc.strerror})") from None
    finally:
        os.close(fd)


def traversable_dir(path: Path, owner: tuple[int, int]) -> Path:
    """A directory root adds to a handed-over run directory (the virtiofs sockets'): root's, TRAVERSE."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        if os.geteuid() == 0:
            fd = os.open(path, DIR_NOFOLLOW)
            try:
                _root_dir(fd, path, owner)
            finally:
                os.close(fd)
    except OSError as exc:
        raise DiskkitError(path, f"cannot be made for uid {owner[0]} to pass through ({exc.strerror})") from None
    return path


def _root_dir(fd: int, path: Path, owner: tuple[int, int]) -> None:
    if os.fstat(fd).st_uid != 0:
        raise DiskkitError(path, "is not root's; a root launcher's run directory holds only directories it made")
    os.fchown(fd, 0, owner[1])
    os.fchmod(fd, TRAVERSE)


def _console_dir(dirfd: int, run_dir: Path, owner: tuple[int, int]) -> None:
    """The console directory (root's, made with the run directory) becomes qemu's, with an empty log."""
    path = run_dir / CONSOLE_DIR
    fd = os.open(CONSOLE_DIR, DIR_NOFOLLOW, dir_fd=dirfd)
    try:
        if os.fstat(fd).st_uid != 0:
            raise DiskkitError(path, "is not root's; a root launcher's run directory holds only directories it made")
        try:
            log = os.open(CONSOLE_LOG, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd)
        except OSError as exc:
            raise DiskkitError(path / CONSOLE_LOG, f"cannot be created ({exc.strerror})") from None
        try:
            os.fchown(log, *owner)
        finally:
            os.close(log)
        os.fchown(fd, *owner)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _tpm_dir(dirfd: int, run_dir: Path, owner: tuple[int, int]) -> None:
    """The swtpm's state directory (root's, made while the VM was prepared), if there is one, becomes the
    VM's uid's with the files in it."""
    path = run_dir / TPM_DIR
    try:
        fd = os.open(TPM_DIR, DIR_NOFOLLOW, dir_fd=dirfd)
    except FileNotFoundError:
        return
    try:
        if os.fstat(fd).st_uid != 0:
            raise DiskkitError(path, "is not root's; a root launcher's run directory holds only directories it made")
        for name in sorted(os.listdir(fd)):
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise DiskkitError(path / name, "is not a regular file; the TPM's state directory holds only swtpm's files")
            _give(fd, name, path, st, owner)
        os.fchown(fd, *owner)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def _hand_over(dirfd: int, path: Path, owner: tuple[int, int], top: bool = True) -> None:
    _root_dir(dirfd, path, owner)
    for name in sorted(os.listdir(dirfd)):
        if top and name in (CONSOLE_DIR, TPM_DIR):
            continue  # qemu's own (_console_dir), swtpm's (_tpm_dir)
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            child = os.open(name, DIR_NOFOLLOW, dir_fd=dirfd)
            try:
                if path.name == SHARES_DIR:
                    _give_share_tree(child, path / name, owner)
                else:
                    _hand_over(child, path / name, owner, top=False)
            finally:
                os.close(child)
        else:
            _give(dirfd, name, path, st, owner)
            if stat.S_ISREG(st.st_mode):
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dirfd)
                try:
                    os.fchmod(fd, stat.S_IMODE(os.fstat(fd).st_mode) & 0o700)  # qemu opens it as its owner
                finally:
                    os.close(fd)


def _give_share_tree(dirfd: int, path: Path, owner: tuple[int, int], top: bool = True) -> None:
    """A config volume's files for virtiofsd, which serves them as the qemu user: all of it that user's,
    the modes the guest sees kept, the top 0700 (its files may be a Secret's)."""
    os.fchown(dirfd, *owner)
    if top:
        os.fchmod(dirfd, 0o700)
    for name in sorted(os.listdir(dirfd)):
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            child = os.open(name, DIR_NOFOLLOW, dir_fd=dirfd)
            try:
                _give_share_tree(child, path / name, owner, top=False)
            finally:
                os.close(child)
        else:
            _give(dirfd, name, path, st, owner)


def _give(dirfd: int, name: str, path: Path, st: os.stat_result, owner: tuple[int, int]) -> None:
    """A file root made in its own directory, given to qemu; a link is refused (none of root's making)."""
    if stat.S_ISLNK(st.st_mode):
        raise DiskkitError(path / name, NOFOLLOW)
    os.chown(name, *owner, dir_fd=dirfd, follow_symlinks=False)  # the entry itself (a socket cannot be opened)

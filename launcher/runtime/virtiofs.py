"""One virtiofsd per filesystem of a VM, started before the domain and stopped with it.

KubeVirt runs virtiofsd in a container of its own and points libvirt at its socket
(pkg/virt-controller/services/virtiofs.go, converter/storage/virtiofs.go); here it is a process of
the launcher, its socket in the VM's run directory, its pid in the VM's record so `launcher stop`
and `gc` from any later process can end it.

KubeVirt's virtiofsd runs as the non-root qemu user (107) with every capability dropped
(securityContextVirtioFS in pkg/virt-controller/services/virtiofs.go). The virtiofsd here is qemu
7.2's C one, which needs CAP_SYS_ADMIN to sandbox itself and switches to the guest's uid for every
file it creates. So it runs as root of a user namespace whose only id is the qemu user the VM runs
as (the launcher's own for an unprivileged launcher; under a root launcher the VM's own uid for the
VM's config shares, and the claim's owner, KubeVirt's 107, for a claim): every file a guest creates
belongs to that user, it cannot create device nodes (mknod is refused in a user namespace) or files of any other
owner (the guest's other ids are not mapped), and its capabilities reach nothing outside the
namespace. The share is a bind mount in the namespace's private mount table, made by the mapped
user (so the launcher's root follows none of the share's path), nosuid and nodev, and read-only
for a read-only share: every guest uid, the owner's included, gets EROFS. virtiofsd is given the
listening socket (--fd) rather than a path, so it takes no pid lock in /run/virtiofsd either.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from diskkit.errors import DiskkitError
from launcher.node.selfexec import end_session, ended
from launcher.runtime import rundir
from launcher.spec.vmi import VMI
from launcher.volumes.context import Share
from launcher.volumes.files import KUBEVIRT_QEMU, give_to_qemu
from launcher.volumes.filesystems import give_share

VIRTIOFSD = "/usr/lib/qemu/virtiofsd"
HELPERS = ("setpriv", "unshare", "mount")  # util-linux
SOCKETS_DIR = "virtiofs"
START_TIMEOUT = 15.0
STOP_TIMEOUT = 5.0
# Run by the mapped user inside the new namespaces: the share bound at the mount point, then virtiofsd.
# stat first: mount says only "bind failed" where stat says why (Permission denied: not the qemu user's to reach).
_MOUNT_THEN_EXEC = 'stat -c %i -- "$1/" >/dev/null && mount --bind -- "$1" "$2" && mount -o "remount,bind,$3" -- "$2" && shift 3 && exec "$@"'


def socket_path(run_dir: Path, name: str) -> Path:
    return run_dir / SOCKETS_DIR / f"{name}.sock"


def mount_point(sock: Path) -> Path:
    """Where the share appears in virtiofsd's namespace; empty for everyone else."""
    return sock.with_suffix(".root")


def sockets(vmi: VMI, run_dir: Path) -> tuple[tuple[str, str], ...]:
    return tuple((fs.name, str(socket_path(run_dir, fs.name))) for fs in vmi.domain.devices.filesystems)


def check_runnable(vmi: VMI) -> None:
    """Refuse before anything is pulled or made: a VM whose filesystems cannot be served."""
    if not vmi.domain.devices.filesystems:
        return
    first = vmi.domain.devices.filesystems[0]
    at = f"spec.domain.devices.filesystems[{first.index}]"
    if not os.access(VIRTIOFSD, os.X_OK):
        raise DiskkitError(at, f"filesystem {first.name} needs {VIRTIOFSD} (Debian package qemu-system-common)")
    for tool in HELPERS:
        if shutil.which(tool) is None:
            raise DiskkitError(at, f"filesystem {first.name} needs {tool} (util-linux) to run virtiofsd in a user namespace")


def command(source: Path, target: Path, read_only: bool, listen_fd: int, owner: tuple[int, int], euid: int) -> list[str]:
    """virtiofsd as root of a user namespace that is `owner` outside, serving `source` bound at `target`."""
    # As root, first become the owner: the namespace is then made and mapped by that user alone.
    become = ["--reuid", str(owner[0]), "--regid", str(owner[1]), "--clear-groups"] if euid == 0 else []
    flags = "nosuid,nodev" + (",ro" if read_only else "")
    return ["setpriv", *become, "--no-new-privs", "--",
            "unshare", "--map-root-user", "--mount", "--propagation", "private", "--",
            "/bin/sh", "-c", _MOUNT_THEN_EXEC, "virtiofs-mount", str(source), str(target), flags,
            VIRTIOFSD, f"--fd={listen_fd}", "-o", f"source={target}", "-o", "cache=auto", "-f"]


def start(vmi: VMI, shares: dict[str, Share], run_dir: Path, qemu: tuple[int, int] = KUBEVIRT_QEMU,
          owner: tuple[int, int] | None = None) -> list[dict]:
    """Start every filesystem's virtiofsd and wait for it to serve; [{name, pid, socket}] for the record.
    `qemu` connects to the sockets, and virtiofsd serves the VM's own config shares (in its run directory)
    as that user; a claim's directory is served as its `owner` (KubeVirt's qemu user), whose files it holds."""
    started: list[dict] = []
    owner = owner or qemu
    if 0 in (owner[0], qemu[0]) and vmi.domain.devices.filesystems:
        # Root's namespace maps root: virtiofsd would hold host root's capabilities over host root's files.
        first = vmi.domain.devices.filesystems[0]
        raise DiskkitError(f"spec.domain.devices.filesystems[{first.index}]",
                           f"filesystem {first.name}: qemu runs as root here, and virtiofsd runs as the qemu user; set a user in qemu.conf")
    try:
        for fs in vmi.domain.devices.filesystems:
            at = f"spec.domain.devices.filesystems[{fs.index}]"
            share = shares[fs.name]
            serves = qemu if rundir.inside(share.path, run_dir) else owner
            if not share.read_only:
                give_share(share.path, serves, at)
            started.append(_start_one(share, socket_path(run_dir, fs.name), at, serves, qemu))
            started[-1]["name"] = fs.name
    except BaseException:
        stop(started)
        raise
    return started


def _listen(sock: Path, qemu: tuple[int, int]) -> socket.socket:
    sock.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(sock))
        listener.listen(1)
        give_to_qemu(sock, qemu)  # qemu connects to it
    except BaseException:
        listener.close()
        raise
    return listener


def _start_one(share: Share, sock: Path, at: str, owner: tuple[int, int], qemu: tuple[int, int]) -> dict:
    # In the handed-over run directory: root's directories, which qemu and virtiofsd only traverse.
    rundir.traversable_dir(sock.parent, qemu)
    # A claim's virtiofsd (its owner's) never enters the VM's run directory, the VM's uid's alone: its
    # share is bound over itself in its private mount table.
    target = rundir.traversable_dir(mount_point(sock), owner) if owner == qemu else share.path
    log_path = sock.with_suffix(".log")
    with _listen(sock, qemu) as listener, open(log_path, "wb") as log:
        # Its own session: a Ctrl-C meant for the launcher must not end it before the domain is gone.
        proc = subprocess.Popen(command(share.path, target, share.read_only, listener.fileno(), owner, os.geteuid()),
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(listener.fileno(),),
                                start_new_session=True)
    entry = {"pid": proc.pid, "socket": str(sock), "root": str(target)}
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while not _is_ours(entry):  # the share mounted and virtiofsd exec'd
            if proc.poll() is not None:
                raise DiskkitError(at, f"virtiofsd for {share.path}, run as uid {owner[0]}, exited ({proc.returncode}): {_last_line(log_path)}")
            if time.monotonic() > deadline:
                raise DiskkitError(at, f"virtiofsd for {share.path} did not start within {START_TIMEOUT:g} s")
            time.sleep(0.02)
    except BaseException:
        # Not virtiofsd yet, so stop() would not recognise it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return entry


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip() and "dmesg(1)" not in line]
    return lines[-1].strip() if lines else "no output"


def _is_ours(entry: dict) -> bool:
    """The pid is still the virtiofsd we started (pids are reused): it serves this socket's mount point."""
    try:
        cmdline = Path(f"/proc/{entry['pid']}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    source = f"source={entry.get('root') or mount_point(Path(entry['socket']))}".encode()
    return cmdline[0] == VIRTIOFSD.encode() and source in cmdline


def stop(entries: list[dict]) -> None:
    """End each virtiofsd (TERM, then KILL) and remove its socket."""
    for entry in entries:
        if _is_ours(entry):
            end_session(entry["pid"], STOP_TIMEOUT)
        else:
            ended(entry["pid"])  # reap it if it already ended as our child
        Path(entry["socket"]).unlink(missing_ok=True)

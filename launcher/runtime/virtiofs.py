"""One virtiofsd per filesystem of a VM, started before the domain and stopped with it.

KubeVirt runs virtiofsd in a container of its own and points libvirt at its socket
(pkg/virt-controller/services/virtiofs.go, converter/storage/virtiofs.go); here it is a process of
the launcher, its socket in the VM's run directory, its pid in the VM's record so `launcher stop`
and `gc` from any later process can end it.

The virtiofsd here is qemu 7.2's C one. Unprivileged it cannot run: it takes a lock in
/run/virtiofsd, then sandboxes itself with unshare(CLONE_NEWPID|CLONE_NEWNS) (sandbox=namespace) or
chroot(2) (sandbox=chroot), both refused without CAP_SYS_ADMIN / CAP_SYS_CHROOT; it has no
sandbox=none (KubeVirt's Rust virtiofsd has). So filesystems need the launcher to run as root.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from diskkit.errors import DiskkitError
from launcher.spec.vmi import VMI
from launcher.volumes.context import Share
from launcher.volumes.files import KUBEVIRT_QEMU, give_to_qemu

VIRTIOFSD = "/usr/lib/qemu/virtiofsd"
SOCKETS_DIR = "virtiofs"
START_TIMEOUT = 15.0
STOP_TIMEOUT = 5.0
# This virtiofsd has no read-only export. Without these capabilities its root cannot write, chmod or
# chown files it does not own (filesystems.write_tree gives them to the qemu user): read-only for the guest.
READ_ONLY = ("-o", "modcaps=-dac_override:-fowner:-chown")
LOCK_DIR = Path("/run/virtiofsd")  # its pid lock per socket, named after the socket's path


def lock_path(sock: str) -> Path:
    return LOCK_DIR / (sock.replace("/", ".") + ".pid")


def socket_path(run_dir: Path, name: str) -> Path:
    return run_dir / SOCKETS_DIR / f"{name}.sock"


def sockets(vmi: VMI, run_dir: Path) -> tuple[tuple[str, str], ...]:
    return tuple((fs.name, str(socket_path(run_dir, fs.name))) for fs in vmi.domain.devices.filesystems)


def check_runnable(vmi: VMI) -> None:
    """Refuse before anything is pulled or made: a VM whose filesystems cannot be served."""
    if not vmi.domain.devices.filesystems:
        return
    first = vmi.domain.devices.filesystems[0]
    at = f"spec.domain.devices.filesystems[{first.index}]"
    if os.geteuid() != 0:
        raise DiskkitError(at, f"filesystem {first.name} needs the launcher to run as root: {VIRTIOFSD} (qemu 7.2's C virtiofsd)"
                               " locks in /run/virtiofsd and sandboxes itself with unshare(CLONE_NEWPID|CLONE_NEWNS) or chroot,"
                               " which need CAP_SYS_ADMIN / CAP_SYS_CHROOT")
    if not os.access(VIRTIOFSD, os.X_OK):
        raise DiskkitError(at, f"filesystem {first.name} needs {VIRTIOFSD} (Debian package qemu-system-common)")


def start(vmi: VMI, shares: dict[str, Share], run_dir: Path, owner: tuple[int, int] = KUBEVIRT_QEMU) -> list[dict]:
    """Start every filesystem's virtiofsd and wait for its socket; [{name, pid, socket}] for the record."""
    started: list[dict] = []
    try:
        for fs in vmi.domain.devices.filesystems:
            started.append(_start_one(shares[fs.name], socket_path(run_dir, fs.name), f"spec.domain.devices.filesystems[{fs.index}]", owner))
            started[-1]["name"] = fs.name
    except BaseException:
        stop(started)
        raise
    return started


def _start_one(share: Share, sock: Path, at: str, owner: tuple[int, int]) -> dict:
    sock.parent.mkdir(parents=True, exist_ok=True)
    sock.unlink(missing_ok=True)
    log_path = sock.with_suffix(".log")
    with open(log_path, "wb") as log:
        # Its own session: a Ctrl-C meant for the launcher must not end it before the domain is gone.
        proc = subprocess.Popen([VIRTIOFSD, f"--socket-path={sock}", "-o", f"source={share.path}", "-o", "cache=auto",
                                 *(READ_ONLY if share.read_only else ()), "-f"],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    entry = {"pid": proc.pid, "socket": str(sock)}
    deadline = time.monotonic() + START_TIMEOUT
    while not sock.exists():
        if proc.poll() is not None:
            raise DiskkitError(at, f"virtiofsd exited ({proc.returncode}): {_last_line(log_path)}")
        if time.monotonic() > deadline:
            stop([entry])
            raise DiskkitError(at, f"virtiofsd did not create {sock} within {START_TIMEOUT:g} s")
        time.sleep(0.05)
    give_to_qemu(sock, owner)  # qemu runs as the qemu user and connects to it
    return entry


def _last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def _is_ours(entry: dict) -> bool:
    """The pid is still the virtiofsd we started (pids are reused)."""
    try:
        cmdline = Path(f"/proc/{entry['pid']}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"--socket-path={entry['socket']}".encode() in cmdline


def _gone(pid: int) -> bool:
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True  # our child, reaped
    except ChildProcessError:
        pass  # started by another launcher process: its parent (or init) reaps it
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


def stop(entries: list[dict]) -> None:
    """End each virtiofsd (TERM, then KILL) and remove its socket."""
    for entry in entries:
        if _is_ours(entry):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    # The whole session: with sandbox=namespace the serving process is a child in a PID
                    # namespace of its own, the one we started only waits for it.
                    os.killpg(entry["pid"], sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + STOP_TIMEOUT
                while not _gone(entry["pid"]) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if _gone(entry["pid"]):
                    break
        else:
            _gone(entry["pid"])  # reap it if it already ended as our child
        Path(entry["socket"]).unlink(missing_ok=True)
        if _gone(entry["pid"]):
            lock_path(entry["socket"]).unlink(missing_ok=True)  # virtiofsd leaves it behind

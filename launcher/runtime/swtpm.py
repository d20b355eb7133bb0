"""A root launcher's VM's TPM: the swtpm behind it, run by the launcher as the VM's own uid.

libvirt runs an `emulator` TPM's swtpm itself: under the system daemon as qemu.conf's swtpm_user (tss
by default), every VM's TPM one uid, with a socket a qemu of the VM's own uid cannot open unless libvirt
relabels (and a root launcher's domains tell it not to: launcher.runtime.vmuser); under a VM's own
session daemon as the VM's uid, with the state in that daemon's HOME, which goes at the VM's stop. So a
root launcher runs the swtpm itself, as libvirt would (`swtpm_setup` once for a new TPM, `swtpm socket
--terminate` per run), and the domain connects qemu to it (libvirt 9.0's external backend): the swtpm
is the VM's uid, its state directory the run directory's `tpm/` (the VM's uid's while it runs: swtpm
writes its state there), its control socket in `console/`, qemu's own socket directory. A
VirtualMachine's persistent TPM state is copied in before and kept after the run (launcher.volumes.vmstate).

A new TPM is manufactured as libvirt's qemuTPMEmulatorRunSetup does (an EK, its certificate and the
platform certificate, NV locked), by root in the run directory while it is still root's alone; the
certificates are signed by a local CA made for that VM alone in a directory removed right after (an
unprivileged libvirt's `--create-config-files` does the same in its user's configuration), so the
node's /var/lib/swtpm-localca and root's HOME are untouched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from diskkit.errors import DiskkitError
from launcher.node.cache import private_dirs
from launcher.runtime.rundir import qemu_socket
from launcher.spec.vmi import VMI
from launcher.volumes.vmstate import TPM_STATE, tpm_dir

SOCKET = "swtpm"  # in qemu's socket directory, beside its VNC and agent sockets
SETUP_DIR = "tpm-setup"  # the local CA's configuration and keys while a new TPM is manufactured
LOG = "swtpm.log"
SETUP_TIMEOUT = 120
START_TIMEOUT = 30


def socket_path(run_dir: Path) -> str:
    path = qemu_socket(run_dir, SOCKET)
    if path is None:
        raise DiskkitError(run_dir, "is too long a path for the TPM's socket (107 bytes at most); use a shorter --cache-dir")
    return path


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/bin:/bin")
    if found is None:
        raise DiskkitError(name, "not installed: a VM's TPM is emulated by swtpm (apt-get install swtpm swtpm-tools)")
    return found


def _ran(cmd: list[str], what: str, timeout: float, env: dict | None = None) -> None:
    try:
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout, cwd="/",
                              env=env or {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C"})
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DiskkitError(what, f"did not run: {getattr(exc, 'strerror', None) or exc}") from None
    if proc.returncode != 0:
        said = " ".join((proc.stderr or proc.stdout or "").split())[-300:] or f"exit status {proc.returncode}"
        raise DiskkitError(what, f"failed: {said}")


def manufacture(run_dir: Path, vmi: VMI) -> None:
    """A new TPM's state in the run directory's tpm/ (still root's alone), unless a kept one was put there."""
    state = tpm_dir(run_dir)
    if (state / TPM_STATE).exists():
        return
    setup = private_dirs(run_dir, run_dir / SETUP_DIR)
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL": "C", "HOME": str(setup), "XDG_CONFIG_HOME": str(setup)}
    try:
        swtpm_setup = _tool("swtpm_setup")
        _ran([swtpm_setup, "--create-config-files", "root"], f"swtpm_setup for {vmi.domain_name}'s TPM", SETUP_TIMEOUT, env)
        _ran([swtpm_setup, "--tpm2", "--tpm-state", str(state), "--vmid", f"{vmi.domain_name}:{vmi.uuid}",
              "--logfile", str(setup / "setup.log"), "--createek", "--create-ek-cert", "--create-platform-cert",
              "--lock-nvram", "--not-overwrite"], f"swtpm_setup for {vmi.domain_name}'s TPM", SETUP_TIMEOUT, env)
    finally:
        shutil.rmtree(setup, ignore_errors=True)  # the VM's local CA signs nothing more


def start(run_dir: Path, ids: tuple[int, int]) -> None:
    """The VM's swtpm, as its uid, on the state in tpm/ (handed to that uid); it ends once qemu's
    connection does (--terminate), or with the uid's other processes."""
    uid, gid = ids
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--",
           _tool("swtpm"), "socket", "--daemon", "--terminate", "--tpm2",
           "--ctrl", f"type=unixio,path={socket_path(run_dir)},mode=0600",
           "--tpmstate", f"dir={tpm_dir(run_dir)},mode=0600", "--log", f"file={tpm_dir(run_dir) / LOG}"]
    _ran(cmd, f"swtpm as uid {uid}", START_TIMEOUT)


def stop(run_dir: Path, ids: tuple[int, int]) -> None:
    """Ask the VM's swtpm to end (a domain that never started leaves it listening), as its uid: the socket is
    reached only where that uid may go. Whatever does not answer ends with the uid's other processes."""
    uid, gid = ids
    try:
        path = socket_path(run_dir)
    except DiskkitError:
        return
    if not os.path.lexists(path):
        return
    cmd = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", _tool("swtpm_ioctl"), "--unix", path, "-s"]
    try:
        subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=START_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        pass

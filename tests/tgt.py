"""A real iSCSI target (Linux SCSI target framework, ``tgtd`` + ``tgtadm``) started by the tests.

``start_target`` runs a PRIVATE ``tgtd`` in the foreground: its control socket lives in a directory
of its own (``TGT_IPC_SOCKET``, read by both tgtd and tgtadm), so any number of instances coexist
and none ever talks to a system tgtd (/var/run/tgtd/socket.0).  It listens only on
127.0.0.1:<free port> and serves one target (tid 1) whose LUN 1 is a raw file:

    tgtd -f --iscsi portal=127.0.0.1:PORT                       (env TGT_IPC_SOCKET=DIR/ctl)
    tgtadm --lld iscsi --mode target --op new --tid 1 --targetname IQN
    tgtadm --lld iscsi --mode logicalunit --op new --tid 1 --lun 1 --backing-store FILE
    tgtadm --lld iscsi --mode target --op bind --tid 1 --initiator-address ALL
  with chap=(user, password), incoming CHAP (the initiator must authenticate):
    tgtadm --lld iscsi --mode account --op new --user USER --password PASSWORD
    tgtadm --lld iscsi --mode account --op bind --tid 1 --user USER

Things learnt the hard way: tgtd ignores SIGTERM (stop = SIGKILL; the rdwr backing store writes
with pwrite, so nothing is lost), and a portal it cannot bind is only logged, tgtd keeps running,
so readiness means "the listening socket on PORT belongs to OUR tgtd".

The ``iscsi_target`` fixture is a factory: ``iscsi_target(backing, chap=None, iqn=None, serial=None)``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.distribution import die_with_parent, free_port

TGTD = "tgtd"
TGTADM = "tgtadm"
HOST = "127.0.0.1"
TID = 1
LUN = 1
READY_TIMEOUT = 10.0
BIND_FAILED = "failed to create/bind to portal"


def default_iqn() -> str:
    return f"iqn.2026-11.io.diskkit:test-{secrets.token_hex(4)}"


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on 127.0.0.1:port (from /proc/net/tcp)."""
    want = f"0100007F:{port:04X}"
    inodes = set()
    with open("/proc/net/tcp") as f:
        next(f)
        for line in f:
            cols = line.split()
            if cols[1] == want and cols[3] == "0A":  # 0A = LISTEN
                inodes.add(cols[9])
    return inodes


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    try:
        names = os.listdir(fd_dir)
    except OSError:
        return inodes
    for name in names:
        try:
            link = os.readlink(f"{fd_dir}/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    return inodes


class PortalBusy(RuntimeError):
    pass


@dataclass
class RunningTarget:
    host: str
    port: int
    iqn: str
    backing: Path
    chap: tuple[str, str] | None = None
    serial: str | None = None
    lun: int = LUN
    workdir: Path | None = None
    log_path: Path | None = None
    _ipc_dir: Path | None = field(default=None, repr=False)
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    _log_file: object = field(default=None, repr=False)

    @property
    def portal(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The libiscsi URL (no credentials): iscsi://127.0.0.1:PORT/IQN/1."""
        return f"iscsi://{self.portal}/{self.iqn}/{self.lun}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def image_opts(self, password_secret: str | None = None) -> str:
        """``qemu-img --image-opts`` / ``-drive`` options for this LUN; with CHAP, pass the id of a
        ``--object secret,id=ID,data=PASSWORD`` as password_secret."""
        opts = f"driver=iscsi,transport=tcp,portal={self.portal},target={self.iqn},lun={self.lun}"
        if self.chap:
            opts += f",user={self.chap[0]}"
            if password_secret:
                opts += f",password-secret={password_secret}"
        return opts

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            return ""

    def tgtadm(self, *args: str) -> str:
        """Run tgtadm against THIS tgtd; raise with its output on failure."""
        proc = subprocess.run(
            [TGTADM, "--lld", "iscsi", *map(str, args)], capture_output=True, text=True, timeout=10,
            env={**os.environ, "TGT_IPC_SOCKET": str(self._ipc_dir / "ctl")},
        )
        if proc.returncode != 0:
            raise RuntimeError(f"tgtadm {' '.join(map(str, args))} failed ({proc.returncode}): {proc.stderr.strip()}\n"
                               f"tgtd log:\n{self.log_text()}")
        return proc.stdout

    def _wait(self, what: str, ok) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            code = self._proc.poll()
            if code is not None:
                raise RuntimeError(f"tgtd exited with {code} while waiting for {what}:\n{self.log_text()}")
            if BIND_FAILED in self.log_text():
                raise PortalBusy(f"tgtd could not bind {self.portal}:\n{self.log_text()}")
            if ok():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"tgtd: no {what} after {READY_TIMEOUT}s:\n{self.log_text()}")
            time.sleep(0.02)

    def _control_ready(self) -> bool:
        if not (self._ipc_dir / "ctl.0").exists():
            return False
        try:
            self.tgtadm("--mode", "system", "--op", "show")
            return True
        except RuntimeError:
            return False

    def _portal_ready(self) -> bool:
        # Ours, not some other process that happens to own the port.
        if not (_listening_inodes(self.port) & _socket_inodes(self._proc.pid)):
            return False
        try:
            with socket.create_connection((self.host, self.port), timeout=1):
                return True
        except OSError:
            return False

    def _start(self) -> None:
        self._log_file = open(self.log_path, "ab")
        self._proc = subprocess.Popen(
            [TGTD, "-f", "--iscsi", f"portal={self.portal}"],
            stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
            env={**os.environ, "TGT_IPC_SOCKET": str(self._ipc_dir / "ctl")}, preexec_fn=die_with_parent(signal.SIGKILL),  # tgtd ignores SIGTERM
        )
        self._wait("control socket", self._control_ready)
        self._wait(f"listening portal {self.portal}", self._portal_ready)
        self.tgtadm("--mode", "target", "--op", "new", "--tid", TID, "--targetname", self.iqn)
        self.tgtadm("--mode", "logicalunit", "--op", "new", "--tid", TID, "--lun", self.lun,
                    "--backing-store", self.backing)
        if self.serial:  # the unit serial number an initiator reads (VPD page 0x80)
            self.tgtadm("--mode", "logicalunit", "--op", "update", "--tid", TID, "--lun", self.lun, "--params", f"scsi_sn={self.serial}")
        self.tgtadm("--mode", "target", "--op", "bind", "--tid", TID, "--initiator-address", "ALL")
        if self.chap:
            user, password = self.chap
            self.tgtadm("--mode", "account", "--op", "new", "--user", user, "--password", password)
            self.tgtadm("--mode", "account", "--op", "bind", "--tid", TID, "--user", user)

    def stop(self) -> None:
        """Kill tgtd (it ignores SIGTERM) and remove its control socket directory."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None


def _ipc_dir(workdir: Path) -> Path:
    """An empty directory for the control socket (DIR/ctl.0): in workdir, unless that path would
    exceed the 108-byte limit of a Unix socket address."""
    if len(os.fsencode(workdir / "ipc-xxxxxxxx" / "ctl.0.lock")) < 100:
        return Path(tempfile.mkdtemp(prefix="ipc-", dir=workdir))
    return Path(tempfile.mkdtemp(prefix="dk-tgt-"))


def start_target(workdir: Path, backing: Path, iqn: str | None = None,
                 chap: tuple[str, str] | None = None, serial: str | None = None) -> RunningTarget:
    """Start a private tgtd on 127.0.0.1:<free port> exporting ``backing`` (raw) as LUN 1 of ``iqn``
    (with ``serial`` as its unit serial number)."""
    if shutil.which(TGTD) is None or shutil.which(TGTADM) is None:
        raise RuntimeError("tgtd/tgtadm not found on PATH (Debian package `tgt` is required by the tests)")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    backing = Path(backing).resolve()
    if not backing.is_file():
        raise FileNotFoundError(f"backing file {backing} does not exist")
    iqn = iqn or default_iqn()
    last: Exception | None = None
    for _ in range(5):  # the free port may be taken between free_port() and tgtd's bind
        port = free_port()
        target = RunningTarget(
            host=HOST, port=port, iqn=iqn, backing=backing, chap=chap, serial=serial, workdir=workdir,
            log_path=workdir / f"tgtd-{port}.log", _ipc_dir=_ipc_dir(workdir),
        )
        try:
            target._start()
            return target
        except PortalBusy as e:
            last = e
            target.stop()
        except BaseException:
            target.stop()
            raise
    raise RuntimeError(f"tgtd: no free portal after 5 attempts: {last}")


class IscsiTarget:
    """Factory behind the ``iscsi_target`` fixture: each call starts one tgtd; ``close`` stops them all."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.targets: list[RunningTarget] = []

    def __call__(self, backing: Path, chap: tuple[str, str] | None = None, iqn: str | None = None,
                 serial: str | None = None) -> RunningTarget:
        target = start_target(self.root / f"tgt{len(self.targets)}", backing, iqn=iqn, chap=chap, serial=serial)
        self.targets.append(target)
        return target

    def close(self) -> None:
        for target in self.targets:
            target.stop()
        self.targets.clear()


# --- pytest fixture (import it in a test module or conftest) -----------------------------------

@pytest.fixture
def iscsi_target(tmp_path_factory):
    """``iscsi_target(backing, chap=None, iqn=None, serial=None) -> RunningTarget``; every target stopped at test end."""
    factory = IscsiTarget(tmp_path_factory.mktemp("iscsi"))
    try:
        yield factory
    finally:
        factory.close()

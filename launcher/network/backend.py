"""A VM's pod network from the launcher's side: each NIC's switch (launcher.network.switch) started
before the domain and ended with it, and the forwards `launcher port-forward` and `ssh` open through it.

Each NIC has, in the run directory's `net/` (root's, qemu only passes through, as for virtiofs):
N.sock, the stream socket qemu connects to (qemu's), N.forward, the switch's control socket (the
launcher user's, 0600: root and that user alone may ask for a forward; not qemu's user, who runs the
switch), and N.log. The sockets are made here and handed to the switch open, so qemu may
connect before the switch has started: its frames wait in the socket. The switch runs as the user qemu
runs as, in a session of its own (a Ctrl-C meant for the launcher must not end it before the domain);
its pid is in the VM's record so `launcher stop` and `gc` from any later process can end it.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from diskkit.errors import DiskkitError
from launcher.network import bindings, pod
from launcher.network.bindings import GATEWAY_MAC, Plan
from launcher.node.selfexec import end_session, ended, module_argv
from launcher.spec.vmi import VMI
from launcher.volumes.files import give_to_qemu

SWITCH = "launcher.network.switch"
NET_DIR = "net"  # in the VM's run directory
LONGEST_SOCKET = "99.forward"  # of the sockets in it: N.sock and N.forward, a VM's NICs numbered from 0
READY_TIMEOUT = 20.0
STOP_TIMEOUT = 5.0
ANSWER_LIMIT = 4096


def check(vmi: VMI) -> None:
    """Refuse before anything is pulled: a pod network with no passt to serve it."""
    pod_nics = _pod_nics(vmi)
    if pod_nics and shutil.which("passt") is None:
        first = pod_nics[0]
        at = "spec.domain.devices.interfaces" if first.index < 0 else f"spec.domain.devices.interfaces[{first.index}]"
        raise DiskkitError(at, f"interface {first.name} on the pod network needs passt (Debian package passt)")


def plan(vmi: VMI, publish_address: str | None = None) -> list[Plan]:
    """Each NIC's plan on this host's network, refusals included (see launcher.network.bindings)."""
    pod_nics = _pod_nics(vmi)
    if not pod_nics:
        return []
    here = pod.read()
    return [bindings.plan(iface, here, publish_address) for iface in pod_nics]


def _pod_nics(vmi: VMI) -> list:
    """The NICs on the pod network (a Multus bridge network's are launcher.network.linuxbridge's)."""
    return [iface for iface in vmi.domain.devices.interfaces if iface.on_pod_network]


@dataclass
class Started:
    entries: list[dict] = field(default_factory=list)  # for the VM's record
    status: dict[int, int] = field(default_factory=dict)  # switch pid -> read end of its status pipe

    def wait(self) -> None:
        """Each switch has its stacks up (what they publish bound), or its one line is raised."""
        deadline = time.monotonic() + READY_TIMEOUT
        try:
            for entry in self.entries:
                fd = self.status.pop(entry["pid"])
                with selectors.DefaultSelector() as waiting:
                    waiting.register(fd, selectors.EVENT_READ)
                    got = os.read(fd, 512).decode(errors="replace").strip() if waiting.select(max(0.0, deadline - time.monotonic())) else None
                os.close(fd)
                if got == "ready":
                    continue
                why = "did not start in time" if got is None else got.removeprefix("error: ") or "exited"
                raise DiskkitError(f"interface {entry['interface']}", f"its pod network did not start: {why} ({_last_line(entry['log'])})")
        finally:
            self.close()

    def close(self) -> None:
        for fd in self.status.values():
            os.close(fd)
        self.status.clear()


def _last_line(path: str) -> str:
    with contextlib.suppress(OSError):
        with open(path, "rb") as f:
            lines = [line for line in f.read(1 << 16).decode(errors="replace").splitlines() if line.strip()]
        if lines:
            return lines[-1].strip()
    return "no output"


def _listen(path: Path, mode: int) -> socket.socket:
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        os.chmod(path, mode)
        listener.listen(16)
    except BaseException:
        listener.close()
        raise
    return listener


def config(plan_: Plan, socket_path: Path) -> dict:
    """What the switch is told on its command line (no secret: `ps` shows it)."""
    policy = plan_.policy
    return {"interface": plan_.interface, "socket": str(socket_path), "online": plan_.online,
            "stack": list(plan_.stack), "forwards": list(plan_.forwards_stack()), "dns_upstream": [str(a) for a in plan_.dns_upstream],
            "gateway4": str(policy.gateway4 or ""), "gateway6": str(policy.gateway6 or ""),
            "closed4": str(policy.closed4 or ""), "closed6": str(policy.closed6 or ""), "dns_forwarder": policy.dns_forwarder,
            "gateway_mac": GATEWAY_MAC}


def start(plans: list[Plan], sockets: list[Path], owner: tuple[int, int]) -> Started:
    """Start each NIC's switch on its socket (in a directory the caller made for qemu to pass through);
    returns at once: `Started.wait` says whether they came up."""
    started = Started()
    try:
        for plan_, sock in zip(plans, sockets):
            started.entries.append(_start_one(plan_, sock, owner, started))
    except BaseException:
        started.close()
        stop(started.entries)
        raise
    return started


def _start_one(plan_: Plan, sock: Path, owner: tuple[int, int], started: Started) -> dict:
    forward, log_path = sock.with_suffix(".forward"), sock.with_suffix(".log")
    guest = _listen(sock, 0o600)
    try:
        give_to_qemu(sock, owner)  # qemu runs as this user and connects to it
        control = _listen(forward, 0o600)  # the launcher user's
    except BaseException:
        guest.close()
        raise
    status_r, status_w = os.pipe()
    try:
        cfg = {**config(plan_, sock), "guest_fd": guest.fileno(), "control_fd": control.fileno(), "status_fd": status_w}
        become = ["--reuid", str(owner[0]), "--regid", str(owner[1]), "--clear-groups"] if os.geteuid() == 0 else []
        log_path.unlink(missing_ok=True)
        with open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600), "wb") as log:
            proc = subprocess.Popen(["setpriv", *become, "--no-new-privs", "--", *module_argv(SWITCH), json.dumps(cfg)],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    pass_fds=(guest.fileno(), control.fileno(), status_w), start_new_session=True)
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)
        guest.close()
        control.close()
    started.status[proc.pid] = status_r
    return {"interface": plan_.interface, "binding": plan_.binding, "pid": proc.pid, "socket": str(sock),
            "forward": str(forward), "log": str(log_path)}


def _is_ours(entry: dict) -> bool:
    """The pid is still the switch we started (pids are reused): its command line names its socket."""
    try:
        cmdline = Path(f"/proc/{entry['pid']}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return SWITCH.encode() in cmdline and any(json.dumps(entry["socket"]).encode() in arg for arg in cmdline)


def stop(entries: list[dict]) -> None:
    """End each switch and its stacks (TERM, then KILL, to its whole session) and remove its sockets."""
    for entry in entries:
        if _is_ours(entry):
            end_session(entry["pid"], STOP_TIMEOUT)
        else:
            ended(entry["pid"])  # reap it if it already ended as our child
        for path in (entry["socket"], entry["forward"]):
            Path(path).unlink(missing_ok=True)


class GuestSocket:
    """A connection (TCP) or socket (UDP) to a guest port, made by the VM's switch; the switch keeps its
    flow while `control` is open."""

    def __init__(self, sock: socket.socket, control: socket.socket):
        self.sock, self.control = sock, control

    def close(self) -> None:
        self.sock.close()
        self.control.close()

    def __enter__(self) -> "GuestSocket":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_forward(entry: dict, protocol: str, port: int, timeout: float = 30.0) -> GuestSocket:
    """A socket to the guest's `port` through the switch of the record's `entry`."""
    control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        control.settimeout(timeout)
        try:
            control.connect(entry["forward"])
        except OSError as exc:
            raise DiskkitError(entry["forward"], f"cannot reach the VM's pod switch ({exc.strerror}); is the VM running?") from None
        control.sendall((json.dumps({"protocol": protocol, "port": port}) + "\n").encode())
        try:
            message, fds, _, _ = socket.recv_fds(control, ANSWER_LIMIT, 1)
        except OSError as exc:
            raise DiskkitError(entry["forward"], f"the VM's pod switch did not answer ({exc.strerror or exc})") from None
        if not fds:
            try:
                answer = json.loads(message.decode() or "{}")
            except ValueError:
                answer = {}
            raise DiskkitError(f"guest port {port}", f"cannot forward to it: {answer.get('error', 'the pod switch refused')}")
        sock = socket.socket(fileno=fds[0])
        for extra in fds[1:]:
            os.close(extra)
        control.settimeout(None)
        return GuestSocket(sock, control)
    except BaseException:
        control.close()
        raise

"""`launcher port-forward`: local ports to a running VM's guest ports, as `virtctl port-forward` does.

The pod network is qemu's user-mode stack (launcher.render.interfaces), so a forward is a rule qemu
adds at run time (hostfwd_add on the NIC's netdev, through libvirt's monitor passthrough): qemu itself
listens on the local address and connects each client to the guest's port, declared in `ports` or not.
Nothing on the host changes but that listening socket, which goes with the rule (hostfwd_remove) when
the forward ends, or with qemu when the VM stops. Two VMs are told apart by the local ports they hold.

Argument forms follow pkg/virtctl/portforward (portforward.go ParseTarget, ports.go parsePort):
TYPE/NAME[/NAMESPACE] with TYPE vm, vmi or their long and plural forms, and [PROTOCOL/]LOCAL[:REMOTE];
a bare NAME is taken too. --stdio carries one TCP connection over stdin and stdout (virtctl ssh's
ProxyCommand use).
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass
from typing import Callable

from diskkit.errors import DiskkitError

_KINDS = {"vm": "vm", "vms": "vm", "virtualmachine": "vm", "virtualmachines": "vm",
          "vmi": "vmi", "vmis": "vmi", "virtualmachineinstance": "vmi", "virtualmachineinstances": "vmi"}


@dataclass(frozen=True)
class Forward:
    protocol: str  # "tcp" | "udp"
    local: int
    remote: int


def parse_target(text: str) -> str:
    """TYPE/NAME[/NAMESPACE] or NAME -> the name `launcher.runtime.vms.find_record` takes."""
    if not text:
        raise DiskkitError("port-forward", "target cannot be empty")
    parts = text.split("/")
    if len(parts) == 1:
        return text
    if len(parts) > 3:
        raise DiskkitError(text, "target is not valid with more than two '/'")
    if parts[0].lower() not in _KINDS:
        raise DiskkitError(text, f"unsupported resource type '{parts[0]}'")
    if len(parts) == 3 and not parts[2]:
        raise DiskkitError(text, "namespace cannot be empty")
    if not parts[1]:
        raise DiskkitError(text, "name cannot be empty")
    return f"{parts[2]}/{parts[1]}" if len(parts) == 3 else parts[1]


def parse_port(text: str) -> Forward:
    protocol, _, ports = text.rpartition("/")
    protocol = protocol or "tcp"
    if protocol not in ("tcp", "udp"):
        raise DiskkitError(text, f"unsupported protocol {protocol} (tcp or udp)")
    numbers = [p for p in ports.split(":") if p]
    if not numbers:
        raise DiskkitError(text, "invalid port, missing local and/or remote port")
    try:
        local = int(numbers[0])
        remote = int(numbers[1]) if len(numbers) > 1 else local
    except ValueError:
        raise DiskkitError(text, "ports must be numbers: [PROTOCOL/]LOCAL[:REMOTE]") from None
    if not (0 <= local < 65536 and 0 < remote < 65536) or len(numbers) > 2:
        raise DiskkitError(text, "ports must be in range 0 < x < 65536 (a local 0 picks a free port)")
    return Forward(protocol, local, remote)


def netdev_of(record: dict) -> str:
    nets = record.get("network") or []
    if not nets:
        raise DiskkitError(record.get("vmi", "?"), "has no pod network interface to forward to (autoattachPodInterface: false, or started before networks)")
    return nets[0]["netdev"]


def _free_port(protocol: str, address: str) -> int:
    # qemu reports no port it picked itself; a port free a moment ago is taken, and a clash retried.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM if protocol == "tcp" else socket.SOCK_DGRAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


class Forwarder:
    """hostfwd rules on one VM's NIC; `monitor(command) -> reply` is libvirt's HMP passthrough."""

    def __init__(self, monitor: Callable[[str], str], netdev: str, address: str = "127.0.0.1"):
        self.monitor, self.netdev, self.address = monitor, netdev, address
        self.active: list[Forward] = []

    def add(self, forward: Forward) -> Forward:
        for _ in range(5 if forward.local == 0 else 1):
            local = forward.local or _free_port(forward.protocol, self.address)
            rule = f"{forward.protocol}:{self.address}:{local}-:{forward.remote}"
            reply = self.monitor(f"hostfwd_add {self.netdev} {rule}").strip()
            if not reply:
                added = Forward(forward.protocol, local, forward.remote)
                self.active.append(added)
                return added
        raise DiskkitError(f"{self.address}:{local}", f"cannot forward to guest port {forward.remote}: {reply.splitlines()[0]}")

    def remove(self, forward: Forward) -> None:
        self.monitor(f"hostfwd_remove {self.netdev} {forward.protocol}:{self.address}:{forward.local}")
        self.active.remove(forward)

    def close(self) -> None:
        for forward in list(self.active):
            try:
                self.remove(forward)
            except DiskkitError:
                self.active.remove(forward)  # the VM is gone, and its rules with it


def banner(forwarder: Forwarder, remote: int, timeout: float = 10) -> bytes | None:
    """The identification line the guest's ssh server at `remote` sends (RFC 4253 4.2: `SSH-...`, maybe after
    other lines), through a forward of its own; None when nothing answers yet. qemu accepts a connection
    to a forward before the guest's port does, and closes it if the guest refuses: an open port says nothing."""
    rule = forwarder.add(Forward("tcp", 0, remote))
    try:
        conn = socket.create_connection((forwarder.address, rule.local), timeout=timeout)
    except OSError:
        return None
    finally:
        forwarder.remove(rule)
    received = b""
    with conn:
        try:
            while len(received) < 1024:  # what the RFC allows before the identification line, and more
                chunk = conn.recv(1024 - len(received))
                if not chunk:
                    return None
                received += chunk
                for line in received.split(b"\n")[:-1]:
                    if line.startswith(b"SSH-"):
                        return line.rstrip(b"\r")
        except OSError:
            return None
    return None


def pump_stdio(forwarder: Forwarder, remote: int, stdin: int = 0, stdout: int = 1) -> None:
    """One TCP connection to the guest's `remote` port over stdin/stdout; returns when the guest closes it."""
    rule = forwarder.add(Forward("tcp", 0, remote))
    try:
        conn = socket.create_connection((forwarder.address, rule.local), timeout=30)
    except OSError as exc:
        raise DiskkitError(f"{forwarder.address}:{rule.local}", f"cannot connect to the forward to guest port {remote}: {exc.strerror or exc}") from None
    finally:
        forwarder.remove(rule)  # the listener goes; the accepted connection stays
    conn.settimeout(None)

    def upstream() -> None:
        try:
            while data := os.read(stdin, 65536):
                conn.sendall(data)
        except OSError:
            pass
        try:
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    threading.Thread(target=upstream, daemon=True).start()
    with conn:
        while data := conn.recv(65536):
            os.write(stdout, data)

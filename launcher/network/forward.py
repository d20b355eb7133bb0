"""`launcher port-forward`: local ports to a running VM's guest ports, as `virtctl port-forward` does.

Each forward is this command's own listener, as virtctl's is; every connection accepted on it gets a
connection of its own to the guest port from the VM's pod switch (launcher.network.backend): any
guest port, declared in the interface's `ports` or not, and nothing on the host listens but this
command, which goes with its forwards when it ends (or the VM stops).

A listener on the loopback would serve every local user; so a connection that comes over the loopback
is served only when the socket it comes from belongs to this user or root (the kernel's socket tables,
/proc/net/tcp and udp, name each socket's owner). From another address the user chose to listen on
(--address), the peer is remote and taken as virtctl takes it.

Argument forms follow pkg/virtctl/portforward (portforward.go ParseTarget, ports.go parsePort):
TYPE/NAME[/NAMESPACE] with TYPE vm, vmi or their long and plural forms, and [PROTOCOL/]LOCAL[:REMOTE];
a bare NAME is taken too. --stdio carries one TCP connection over stdin and stdout (virtctl ssh's
ProxyCommand use).
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from diskkit.errors import DiskkitError
from launcher.network.backend import GuestSocket, open_forward

_KINDS = {"vm": "vm", "vms": "vm", "virtualmachine": "vm", "virtualmachines": "vm",
          "vmi": "vmi", "vmis": "vmi", "virtualmachineinstance": "vmi", "virtualmachineinstances": "vmi"}
CHUNK = 1 << 16


@dataclass(frozen=True)
class Forward:
    protocol: str  # "tcp" | "udp"
    local: int
    remote: int


def parse_target(text: str) -> str:
    """TYPE/NAME[/NAMESPACE] or NAME -> the name `launcher.runtime.lookup.find_record` takes."""
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


def network_of(record: dict) -> dict:
    nets = record.get("network") or []
    if not nets or "forward" not in nets[0]:
        raise DiskkitError(record.get("vmi", "?"), "has no pod network interface to forward to (autoattachPodInterface: false, or started before networks)")
    return nets[0]


# ---------------------------------------------------------------- who is at the other end

def _proc_address(text: str) -> tuple[ipaddress._BaseAddress, int]:
    """An address:port of /proc/net/{tcp,udp}{,6}: hex, each 32-bit word in host (little-endian) order."""
    host, port = text.split(":")
    raw = bytes.fromhex(host)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw), int(port, 16)


def socket_owner(tables: dict[str, str], protocol: str, local: tuple, remote: Optional[tuple]) -> Optional[int]:
    """The uid of the socket bound to `local` (and connected to `remote`, where given) in the kernel's
    tables of `protocol` ({"tcp": text of /proc/net/tcp, "tcp6": ...})."""
    want_local = (ipaddress.ip_address(local[0]), local[1])
    want_remote = None if remote is None else (ipaddress.ip_address(remote[0]), remote[1])
    for name in (protocol, f"{protocol}6"):
        for line in tables.get(name, "").splitlines()[1:]:
            fields = line.split()
            if len(fields) < 8:
                continue
            try:
                here, there = _proc_address(fields[1]), _proc_address(fields[2])
            except ValueError:
                continue
            if _same(here, want_local) and (want_remote is None or _same(there, want_remote)):
                return int(fields[7])
    return None


def _same(a: tuple, b: tuple) -> bool:
    def plain(address):
        return address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped else address
    return a[1] == b[1] and plain(a[0]) == plain(b[0])


def _tables(protocol: str) -> dict[str, str]:
    out = {}
    for name in (protocol, f"{protocol}6"):
        try:
            with open(f"/proc/net/{name}") as f:
                out[name] = f.read()
        except OSError:
            pass
    return out


def allowed(protocol: str, peer: tuple, here: Optional[tuple]) -> bool:
    """A peer over the loopback must be this user's (or root's); one from elsewhere is remote."""
    address = ipaddress.ip_address(peer[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    if not address.is_loopback:
        return True
    owner = socket_owner(_tables(protocol), protocol, peer, here)
    return owner in (0, os.geteuid())


# ---------------------------------------------------------------- moving bytes

def _copy(read: Callable[[int], bytes], write: Callable[[bytes], None], done: Callable[[], None]) -> None:
    try:
        while data := read(CHUNK):
            write(data)
    except OSError:
        pass
    finally:
        done()


def _splice(client: socket.socket, guest: GuestSocket) -> None:
    """Both directions of one TCP connection, until both ends have closed."""
    def half_close(sock: socket.socket) -> Callable[[], None]:
        def done() -> None:
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        return done

    upstream = threading.Thread(target=_copy, args=(client.recv, guest.sock.sendall, half_close(guest.sock)), daemon=True)
    upstream.start()
    _copy(guest.sock.recv, client.sendall, half_close(client))
    upstream.join()
    client.close()
    guest.close()


class Listener:
    """One forward: a local port of this command's, each peer's traffic carried to the guest port."""

    def __init__(self, entry: dict, forward: Forward, address: str):
        self.entry, self.forward, self.address = entry, forward, address
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        kind = socket.SOCK_STREAM if forward.protocol == "tcp" else socket.SOCK_DGRAM
        self.sock = socket.socket(family, kind)
        try:
            if kind == socket.SOCK_STREAM:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((address, forward.local))
            if kind == socket.SOCK_STREAM:
                self.sock.listen(64)
        except OSError as exc:
            self.sock.close()
            raise DiskkitError(f"{address}:{forward.local}", f"cannot forward to guest port {forward.remote}: {exc.strerror}") from None
        self.local = self.sock.getsockname()[1]
        self.refused = 0

    def serve(self) -> None:
        target = self._serve_tcp if self.forward.protocol == "tcp" else self._serve_udp
        threading.Thread(target=target, daemon=True).start()

    def close(self) -> None:
        self.sock.close()

    def _serve_tcp(self) -> None:
        while True:
            try:
                client, peer = self.sock.accept()
            except OSError:
                return
            if not allowed("tcp", peer, client.getsockname()):
                self.refused += 1
                client.close()
                continue
            threading.Thread(target=self._one_tcp, args=(client,), daemon=True).start()

    def _one_tcp(self, client: socket.socket) -> None:
        try:
            guest = open_forward(self.entry, "tcp", self.forward.remote)
        except DiskkitError:
            client.close()
            return
        _splice(client, guest)

    def _serve_udp(self) -> None:
        peers: dict[tuple, GuestSocket] = {}
        while True:
            try:
                data, peer = self.sock.recvfrom(CHUNK)
            except OSError:
                return
            guest = peers.get(peer)
            if guest is None:
                if not allowed("udp", peer, None):
                    self.refused += 1
                    continue
                try:
                    guest = peers[peer] = open_forward(self.entry, "udp", self.forward.remote)
                except DiskkitError:
                    continue
                threading.Thread(target=_copy, args=(guest.sock.recv, lambda reply, p=peer: self.sock.sendto(reply, p), guest.close),
                                 daemon=True).start()
            try:
                guest.sock.send(data)
            except OSError:
                peers.pop(peer).close()


def pump_stdio(entry: dict, remote: int, stdin: int = 0, stdout: int = 1) -> None:
    """One TCP connection to the guest's `remote` port over stdin/stdout; returns when the guest closes it."""
    guest = open_forward(entry, "tcp", remote)

    def upstream() -> None:
        def done() -> None:
            try:
                guest.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        _copy(lambda n: os.read(stdin, n), guest.sock.sendall, done)

    threading.Thread(target=upstream, daemon=True).start()
    with guest:
        _copy(guest.sock.recv, lambda data: os.write(stdout, data), lambda: None)

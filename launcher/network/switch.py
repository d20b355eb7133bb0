"""The pod switch: the one process a VM's NIC goes through, between qemu and the user-mode stacks.

    python -P -m launcher.network.switch CONFIG_JSON     (started by launcher.network.backend)

It is given, already open: the unix socket qemu's stream netdev connects to (launcher.render.interfaces),
the forwards' control socket (`launcher port-forward`, `ssh`), and a pipe to say it is ready. Then:

- it starts passt for the guest's own traffic (the binding's plan, launcher.network.bindings) on a
  socket pair, in the launcher's network namespace, where the pod's routes are;
- it moves itself into a user and network namespace of its own, which holds nothing but a loopback
  with a default route onto it: there it starts, on the first forward, a second passt whose listeners
  only the switch can reach. Each forward is a socket the switch connects to that passt from a port it
  registers, and hands, connected, to the client over the control socket (SCM_RIGHTS): nothing
  listens on the host for it, and only the launcher's user (and root) may ask: the control socket is
  theirs, mode 0600;
- every frame the guest sends is judged by launcher.network.guard before either stack sees it; the
  frames of a forward's flow are translated between its placeholder and the guest port it stands for;
- DNS queries to the gateway, where the binding hands out the gateway as the guest's DNS server, it
  sends on to the pod's resolver (resolv.conf's first) from sockets opened before it left the
  launcher's network namespace, and brings the answers back as the gateway's (Debian 12's passt
  forwards only to the very server it hands out).

It exits when qemu closes its end (the VM stopped), taking both passts with it (they quit when their
socket closes, -1). Frames are framed as qemu's stream netdev and passt frame them: a 4-byte
big-endian length, then the Ethernet frame.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import selectors
import socket
import struct
import subprocess
import sys
from collections import OrderedDict
from typing import Optional

from launcher.network.guard import ENTRY, Forwards, Policy, Route, dns_query, forwards_frame, guest_frame, stack_frame, udp_reply

PASST = "passt"
MAX_FRAME = 4096 + 65536  # qemu's NET_BUFSIZE: no frame of a guest NIC is longer
HIGH_WATER = 4 << 20  # bytes queued for one side before the sides that feed it are read no more
MAX_FORWARDS = 1024
REQUEST_LIMIT = 1024
START_TIMEOUT = 10.0
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
TCP, UDP = 6, 17


class Broken(Exception):
    """A link that can carry no more frames."""


class Link:
    """One framed stream socket: qemu's, or a passt's."""

    def __init__(self, sock: socket.socket, name: str):
        sock.setblocking(False)
        self.sock, self.name = sock, name
        self.pending = bytearray()
        self.out = bytearray()

    def fileno(self) -> int:
        return self.sock.fileno()

    def read(self) -> list[bytes]:
        try:
            data = self.sock.recv(1 << 18)
        except BlockingIOError:
            return []
        except OSError as exc:
            raise Broken(f"{self.name}: {exc.strerror}") from None
        if not data:
            raise Broken(f"{self.name} closed")
        self.pending += data
        frames, at = [], 0
        while len(self.pending) - at >= 4:
            length = struct.unpack_from("!I", self.pending, at)[0]
            if length > MAX_FRAME:
                raise Broken(f"{self.name} sent a frame of {length} bytes (at most {MAX_FRAME})")
            if len(self.pending) - at - 4 < length:
                break
            frames.append(bytes(self.pending[at + 4:at + 4 + length]))
            at += 4 + length
        del self.pending[:at]
        return frames

    def send(self, frame: bytes) -> None:
        self.out += struct.pack("!I", len(frame))
        self.out += frame

    def flush(self) -> None:
        while self.out:
            try:
                sent = self.sock.send(self.out)
            except BlockingIOError:
                return
            except OSError as exc:
                raise Broken(f"{self.name}: {exc.strerror}") from None
            del self.out[:sent]


def _libc_call(name: str, *args) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if getattr(libc, name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}: {os.strerror(errno)}")


def _netlink(kind: int, flags: int, body: bytes) -> None:
    NLM_F_REQUEST, NLM_F_ACK, NLMSG_ERROR = 0x1, 0x4, 0x2
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as s:
        s.bind((0, 0))
        s.send(struct.pack("=LHHLL", 16 + len(body), kind, flags | NLM_F_REQUEST | NLM_F_ACK, 1, 0) + body)
        reply = s.recv(4096)
    if struct.unpack_from("=H", reply, 4)[0] == NLMSG_ERROR:
        error = struct.unpack_from("=i", reply, 16)[0]
        if error:
            raise OSError(-error, os.strerror(-error))


def own_network() -> None:
    """A user and network namespace of the switch's own: the same ids inside, a loopback that is up,
    and default routes onto it (passt wants an interface with one)."""
    uid, gid = os.geteuid(), os.getegid()
    _libc_call("unshare", CLONE_NEWUSER | CLONE_NEWNET)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    RTM_NEWLINK, RTM_NEWROUTE, IFF_UP, LOOPBACK = 16, 24, 0x1, 1
    NLM_F_EXCL, NLM_F_CREATE, RTA_OIF = 0x200, 0x400, 4
    _netlink(RTM_NEWLINK, 0, struct.pack("=BxHiII", socket.AF_UNSPEC, 0, LOOPBACK, IFF_UP, IFF_UP))
    for family, scope in ((socket.AF_INET, 253), (socket.AF_INET6, 0)):  # RT_SCOPE_LINK, RT_SCOPE_UNIVERSE
        # rtmsg: family, dst_len 0 (default), src_len, tos, table main, protocol boot, scope, unicast, flags
        rtmsg = struct.pack("=BBBBBBBBI", family, 0, 0, 0, 254, 3, scope, 1, 0)
        _netlink(RTM_NEWROUTE, NLM_F_CREATE | NLM_F_EXCL, rtmsg + struct.pack("=HHI", 8, RTA_OIF, LOOPBACK))


def start_passt(options: list[str], log) -> tuple[subprocess.Popen, Link]:
    """passt on one end of a socket pair, in this process's network namespace; returns once it has
    bound what it listens on (it writes its pid then), or raises with its last words."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ready_r, ready_w = os.pipe()
    try:
        proc = subprocess.Popen([PASST, "-f", "-q", "-1", "-F", str(theirs.fileno()), "-P", f"/proc/self/fd/{ready_w}", *options],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(theirs.fileno(), ready_w))
    finally:
        theirs.close()
        os.close(ready_w)
    try:
        with selectors.DefaultSelector() as ready:
            ready.register(ready_r, selectors.EVENT_READ)
            got = os.read(ready_r, 64) if ready.select(START_TIMEOUT) else None
        if not (got or b"").strip():
            proc.kill()
            proc.wait()
            raise RuntimeError(f"passt exited ({proc.returncode})" if got == b"" else "passt did not start in time")
    finally:
        os.close(ready_r)
    return proc, Link(ours, "passt")


class Resolver:
    """The gateway's DNS server: each query sent on to the pod's first resolver with an id of its own
    (the latest PENDING_LIMIT awaited), each answer from that server brought back to the asker."""

    PENDING_LIMIT = 256

    def __init__(self, upstream: list[str]):
        self.server = ipaddress.ip_address(upstream[0]) if upstream else None
        self.sock: Optional[socket.socket] = None
        if self.server is not None:
            self.sock = socket.socket(socket.AF_INET if self.server.version == 4 else socket.AF_INET6, socket.SOCK_DGRAM)
            self.sock.setblocking(False)
        self.pending: OrderedDict[bytes, tuple[bytes, bytes]] = OrderedDict()
        self.next_id = int.from_bytes(os.urandom(2), "big")

    def query(self, frame: bytes) -> None:
        payload = dns_query(frame)
        if self.sock is None or payload is None or len(payload) < 12:
            return
        self.next_id = (self.next_id + 1) & 0xFFFF
        ours = self.next_id.to_bytes(2, "big")
        self.pending.pop(ours, None)
        self.pending[ours] = (frame, payload[:2])
        while len(self.pending) > self.PENDING_LIMIT:
            self.pending.popitem(last=False)
        try:
            self.sock.sendto(ours + payload[2:], (str(self.server), 53))
        except OSError:
            self.pending.pop(ours, None)

    def answer(self) -> Optional[bytes]:
        try:
            data, peer = self.sock.recvfrom(65535)
        except OSError:
            return None
        if ipaddress.ip_address(peer[0].split("%")[0]) != self.server or peer[1] != 53 or len(data) < 12:
            return None
        asked = self.pending.pop(data[:2], None)
        if asked is None:
            return None
        request, their_id = asked
        return udp_reply(request, their_id + data[2:])


class Switch:
    def __init__(self, config: dict, guest_listener: socket.socket, control: socket.socket, log):
        self.config, self.log = config, log
        self.policy = Policy(*(ipaddress.ip_address(a) if a else None for a in (config["gateway4"], config["gateway6"])),
                             *(ipaddress.ip_network(n) if n else None for n in (config["closed4"], config["closed6"])),
                             config["dns_forwarder"])
        self.forwards = Forwards()
        self.gateway_mac = bytes.fromhex(config["gateway_mac"].replace(":", ""))
        self.guest_mac: Optional[bytes] = None
        self.resolver = Resolver([])  # made again in start(), while the switch is where the resolver is
        self.guest_listener, self.control = guest_listener, control
        self.guest: Optional[Link] = None
        self.stack: Optional[Link] = None
        self.fwd: Optional[Link] = None
        self.children: list[subprocess.Popen] = []
        self.requests: dict[int, tuple[socket.socket, bytearray, Optional[tuple[int, int]]]] = {}
        self.selector = selectors.DefaultSelector()

    def say(self, line: str) -> None:
        self.log.write(f"switch: {line}\n".encode())
        self.log.flush()

    def start(self, status: int) -> None:
        try:
            # before the switch leaves the launcher's network namespace: the resolver is there
            self.resolver = Resolver(self.config["dns_upstream"])
            if self.config["online"]:
                self._start_stack()
            own_network()
            if not self.config["online"]:
                self._start_stack()
        except (OSError, RuntimeError) as exc:
            os.write(status, f"error: {exc}\n".encode())
            raise SystemExit(1) from None
        os.write(status, b"ready\n")
        os.close(status)

    def _start_stack(self) -> None:
        proc, self.stack = start_passt(self.config["stack"], self.log)
        self.children.append(proc)

    def _start_forwards(self) -> None:
        proc, self.fwd = start_passt(self.config["forwards"], self.log)
        self.fwd.name = "the forwards' passt"
        self.children.append(proc)

    # ---- the loop

    def run(self) -> None:
        self.guest_listener.setblocking(False)
        self.control.setblocking(False)
        self.selector.register(self.guest_listener, selectors.EVENT_READ, "guest-listener")
        self.selector.register(self.control, selectors.EVENT_READ, "control")
        self.selector.register(self.stack, selectors.EVENT_READ, self.stack)
        if self.resolver.sock is not None:
            self.selector.register(self.resolver.sock, selectors.EVENT_READ, "dns")
        try:
            while True:
                for key, events in self.selector.select():
                    self._event(key.data, events)
                self._interest()
        except Broken as exc:
            self.say(str(exc))

    def _event(self, what, events: int) -> None:
        if what == "guest-listener":
            conn, _ = self.guest_listener.accept()
            self.selector.unregister(self.guest_listener)
            self.guest_listener.close()  # one qemu, one connection
            self.guest = Link(conn, "qemu")
            self.selector.register(self.guest, selectors.EVENT_READ, self.guest)
        elif what == "control":
            self._accept_request()
        elif what == "dns":
            answer = self.resolver.answer()
            if answer is not None:
                self._to_guest([answer])
        elif isinstance(what, int):
            self._request_event(what)
        elif what is self.fwd:
            try:
                self._link_event(what, events)
            except Broken as exc:
                # The forwards end with it, not the guest's network: the next forward starts another.
                self.say(str(exc))
                self.selector.unregister(self.fwd)
                self.fwd.sock.close()
                self.fwd = None
        else:
            self._link_event(what, events)

    def _link_event(self, link: Link, events: int) -> None:
        if events & selectors.EVENT_WRITE:
            link.flush()
        if events & selectors.EVENT_READ:
            frames = link.read()
            if link is self.guest:
                self._from_guest(frames)
            elif link is self.stack:
                for frame in frames:
                    stack_frame(frame, self.policy, self.forwards)
                self._to_guest(frames)
            elif self.guest_mac is not None:
                self._to_guest(f for f in (forwards_frame(f, self.forwards, self.policy, self.guest_mac, self.gateway_mac) for f in frames) if f)

    def _from_guest(self, frames: list[bytes]) -> None:
        for frame in frames:
            if self.guest_mac is None and len(frame) >= 12 and not frame[6] & 1:
                self.guest_mac = frame[6:12]
            route, out = guest_frame(frame, self.policy, self.forwards)
            if route is Route.STACK:
                self.stack.send(out)
            elif route is Route.FORWARDS and self.fwd is not None:
                self.fwd.send(out)
            elif route is Route.REPLY:
                self.guest.send(out)
            elif route is Route.DNS:
                self.resolver.query(out)
        for link in (self.stack, self.fwd, self.guest):
            if link is not None and link.out:
                link.flush()

    def _to_guest(self, frames) -> None:
        if self.guest is None:
            return
        for frame in frames:
            self.guest.send(frame)
        self.guest.flush()

    def _interest(self) -> None:
        """Each link read unless what it feeds is backed up, and written while it has frames queued."""
        guest_full = self.guest is not None and len(self.guest.out) > HIGH_WATER
        stacks_full = any(link is not None and len(link.out) > HIGH_WATER for link in (self.stack, self.fwd))
        for link, blocked in ((self.guest, stacks_full), (self.stack, guest_full), (self.fwd, guest_full)):
            if link is None:
                continue
            events = (0 if blocked else selectors.EVENT_READ) | (selectors.EVENT_WRITE if link.out else 0)
            try:
                key = self.selector.get_key(link)
            except KeyError:
                key = None
            if key is None and events:
                self.selector.register(link, events, link)
            elif key is not None and not events:
                self.selector.unregister(link)
            elif key is not None and key.events != events:
                self.selector.modify(link, events, link)

    # ---- forwards

    def _accept_request(self) -> None:
        try:
            conn, _ = self.control.accept()
        except BlockingIOError:
            return
        # Who may ask is the control socket's mode's business (launcher.network.backend): in this user
        # namespace every uid but the switch's own reads as the overflow uid, root's too.
        if len(self.requests) >= MAX_FORWARDS:
            conn.close()
            return
        conn.setblocking(False)
        self.requests[conn.fileno()] = (conn, bytearray(), None)
        self.selector.register(conn, selectors.EVENT_READ, conn.fileno())

    def _request_event(self, fd: int) -> None:
        conn, buffer, flow = self.requests[fd]
        try:
            data = conn.recv(REQUEST_LIMIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data or flow is not None:
            self._end_request(fd)  # the client is done with its forward, or broke the protocol
            return
        buffer += data
        if b"\n" not in buffer:
            if len(buffer) > REQUEST_LIMIT:
                self._end_request(fd)
            return
        try:
            request = json.loads(buffer.split(b"\n", 1)[0])
            protocol = {"tcp": TCP, "udp": UDP}[request["protocol"]]
            port = request["port"]
            if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
                raise ValueError(port)
        except (ValueError, KeyError, TypeError):
            self._answer(fd, {"error": "a request is {\"protocol\": \"tcp\"|\"udp\", \"port\": 1-65535}"})
            return
        try:
            flow, sock = self._connect(protocol, port)
        except (OSError, RuntimeError) as exc:
            self._answer(fd, {"error": f"the forwards' stack: {exc}"})
            return
        self.requests[fd] = (conn, buffer, flow)
        with sock:
            self._answer(fd, {"ok": True}, sock.fileno())

    def _connect(self, protocol: int, port: int) -> tuple[tuple[int, int], socket.socket]:
        if self.fwd is None:
            self._start_forwards()
            self.selector.register(self.fwd, selectors.EVENT_READ, self.fwd)
        family, loopback = (socket.AF_INET, "127.0.0.1") if self.config["forwards"][0] == "-4" else (socket.AF_INET6, "::1")
        sock = socket.socket(family, socket.SOCK_STREAM if protocol == TCP else socket.SOCK_DGRAM)
        try:
            sock.bind((loopback, 0))
            flow = (protocol, sock.getsockname()[1])
            self.forwards.flows[flow] = port  # before the first frame of the flow can reach the guest
            sock.setblocking(False)
            sock.connect_ex((loopback, ENTRY))
            sock.setblocking(True)
        except BaseException:
            sock.close()
            raise
        return flow, sock

    def _answer(self, fd: int, answer: dict, handed: Optional[int] = None) -> None:
        conn = self.requests[fd][0]
        line = (json.dumps(answer) + "\n").encode()
        try:
            conn.setblocking(True)
            conn.settimeout(5)
            if handed is None:
                conn.sendall(line)
            else:
                socket.send_fds(conn, [line], [handed])
            conn.setblocking(False)
        except OSError:
            self._end_request(fd)
            return
        if handed is None:
            self._end_request(fd)

    def _end_request(self, fd: int) -> None:
        conn, _, flow = self.requests.pop(fd)
        if flow is not None:
            self.forwards.flows.pop(flow, None)
        self.selector.unregister(conn)
        conn.close()


def main(argv: list[str]) -> int:
    config = json.loads(argv[0])
    guest_listener = socket.socket(fileno=config["guest_fd"])
    control = socket.socket(fileno=config["control_fd"])
    log = os.fdopen(2, "wb", buffering=0)
    switch = Switch(config, guest_listener, control, log)
    try:
        switch.start(config["status_fd"])
        switch.run()
    finally:
        for child in switch.children:
            child.kill()
            child.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`launcher vnc`: a VM's VNC display on a local TCP port, as `virtctl vnc` proxies it
(pkg/virtctl/vnc/vnc.go), and its screenshot (pkg/virtctl/vnc/screenshot/screenshot.go).

The viewer's connection is spliced to a connection of its own to the VM's VNC server, which libvirt
opens (virDomainOpenGraphicsFD: qemu's add_client on a socket pair): nothing connects to the VNC
socket by its path. Loopback TCP is open to every local user, and the display is the guest's console
(a login prompt, or a session someone left logged in): a connection from a socket another user owns
is closed unanswered. Only the launcher's own user and root are served.
"""

from __future__ import annotations

import os
import selectors
import socket
import time
from pathlib import Path
from typing import Callable

from diskkit.errors import DiskkitError
from launcher.runtime.runner import Libvirt

LISTEN_TIMEOUT = 60.0  # vnc.go LISTEN_TIMEOUT: a viewer the command started has this long to connect
SCREENSHOT_LIMIT = 64 << 20  # a 16 MiB VGA framebuffer as PNG, with room to spare
_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


def _hex_address(host: str, port: int) -> tuple[bytes, int]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    packed = socket.inet_pton(family, host)
    # /proc/net/tcp prints each 32-bit word of the address in host (little-endian) byte order
    words = b"".join(packed[i:i + 4][::-1] for i in range(0, len(packed), 4))
    return words.hex().upper().encode(), port


def socket_owner(tables: list[bytes], local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The uid owning the TCP socket whose own end is `local` and whose peer is `remote`, from the
    kernel's /proc/net/tcp tables; None when no such socket is listed (pure)."""
    want_local, want_remote = _hex_address(*local), _hex_address(*remote)
    for table in tables:
        for line in table.splitlines()[1:]:
            fields = line.split()
            if len(fields) < 8:
                continue
            here, there = fields[1].rsplit(b":", 1), fields[2].rsplit(b":", 1)
            if (here[0], int(here[1], 16)) == want_local and (there[0], int(there[1], 16)) == want_remote:
                return int(fields[7])
    return None


def _mapped(host: str) -> str:
    # An IPv4 client of a dual-stack listener shows as ::ffff:a.b.c.d on our end, as itself in tcp
    return host.removeprefix("::ffff:") if host.startswith("::ffff:") and "." in host else host


def client_uid(conn: socket.socket) -> int | None:
    """Whose process holds the other end of a loopback connection we accepted."""
    ours, theirs = conn.getsockname()[:2], conn.getpeername()[:2]
    tables = []
    for path in _TCP_TABLES:
        try:
            tables.append(Path(path).read_bytes())
        except OSError:
            continue
    return socket_owner(tables, (_mapped(theirs[0]), theirs[1]), (_mapped(ours[0]), ours[1]))


def listen(address: str, port: int) -> socket.socket:
    """The proxy's TCP listener (vnc.go: ListenTCP on ADDRESS:PORT, port 0 for a free one)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((address, port))
        listener.listen(1)
    except OSError as exc:
        listener.close()
        raise DiskkitError(f"{address}:{port}", f"can't listen: {exc.strerror}") from None
    return listener


def _splice(one: socket.socket, other: socket.socket) -> None:
    """Bytes both ways until either side closes."""
    peers = {one: other, other: one}
    with selectors.DefaultSelector() as selector:
        for sock in peers:
            selector.register(sock, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                data = key.fileobj.recv(1 << 16)
                if not data:
                    return
                peers[key.fileobj].sendall(data)


def serve(lv: Libvirt, domain: str, listener: socket.socket, timeout: float | None, say: Callable[[str], None],
          gone: Callable[[], str | None] = lambda: None) -> None:
    """Accept one viewer (within `timeout` seconds, or any time) and give it the VM's display until
    either side hangs up, as virtctl's proxy does. A connection from another user's socket is closed
    and waited past. `gone`: why to stop waiting (the viewer this command started has exited)."""
    served = {0, os.geteuid()}
    deadline = None if timeout is None else time.monotonic() + timeout
    listener.settimeout(1.0)
    while True:
        why = gone()
        if why:
            raise DiskkitError(domain, why)
        if deadline is not None and time.monotonic() > deadline:
            raise DiskkitError(domain, f"no VNC viewer connected within {timeout:g} s")
        try:
            conn, _ = listener.accept()
        except socket.timeout:
            continue
        uid = client_uid(conn)
        if uid in served:
            break
        say(f"refused a VNC connection from {'an unknown socket' if uid is None else f'uid {uid}'}: only uid {os.geteuid()} is served")
        conn.close()
    conn.settimeout(None)
    with conn:
        display = socket.socket(fileno=lv.graphics_fd(domain))
        with display:
            _splice(conn, display)


def screenshot(lv: Libvirt, domain: str) -> bytes:
    """The primary display as PNG, as libvirt hands it (qemu's screendump in PNG since libvirt 8.x)."""
    mime, data = lv.screenshot(domain, SCREENSHOT_LIMIT)
    if mime != "image/png" or not data.startswith(b"\x89PNG\r\n\x1a\n"):
        raise DiskkitError(domain, f"libvirt gave its screenshot as {mime}, not image/png")
    return data

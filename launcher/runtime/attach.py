"""A terminal on a running VM's serial console, as `virtctl console` gives one (pkg/virtctl/console/console.go):
the guest's output to stdout, stdin to the guest's serial port, raw while stdin is a terminal,
detached by Ctrl-] (or the end of stdin), ended when the guest stops.

The console is libvirt's stream to the serial pty (virDomainOpenConsole), so it works the same on
a session daemon and the system one; the console log the launcher keeps is written meanwhile as
ever (`launcher logs`).
"""

from __future__ import annotations

import os
import select
import sys
import termios
import threading
import tty

from launcher.runtime.runner import Libvirt

ESCAPE = b"\x1d"  # ^], virtctl's and virsh's
CHUNK = 4096


def attach(lv: Libvirt, domain: str, shown: str) -> str:
    """Stay attached until Ctrl-] or the end of stdin ("detached") or the guest stops ("stopped")."""
    stream = lv.open_console(domain)
    stdin = sys.stdin.fileno()
    saved = termios.tcgetattr(stdin) if os.isatty(stdin) else None
    ended = threading.Event()

    def guest_to_stdout() -> None:
        try:
            while True:
                data = stream.recv(CHUNK)
                if not isinstance(data, bytes) or not data:
                    break  # the end of the stream: the guest stopped
                os.write(sys.stdout.fileno(), data)
        except Exception:  # noqa: BLE001  (libvirt's error once the domain goes, or a closed stdout)
            pass
        finally:
            ended.set()

    if saved is not None:
        tty.setraw(stdin)
    try:
        print(f"Successfully connected to {shown} console. The escape sequence is ^]", file=sys.stderr, flush=True)  # virtctl's words
        threading.Thread(target=guest_to_stdout, daemon=True).start()
        while not ended.is_set():
            ready, _, _ = select.select([stdin], [], [], 0.2)
            if not ready:
                continue
            data = os.read(stdin, CHUNK)
            before, escape, _ = data.partition(ESCAPE)
            if before:
                try:
                    stream.send(before)
                except lv.lv.libvirtError:
                    return "stopped"  # the guest went between our read and its write
            if escape or not data:
                return "detached"
        return "stopped"
    finally:
        if saved is not None:
            termios.tcsetattr(stdin, termios.TCSADRAIN, saved)
            print(file=sys.stderr)  # a new line after the raw terminal, as virtctl does
        try:
            stream.abort()
        except Exception:  # noqa: BLE001  (already ended with the guest)
            pass

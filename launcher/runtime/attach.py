"""A terminal on a running VM's serial console, as `virtctl console` gives one (pkg/virtctl/console/console.go):
the guest's output to stdout, stdin to the guest's serial port, raw while stdin is a terminal,
detached by Ctrl-] (or the end of stdin), ended when the guest stops.

The console is libvirt's stream to the serial pty (virDomainOpenConsole), so it works the same on
a session daemon and the system one; the console log the launcher keeps is written meanwhile as
ever (`launcher logs`).

One thread does all of it, in libvirt's event loop, as virsh console does: the stream is
non-blocking and both ways go through the loop. A blocking receive on one thread and a send on
another deadlock in libvirt's client: the send waits for the receiver to pass it on, the receiver
sleeps until the guest prints, and the guest waits for the line that was never sent.
"""

from __future__ import annotations

import os
import sys
import termios
import tty

from launcher.runtime.runner import Libvirt

ESCAPE = b"\x1d"  # ^], virtctl's and virsh's
CHUNK = 4096


class _Session:
    """Stdin and the console stream, each served by a callback of the event loop until `ended` says why."""

    def __init__(self, lv: Libvirt, stream, stdin: int, stdout: int):
        self.lv, self.stream, self.stdin, self.stdout = lv.lv, stream, stdin, stdout
        self.ended: str | None = None
        self.unsent = b""  # typed, not yet taken by the stream (it would have blocked)
        self.always = self.lv.VIR_STREAM_EVENT_READABLE | self.lv.VIR_STREAM_EVENT_ERROR | self.lv.VIR_STREAM_EVENT_HANGUP
        self.watch = self.lv.virEventAddHandle(stdin, self.lv.VIR_EVENT_HANDLE_READABLE, self._typed, None)
        stream.eventAddCallback(self.always, self._from_guest, None)

    def run(self) -> str:
        try:
            while self.ended is None:
                self.lv.virEventRunDefaultImpl()
        finally:
            self.lv.virEventRemoveHandle(self.watch)
            try:
                self.stream.eventRemoveCallback()
            except self.lv.libvirtError:
                pass  # the stream ended with the guest
        return self.ended

    def _typed(self, _watch, fd: int, _events, _opaque) -> None:
        data = os.read(fd, CHUNK)
        before, escape, _ = data.partition(ESCAPE)
        if before:
            self.unsent += before
            self._send()
        if escape or not data:
            self.ended = self.ended or "detached"

    def _send(self) -> None:
        while self.unsent:
            try:
                sent = self.stream.send(self.unsent)
            except self.lv.libvirtError:
                self.ended = "stopped"  # the guest went between our read and its write
                return
            if sent == -2:
                break  # would block: sent once the stream says it is writable
            self.unsent = self.unsent[sent:]
        writable = self.lv.VIR_STREAM_EVENT_WRITABLE if self.unsent else 0
        self.stream.eventUpdateCallback(self.always | writable)

    def _from_guest(self, stream, events: int, _opaque) -> None:
        if events & self.lv.VIR_STREAM_EVENT_WRITABLE:
            self._send()
        if events & self.lv.VIR_STREAM_EVENT_READABLE:
            while True:
                try:
                    data = stream.recv(CHUNK)
                except self.lv.libvirtError:
                    self.ended = "stopped"  # libvirt's error once the domain goes
                    return
                if data == -2:
                    break  # nothing more for now
                if not data:
                    self.ended = "stopped"  # the end of the stream: the guest stopped
                    return
                try:
                    os.write(self.stdout, data)
                except OSError:
                    self.ended = "detached"  # whoever read our output went away
                    return
        if events & (self.lv.VIR_STREAM_EVENT_ERROR | self.lv.VIR_STREAM_EVENT_HANGUP):
            self.ended = "stopped"


def attach(lv: Libvirt, domain: str, shown: str) -> str:
    """Stay attached until Ctrl-] or the end of stdin ("detached") or the guest stops ("stopped").
    `lv` was connected after runner.use_event_loop()."""
    stream = lv.open_console(domain)
    stdin = sys.stdin.fileno()
    saved = termios.tcgetattr(stdin) if os.isatty(stdin) else None
    if saved is not None:
        tty.setraw(stdin)
    try:
        print(f"Successfully connected to {shown} console. The escape sequence is ^]", file=sys.stderr, flush=True)  # virtctl's words
        return _Session(lv, stream, stdin, sys.stdout.fileno()).run()
    finally:
        if saved is not None:
            termios.tcsetattr(stdin, termios.TCSADRAIN, saved)
            print(file=sys.stderr)  # a new line after the raw terminal, as virtctl does
        try:
            stream.abort()
        except Exception:  # noqa: BLE001  (already ended with the guest)
            pass

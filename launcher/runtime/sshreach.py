"""The first ssh contact with a VM the launcher runs, for `launcher ssh`, `port-forward` and `test`: wait
until the guest's ssh server answers, and settle once per VM which host keys ssh trusts.

An open forward says nothing (qemu accepts the connection before the guest's port does, and ssh started
then fails in kex_exchange_identification), so the server counts as up once its identification line
came through a forward. The host keys are then, in order:

- the keys cloud-init printed on the serial console at first boot (launcher.runtime.cloudinitreport),
  written as the VM's own known_hosts in its run directory: ssh checks them strictly, a changed key is refused;
  while cloud-init runs and has not printed them yet, the contact waits for them;
- for a guest that prints none (no cloud-init, or it finished without them): trust on first use, for
  this VM alone, said in one line: ssh writes the key it is first shown to that file and refuses a changed one after.

The file goes with the run directory when the VM stops, so a new VM of the same name starts afresh; an
existing file is never rewritten. ssh reads no other known_hosts for the VM (the name ssh sees,
KIND.NAME.NAMESPACE, is every VM of that name's) and keys it under one alias, vmi.NAME.NAMESPACE, however
the VM was named. Options the user gives ssh come first and win.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from diskkit.errors import DiskkitError, TimedOut
from launcher.node.cache import Cache
from launcher.runtime.cloudinitreport import HostKey, Report
from launcher.runtime.console import ConsoleLog
from launcher.runtime.rundir import console_log

KNOWN_HOSTS = "known_hosts"
POLL = 1.0
# How long a probe's connection may stay silent. The first probes are made while the guest boots,
# before its network is up, and such a connection is never answered: the user-mode stack sends the
# guest one SYN and gives up on it after 10 s, which the guest's sshd, up meanwhile, used to wait out.
# The first probe of a VM that is up answers in about a second (the switch starts its forwards' stack).
SILENT_FIRST = 2.0
SILENT_MAX = 10.0


def silent_limit(attempt: int) -> float:
    """How long probe number `attempt` (from 0) waits on a silent connection: SILENT_FIRST, then twice
    as long each time up to SILENT_MAX, so a server slow to send its identification line is still heard."""
    return min(SILENT_FIRST * 2 ** min(attempt, 8), SILENT_MAX)  # a long --timeout makes thousands of probes: no float overflow


def known_hosts_text(host: str, keys: tuple[HostKey, ...]) -> str:
    return "".join(f"{host} {key.type} {key.key}\n" for key in keys)


def ssh_quote(path: Path) -> str:
    """A path as one word of an ssh -o option (ssh splits it like a config line and expands %-tokens)."""
    return '"' + str(path).replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%") + '"'


def alias(record: dict) -> str:
    """The name the VM's host keys are kept under (ssh's HostKeyAlias)."""
    return f"vmi.{record['vmi']}.{record.get('namespace') or 'default'}"


@dataclass(frozen=True)
class Contact:
    known_hosts: Path
    alias: str
    first_use: bool  # no keys known: ssh keeps the first it is shown
    report: Report = field(default_factory=Report)  # what cloud-init said on the console (first contact only)

    def ssh_options(self) -> tuple[str, ...]:
        return ("-o", f"UserKnownHostsFile={ssh_quote(self.known_hosts)}", "-o", "GlobalKnownHostsFile=/dev/null",
                "-o", f"HostKeyAlias={self.alias}", "-o", "StrictHostKeyChecking=" + ("accept-new" if self.first_use else "yes"))


def known(run_dir: Path, host: str) -> Contact | None:
    """The VM's known_hosts once settled (learned, or written by ssh on first use)."""
    path = run_dir / KNOWN_HOSTS
    try:
        return Contact(path, host, False) if path.stat().st_size > 0 else None
    except FileNotFoundError:
        return None


def settled_now(cache: Cache, record: dict) -> Contact | None:
    """The VM's host keys if settled, or learned now from keys already on its console; never waits."""
    run_dir, host = cache.run_dir(record["domain"]), alias(record)
    if (settled := known(run_dir, host)) is not None:
        return settled
    report, log = Report(), ConsoleLog(console_log(run_dir))
    try:
        while data := log.read():
            report.feed(data)
    finally:
        log.close()
    return record_keys(run_dir, host, report.host_keys) if report.host_keys else None


def record_keys(run_dir: Path, host: str, keys: tuple[HostKey, ...]) -> Contact:
    """Write the learned keys as the VM's known_hosts, unless a file is there already (it stays as it is)."""
    path = run_dir / KNOWN_HOSTS
    tmp = run_dir / f".{KNOWN_HOSTS}.{os.getpid()}.{threading.get_ident()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(known_hosts_text(host, keys))
        try:
            os.link(tmp, path)  # never over an existing file
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    return Contact(path, host, False)


PROBE_ID = b"SSH-2.0-launcher_probe\r\n"


def banner(entry: dict, port: int, timeout: float, stop: threading.Event) -> bytes | None:
    """The identification line the guest's ssh server at `port` sends (RFC 4253 4.2: `SSH-...`, maybe after
    other lines), through a connection of its own from the VM's pod switch (launcher.network.backend);
    None when nothing answers yet: a connection the switch makes says nothing until the guest speaks.
    A silent connection is waited on for `timeout` seconds, or until `stop` is set (the VM went)."""
    from launcher.network.backend import open_forward

    deadline = time.monotonic() + timeout
    try:
        conn = open_forward(entry, "tcp", port, timeout)
    except DiskkitError:
        return None
    received = b""
    with conn:
        conn.sock.settimeout(timeout)
        try:
            # Both sides send their identification at once (RFC 4253 4.2), as ssh clients do: a user-mode
            # stack may open the guest's side of a forwarded connection only once the client has spoken.
            conn.sock.sendall(PROBE_ID)
            while len(received) < 1024:  # what the RFC allows before the identification line, and more
                left = deadline - time.monotonic()
                if left <= 0 or stop.is_set():
                    return None
                conn.sock.settimeout(min(left, POLL))
                try:
                    chunk = conn.sock.recv(1024 - len(received))
                except TimeoutError:
                    continue
                if not chunk:
                    return None
                received += chunk
                for line in received.split(b"\n")[:-1]:
                    if line.startswith(b"SSH-"):
                        return line.rstrip(b"\r")
        except OSError:
            return None
    return None


def first_contact(cache: Cache, name: str, port: int, timeout: float, say: Callable[[str], None],
                  progress: Callable[[str], None] | None = None, stop: threading.Event | None = None) -> Contact:
    """Wait for the VM's ssh server on guest `port` and settle its host keys (see the module's doc).
    `name` is the VM as find_record takes it; `say` gets the one line of a first use, `progress` the
    one line of a wait. Raises TimedOut when the server has not answered in `timeout` seconds."""
    from launcher.network.forward import network_of
    from launcher.runtime.lookup import connect, find_record

    stop = stop or threading.Event()
    record = find_record(cache, name)
    if record is None:
        raise DiskkitError(name, "no VM of this name was started from this cache (yet)")
    run_dir, host = cache.run_dir(record["domain"]), alias(record)
    if (settled := known(run_dir, host)) is not None:
        return settled
    started = time.monotonic()
    deadline = started + timeout
    report, log = Report(), ConsoleLog(console_log(run_dir))
    lv = connect(record)  # a VM's own daemon, never a socket its uid's next VM holds
    entry = network_of(record)
    answered, running, waiting_said, probes = False, False, False, 0
    try:
        while True:
            polled = time.monotonic()
            while data := log.read():
                report.feed(data)
            if not answered:
                # Its record is written before its domain starts: not running yet is waited for, gone is not.
                running = lv.active(record["domain"])
                if not running and find_record(cache, name) is None:
                    raise DiskkitError(name, "stopped before its ssh server answered")
                if running:
                    # A silent connection is given up at the deadline too: --timeout is the caller's.
                    answered = banner(entry, port, min(silent_limit(probes), max(deadline - time.monotonic(), POLL)), stop) is not None
                    probes += 1
            if answered:
                if known(run_dir, host) is not None:  # another contact settled it meanwhile
                    return Contact(run_dir / KNOWN_HOSTS, host, False, report)
                verdict = report.verdict()
                if verdict == "keys":
                    record_keys(run_dir, host, report.host_keys)
                    return Contact(run_dir / KNOWN_HOSTS, host, False, report)
                if verdict == "first-use":
                    say(f"{name}: no host keys on its console (they come from cloud-init); trusting the key its ssh server "
                        f"shows first, for this VM only ({run_dir / KNOWN_HOSTS})")
                    return Contact(run_dir / KNOWN_HOSTS, host, True, report)
            if time.monotonic() > deadline:
                if not running:
                    raise TimedOut(name, f"is not running (its domain {record['domain']} did not start within {timeout:g} s)")
                if not answered:
                    raise TimedOut(name, f"its ssh server (guest port {port}) did not answer within {timeout:g} s")
                say(f"{name}: cloud-init printed no host keys within {timeout:g} s; trusting the key its ssh server "
                    f"shows first, for this VM only ({run_dir / KNOWN_HOSTS})")
                return Contact(run_dir / KNOWN_HOSTS, host, True, report)
            # Said once the wait is a real one: a probe given up early (above) is no sign of a guest
            # that does not answer.
            if progress is not None and not waiting_said and (answered or time.monotonic() - started >= SILENT_MAX):
                progress(f"{name}: waiting for " + ("the host keys cloud-init prints on its console" if answered else f"its ssh server (guest port {port})"))
                waiting_said = True
            # A probe that waited a POLL or more on a silent connection was this round's wait.
            if stop.wait(POLL if time.monotonic() - polled < POLL else 0):
                raise DiskkitError(name, "stopped before its ssh server answered")
    finally:
        log.close()
        lv.close()

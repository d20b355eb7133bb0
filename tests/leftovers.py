"""Nothing left behind by an interrupted test run: no daemon of a scratch directory (libvirt session
daemons, virtlogd, qemu, virtiofsd started with paths in it) and no /tmp/diskkit-e2e-* directory.

pytest turns Ctrl-C (SIGINT) into KeyboardInterrupt and still runs every fixture's teardown
(pytest_sessionfinish tears the setup state down), but SIGTERM and SIGHUP (a CI runner's cancel, a
closed terminal) end the process at once: `install_handlers` makes them unwind the same way. A second
signal during the cleanup would cut it short: `uninterrupted` holds signals off until it is done.
Scratch directories whose fixture never got to its cleanup are swept at the end of the session.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Iterator

ENDING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_scratch: set[Path] = set()


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def install_handlers() -> None:
    """SIGTERM and SIGHUP unwind the run as Ctrl-C does, so fixtures' teardowns run."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP until the block ends (they are delivered after)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, ENDING)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _mentions(pid: str, needle: bytes) -> bool:
    try:
        if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
            return True
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(var.startswith(b"HOME=" + needle) for var in environ)


def processes_of(root: Path) -> list[int]:
    """Processes that name `root` in their command line or have their HOME in it: the session
    daemons started for it (libvirtd, virtlogd) and the qemu and virtiofsd processes of its VMs."""
    needle = str(root).encode()
    me = os.getpid()
    return [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and int(pid) != me and _mentions(pid, needle)]


def end_processes_of(root: Path, wait: float = 15) -> None:
    """SIGTERM, then SIGKILL after `wait` seconds, until no process of `root` is left: one that is
    ended may start another first (a launcher cleaning up connects to libvirt, which spawns a
    session daemon again), so the scan is repeated."""
    deadline = time.monotonic() + wait
    asked: set[int] = set()
    while pids := [pid for pid in processes_of(root) if alive(pid)]:
        late = time.monotonic() > deadline
        for pid in pids:
            if late or pid not in asked:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL if late else signal.SIGTERM)
                asked.add(pid)
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"  # a zombie is gone; its parent reaps it


def scratch_made(root: Path) -> None:
    _scratch.add(root)


def remove_scratch(root: Path) -> None:
    """End the daemons of `root` and remove it, whatever signal comes meanwhile."""
    with uninterrupted():
        end_processes_of(root)
        shutil.rmtree(root, ignore_errors=True)
        _scratch.discard(root)


def sweep() -> None:
    """At the end of the session: the scratch directories a fixture never cleaned up."""
    for root in sorted(_scratch):
        remove_scratch(root)

"""Nothing left behind by an interrupted test run: no daemon of a scratch directory (libvirt session
daemons, virtlogd, qemu, virtiofsd started with paths in it) and no e2e-* scratch directory.

pytest turns Ctrl-C (SIGINT) into KeyboardInterrupt and still runs every fixture's teardown
(pytest_sessionfinish tears the setup state down), but SIGTERM and SIGHUP (a CI runner's cancel, a
closed terminal) end the process at once: `install_handlers` makes them unwind the same way. A second
signal during the cleanup would cut it short: `uninterrupted` holds signals off until it is done.
Scratch directories whose fixture never got to its cleanup are swept at the end of the session.

Every test process works below a directory of its own (`begin` points TMPDIR there): a process whose
command line, working directory or HOME/TMPDIR/DISKKIT_CACHE names it is this run's. What is still
running when the run's fixtures are all torn down is a leak: `check_left_running` ends it and the run
fails, naming it. Under pytest-xdist each worker checks its own directory and the controller, which
runs no test, fails the run; a pytest started by a test gets a directory of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Iterator

ENDING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
RUN_ENV = "DISKKIT_TEST_RUN"
_scratch: set[Path] = set()
_run: dict[str, Path] = {}


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


def begin(worker: str | None) -> Path:
    """This process's directory, made TMPDIR for it and everything it starts. A worker joins the run
    its controller made; any other pytest (the controller, a run without workers, a pytest started
    by a test) makes a run of its own. Sticky and world-writable as /tmp is: the qemu user's tools
    write their temporary files there too. Short, for the unix sockets made below it."""
    run = os.environ.get(RUN_ENV) if worker else None
    if run is None:
        run = _short_directory()
        os.environ[RUN_ENV] = run
        _run["owned"] = Path(run)
    own = Path(run) / (worker.removeprefix("gw") if worker else "m")
    own.mkdir(exist_ok=True)
    own.chmod(0o1777)
    os.environ["TMPDIR"] = str(own)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    _run["own"] = own
    return own


def _short_directory() -> str:
    """/tmp/dkXXXX: a qemu monitor socket lies 85 bytes below a session daemon's HOME in a scratch
    directory here, and a unix socket's path has 107 at most."""
    while True:
        run = f"/tmp/dk{secrets.token_hex(2)}"
        try:
            os.mkdir(run, 0o755)
        except FileExistsError:
            continue
        os.chmod(run, 0o755)
        return run


def _mentions(pid: str, needle: bytes) -> bool:
    try:
        if needle in Path(f"/proc/{pid}/cmdline").read_bytes():
            return True
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cwd = os.readlink(f"/proc/{pid}/cwd").encode()
    except OSError:
        return False
    if cwd == needle or cwd.startswith(needle + b"/"):
        return True
    return any(var.startswith(name + needle) for var in environ for name in (b"HOME=", b"TMPDIR=", b"DISKKIT_CACHE="))


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


def describe(pid: int) -> str:
    """`pid` and its command line, or that it is gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} {b' '.join(argv).decode(errors='replace')[:200]}"


def _ends_with_us(pid: int) -> bool:
    """multiprocessing's resource tracker, which a test's process pool starts as a child of this
    process: it exits when this process does, by design, and is no daemon left behind."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return False
    return parent == os.getpid() and b"multiprocessing.resource_tracker" in argv


def check_left_running() -> list[str]:
    """After every fixture's teardown: this process's leaks, ended, and said in the run's directory
    for whoever fails the run (`leaks_of_run`)."""
    own = _run.get("own")
    if own is None:
        return []
    left = [describe(pid) for pid in processes_of(own) if alive(pid) and not _ends_with_us(pid)]
    if left:
        end_processes_of(own)
    (own.parent / f"{own.name}.leaks.json").write_text(json.dumps(left))
    return left


def leaks_of_run() -> list[str]:
    """Every test process's leaks, read by the process that made the run, which then removes it."""
    run = _run.get("owned")
    if run is None:
        return []
    leaks = []
    for report in sorted(run.glob("*.leaks.json")):
        leaks += [f"{report.name.removesuffix('.leaks.json')}: {line}" for line in json.loads(report.read_text())]
    with uninterrupted():
        end_processes_of(run)
        shutil.rmtree(run, ignore_errors=True)
    return leaks

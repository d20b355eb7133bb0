"""What a hung process was doing, told in the failure of the test that gave up on it.

A hang seen once in a full run is otherwise lost: the process is killed and only a timeout is
left. Before a test kills a process it waited on in vain, it takes each thread's C stack (gdb: a
libvirt call that retries EINTR itself, a read in D state) and, for a launcher, each thread's Python
traceback (faulthandler on SIGABRT, enabled for every Python process of the run by conftest)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

from tests import leftovers, procs

GDB_SECONDS = 60


def c_stacks(pid: int) -> str:
    """Each thread's C stack and kernel wait channel of `pid`, the process left running."""
    head = f"--- {leftovers.describe(pid)}\n{_kernel_waits(pid)}"
    if not leftovers.alive(pid):
        return head
    if shutil.which("gdb") is None:
        return head + "(no gdb here)\n"
    try:
        out = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 40"],
                             capture_output=True, text=True, timeout=GDB_SECONDS).stdout
    except subprocess.TimeoutExpired:
        out = "(gdb did not answer)\n"
    return head + "\n".join(line for line in out.splitlines() if line.startswith(("Thread ", "#"))) + "\n"


def _kernel_waits(pid: int) -> str:
    """Each thread's state and the kernel function it sleeps in (D: uninterruptible, deaf to signals)."""
    lines = []
    try:
        for tid in sorted(os.listdir(f"/proc/{pid}/task"), key=int):
            with open(f"/proc/{pid}/task/{tid}/stat") as stat, open(f"/proc/{pid}/task/{tid}/wchan") as wchan:
                lines.append(f"thread {tid}: state {stat.read().rpartition(')')[2].split()[0]}, in {wchan.read() or '-'}\n")
    except OSError:
        pass  # it ended meanwhile
    return "".join(lines)


def kill_telling(proc: subprocess.Popen, *others: int) -> str:
    """Kill `proc` after its stacks (and those of `others`, e.g. the daemon it waits on) are taken:
    its C stacks, then its Python tracebacks on its stderr (SIGABRT), which is returned with them."""
    told = "".join(c_stacks(pid) for pid in (proc.pid, *others))
    procs.terminate(proc, 10, signal.SIGABRT)
    err = proc.stderr.read() if proc.stderr is not None else ""
    if isinstance(err, bytes):
        err = err.decode(errors="replace")
    return f"{told}--- its stderr:\n{err[-20000:]}"

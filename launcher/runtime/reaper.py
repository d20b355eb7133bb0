"""A container's PID 1 duty: reap orphans and pass signals on.

When the launcher is PID 1 (a pod without shareProcessNamespace), every process whose parent dies
is handed to it: libvirtd's session daemon, the qemu it starts. Unreaped, they stay zombies, and
libvirt, which polls a dead qemu's pid until it disappears, takes minutes to notice a VM stopped.

The launcher cannot simply reap with waitpid(-1): subprocess waits for its own children by pid and
reports a child reaped by someone else as exit status 0, so a stolen status would turn a failed
qemu-img into a success. So PID 1 forks, like tini: the child runs the launcher and waits for its
own children as usual; PID 1 only forwards signals to it, reaps whatever else it is handed, and
exits with the launcher's status.
"""

from __future__ import annotations

import os
import signal
import sys

# What `podman stop`/`kubectl delete` and a terminal send; the launcher decides what they mean.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def init_if_pid1() -> None:
    """As PID 1, fork: return in the child (which goes on as the launcher) and never return in PID 1."""
    if os.getpid() != 1:
        return
    # Blocked before the fork so a SIGTERM arriving in between is queued for PID 1, not lost.
    watched = {*FORWARDED, signal.SIGCHLD}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    child = os.fork()
    if child == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        return
    # A handler as well as the mask: the kernel drops a signal an unkillable namespace init leaves at
    # SIG_DFL whenever it is not blocked, and a SIGTERM from outside the pod was once lost that way
    # (test_reaper). Caught, it is forwarded whichever way it arrives: sigwaitinfo or the handler.
    for sig in FORWARDED:
        signal.signal(sig, lambda signo, _frame: _forward(child, signo))
    os._exit(serve(child, watched))


def _forward(child: int, signo: int) -> None:
    try:
        os.kill(child, signo)
    except ProcessLookupError:
        pass  # it is exiting; its SIGCHLD follows


def serve(child: int, watched: set[int]) -> int:
    """Pass the signals in `watched` on to `child` and reap every process that dies under this one
    (PID 1, or a child subreaper: the test runner's) until `child` is among them; its exit status.
    `watched` holds SIGCHLD and is blocked by the caller before it forks `child`."""
    while True:
        info = signal.sigwaitinfo(watched)
        if info.si_signo != signal.SIGCHLD:
            _forward(child, info.si_signo)
            continue
        status = _reap(child)
        if status is not None:
            sys.stdout.flush()
            return status


def _reap(child: int) -> int | None:
    """Reap every dead process; the launcher's exit status as a shell reports it once it is among them."""
    result = None
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return result
        if pid == 0:
            return result
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            result = code if code >= 0 else 128 - code

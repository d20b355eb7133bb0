"""Run a command as the child of a process that reaps every orphan under it at once.

    python3 scripts/subreaper.py COMMAND [ARG...]     exits with COMMAND's status

A qemu that libvirt stopped is an orphan (libvirt daemonizes it), and so is a session daemon; libvirt
waits for a stopped qemu's pid to vanish before it calls the VM shut off. Orphans go to the nearest
ancestor marked child subreaper, else to PID 1, and some machines' PID 1 reaps them only every two
seconds: every VM stop of the test suite waited that long. Under this process they are reaped as they
die. It forks nothing but COMMAND, so every other child it reaps is an orphan whose status nobody waits
for. SIGINT is left alone (a terminal sends it to COMMAND's process group as well); SIGTERM, SIGHUP
and SIGQUIT are passed on.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from launcher.runtime.reaper import serve  # noqa: E402  the launcher's PID-1 loop, one reaping loop for both

PR_SET_CHILD_SUBREAPER = 36
FORWARDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: subreaper.py COMMAND [ARG...]", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        os.execvp(argv[0], argv)  # no subreaper here: the command runs as it would have
    watched = {*FORWARDED, signal.SIGCHLD}
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    child = os.fork()
    if child == 0:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, watched)
        os.execvp(argv[0], argv)
    return serve(child, watched)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

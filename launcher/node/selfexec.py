"""The command line that runs this launcher again as a helper process (the node's disk server, ssh's
ProxyCommand, a VM's pod switch), whatever directory it is started from, whether such a helper
has ended, and ending one.

`python -m launcher` puts the working directory first on sys.path, so a `diskkit/` or `launcher/`
directory there would be imported instead of the installed packages (with an editable install the
installed ones are found last). `-P` (Python 3.11's safe path) leaves the working directory off
sys.path and keeps PYTHONPATH, which is how a checkout that is not installed is named.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def module_argv(module: str) -> list[str]:
    return [sys.executable, "-P", "-m", module]


def launcher_argv() -> list[str]:
    return module_argv("launcher")


def ended(pid: int) -> bool:
    """The helper `pid` has exited: reaped if it was our child, a zombie or gone otherwise."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True  # our child, reaped
    except ChildProcessError:
        pass  # started by another launcher process: its parent (or init) reaps it
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


def end_session(pid: int, timeout: float) -> None:
    """End the helper `pid` and everything in its session (TERM, then KILL after `timeout` seconds):
    a helper that sandboxes itself (virtiofsd, passt) serves from a child and only waits for it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while not ended(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if ended(pid):
            return

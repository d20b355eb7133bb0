"""Ending the processes tests start: a signal (SIGTERM), a wait, then SIGKILL."""

from __future__ import annotations

import signal
import subprocess


def terminate(proc: subprocess.Popen, timeout: float = 30, sig: int = signal.SIGTERM) -> None:
    """Ask `proc` to stop (`sig`) and reap it; kill it if it is still there after `timeout` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

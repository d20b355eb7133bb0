"""Ending the daemons tests start: SIGTERM, a wait, then SIGKILL."""

from __future__ import annotations

import signal
import subprocess


def terminate(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Ask `proc` to stop and reap it; kill it if it is still there after `timeout` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

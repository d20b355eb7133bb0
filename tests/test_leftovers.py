"""An interrupted test run leaves nothing behind: Ctrl-C (SIGINT to the process group, as a
terminal sends it) or SIGTERM (a CI runner's cancel) while the qemu user's libvirt session daemon
runs ends that daemon and removes the e2e-* scratch directory (tests/leftovers.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.leftovers import alive, processes_of

REPO = Path(__file__).resolve().parent.parent


def _as_in_a_terminal() -> None:
    # A suite started in the background by a non-interactive shell (`./.ci/run &`) inherits SIGINT
    # ignored, and Python then never turns Ctrl-C into KeyboardInterrupt: the inner run would sleep
    # through it. A terminal's foreground job has SIGINT as the default; give the inner run that.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_run_leaves_no_daemon_and_no_scratch_directory(tmp_path, sig):
    marker = tmp_path / "marker.json"
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/interrupted_case.py"], cwd=REPO,
                            env={**os.environ, "DISKKIT_INTERRUPTED_MARKER": str(marker)}, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=_as_in_a_terminal)
    try:
        deadline = time.monotonic() + 180
        while not marker.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the interrupted run never got to its test"
            time.sleep(0.2)
        time.sleep(0.5)  # the marker is written in one go, but give its write a moment to land
        seen = json.loads(marker.read_text())
        root, pids = Path(seen["root"]), seen["pids"]
        assert root.name.startswith("e2e-") and root.is_dir()
        assert pids, "no session daemon ran for the scratch directory: the test would prove nothing"
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # a terminal's Ctrl-C reaches the whole foreground group
        else:
            proc.send_signal(sig)
        out, _ = proc.communicate(timeout=300)  # a hang guard: its teardown stops daemons, slow on a loaded runner
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode != 0, out  # interrupted, not passed
    assert not root.exists(), out
    assert processes_of(root) == [], out
    assert not [pid for pid in pids if alive(pid)], out  # gone (or a zombie its parent has yet to reap)


def test_a_run_that_leaves_a_process_running_fails_and_ends_it(tmp_path):
    marker = tmp_path / "pid"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/leaking_case.py"], cwd=REPO,
                          env={**os.environ, "DISKKIT_LEAK_MARKER": str(marker)}, capture_output=True, text=True, timeout=300)
    pid = int(marker.read_text())
    assert proc.returncode == 1, proc.stdout  # its one test passed: the leak alone fails the run
    assert "1 passed" in proc.stdout
    assert "processes the run left running" in proc.stdout and f"{pid} sleep 600" in proc.stdout, proc.stdout
    assert not alive(pid)

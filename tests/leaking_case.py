"""Not collected by itself (no test_ prefix): tests/test_leftovers.py runs it in a pytest of its own,
which must fail because this test leaves a daemon running."""

import os
import subprocess
import tempfile
from pathlib import Path


def test_leave_a_daemon_running():
    # Started in this run's directory and detached, as a forgotten registry or gpg-agent would be.
    proc = subprocess.Popen(["sleep", "600"], cwd=tempfile.gettempdir(), start_new_session=True)
    Path(os.environ["DISKKIT_LEAK_MARKER"]).write_text(str(proc.pid))

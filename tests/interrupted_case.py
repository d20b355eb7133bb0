"""Not collected by itself (no test_ prefix): tests/test_leftovers.py runs it in a pytest of its own
and interrupts it while the qemu user's libvirt session daemon runs."""

import json
import os
import time
from pathlib import Path

from tests.leftovers import processes_of


def test_wait_to_be_interrupted(root_side, qemu_user):
    marker = Path(os.environ["DISKKIT_INTERRUPTED_MARKER"])
    marker.write_text(json.dumps({"root": str(qemu_user.root), "pids": processes_of(qemu_user.root)}))
    time.sleep(600)

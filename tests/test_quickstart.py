"""The README's quick start, run as written: the block between its quickstart markers, in a fresh
directory holding the test guest as `my-disk.qcow2`, with only the registry's port changed (5000 may
be taken on a test machine). A README command that stops working fails here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.distribution import free_port
from tests.testguest import ensure_testguest
from tests.vmhost import qemu_scratch

REPO = Path(__file__).resolve().parent.parent


def quickstart() -> str:
    readme = (REPO / "README.md").read_text()
    found = re.search(r"<!-- quickstart -->\n```sh\n(.*?)```\n<!-- /quickstart -->", readme, re.S)
    assert found, "README.md has no quickstart block"
    return found.group(1)


@pytest.mark.vm
def test_the_quick_start_runs_as_written():
    """As root on a host with no libvirt daemon running (the CI machine), as the README promises."""
    block = quickstart()
    assert block.startswith("REGISTRY=127.0.0.1:5000\n")
    script = block.replace("REGISTRY=127.0.0.1:5000", f"REGISTRY=127.0.0.1:{free_port()}", 1)
    with qemu_scratch("quickstart-") as scratch:  # the node cache must be reachable by qemu's user
        _run_quickstart(script, scratch)


def _run_quickstart(script: str, scratch: Path) -> None:
    work = scratch / "quickstart"
    work.mkdir()
    shutil.copy(ensure_testguest() / "testguest.qcow2", work / "my-disk.qcow2")
    # As the README's reader: a shell with the tools on PATH, stopping at the first failing command;
    # the registry it starts in the background ends with the script. The node cache is the test's.
    wrapped = "set -e\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + script
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}", "DISKKIT_CACHE": str(scratch / "cache")}
    done = subprocess.run(["bash", "-c", wrapped], cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    assert "VM mine was stopped" in done.stdout, done.stdout
    assert f"Linux {os.uname().nodename} " not in done.stdout  # uname -a ran in the guest, not here
    assert re.search(r"^Linux \S+ \S+", done.stdout, re.M), done.stdout
    assert "testguest login:" in done.stdout, done.stdout  # launcher logs showed the console

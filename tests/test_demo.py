"""scripts/demo.sh, the README's first command, run as shipped: its set-up (scripts/setup.sh demo: the
package lists, the Debian packages it needs, the .venv, the test guest in build/testguest), then the
test guest built, pushed to a registry it starts, read back, verified, booted from
examples/vmi-containerdisk.yaml, its console shown while it stays up, and stopped through its power
button. As root on a host with no libvirt daemon running, as the README promises; the node cache and
HOME are the test's own, so it reaches nothing of the machine's but the checkout's build/."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.testguest import parse_console
from tests.vmhost import qemu_scratch

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.vm
@pytest.mark.timeout(900)  # apt's package lists and pip come first, as on a user's machine
def test_the_demo_runs_as_shipped():
    readme = (REPO / "README.md").read_text()
    assert "./scripts/demo.sh   #" in readme  # what the README tells a newcomer to run first
    with qemu_scratch("diskkit-demo-") as scratch:  # the node cache must be reachable by qemu's user
        home = scratch / "home"
        home.mkdir()
        env = {**os.environ, "HOME": str(home), "DISKKIT_CACHE": str(scratch / "cache")}
        done = subprocess.run(["./scripts/demo.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=840)
    out = done.stdout
    assert done.returncode == 0, f"{out}\n{done.stderr}"
    steps = re.findall(r"^\$ (\S+ \S+)", out.replace("\033[1m", "").replace("\033[0m", ""), re.M)
    assert steps == ["diskkit build", "diskkit inspect", "diskkit push", "diskkit verify", "skopeo inspect",
                     "launcher run", "launcher logs", "launcher ls", "launcher stop"], out
    assert re.search(r"^sha256:[0-9a-f]{64} linux/amd64 layers=1$", out, re.M), out
    # `launcher logs` showed a guest that reported and then stayed up, as a real one does, until
    # `launcher stop` pressed its power button.
    logs = out.split("$ launcher logs", 1)[1].split("$ launcher ls", 1)[0]
    console = parse_console(logs)
    assert console["ready"] and console["done"], logs
    assert not console["acpi_poweroff"], logs
    listed = out.split("$ launcher ls", 1)[1].split("$ launcher stop", 1)[0]
    assert re.search(r"^default_testguest\s+running\s", listed, re.M), listed
    assert "VM testguest was stopped" in out.split("$ launcher stop", 1)[1], out
    assert "destroying it" not in done.stderr, done.stderr

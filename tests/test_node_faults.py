"""The node under faults a real setup produces (issue: the node under faults and at scale): a cache on
a full filesystem. The filesystem is a small tmpfs mounted in a private mount namespace of the
test's own, so the host sees nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import launcher_command, run_diskkit
from tests.distribution import start_registry
from tests.faultproxy import Fault
from tests.lazyhost import random_disk, wait_for

NOREG = "--tls-verify=false"
MIB = 1 << 20

LIST_FILES = """
import json, os, sys
root = sys.argv[1]
print(json.dumps(sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)))
"""


def on_small_tmpfs(tmp_path: Path, size: str, *launcher_args: str) -> tuple[int, str, list[str]]:
    """`launcher ARGS --cache-dir M/cache` with M a tmpfs of `size`: exit code, stderr, files left."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    command = " ".join(f"'{a}'" for a in launcher_command(*launcher_args, "--cache-dir", mnt / "cache"))
    script = (f"mount -t tmpfs -o size={size} tmpfs {mnt} && {{ {command}; echo \"rc=$?\" >&2; "
              f"{sys.executable} -c '{LIST_FILES}' {mnt / 'cache'}; }}")
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=300)
    err = done.stderr.strip().splitlines()
    assert err and err[-1].startswith("rc="), done.stderr
    return int(err[-1][3:]), "\n".join(err[:-1]), json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("lazy", ["--no-lazy", "--lazy"])
def test_a_pull_into_a_full_cache_fails_in_one_line_and_keeps_nothing(tmp_path, registry, lazy):
    """A 48 MiB disk into a 20 MiB cache: before, `layer 0 cannot be decompressed: [Errno 28] ...`,
    and the 17 MiB kept for a resume filled the filesystem it failed on."""
    image = f"{registry.host}/faults/full:{lazy.strip('-')}"
    assert run_diskkit("build", NOREG, lazy, random_disk(tmp_path / "disk.img", 48 * MIB, seed=5), "-t", image).code == 0
    code, err, left = on_small_tmpfs(tmp_path, "20m", "pull", NOREG, image)
    assert code != 0
    assert len(err.splitlines()) == 1, err
    assert "No space left on device writing its files to the cache" in err and "free space there (launcher gc) and pull again" in err, err
    # Locks are empty files that cost nothing; no disk, staging or partial download is left.
    assert [f for f in left if not f.startswith("locks/")] == [], left


def test_a_pull_rides_out_a_registry_restart(tmp_path, fault_proxy):
    """The registry process stops while a pull waits on its layer and comes back seconds later (a
    rolling update of the registry): the pull retries through it and installs the genuine disk."""
    own = start_registry(tmp_path / "registry")
    try:
        disk = random_disk(tmp_path / "disk.img", 24 * MIB, seed=9)
        image = f"{own.host}/faults/restart:v1"
        assert run_diskkit("build", NOREG, "--no-lazy", disk, "-t", image).code == 0
        proxy = fault_proxy(own)
        proxy.add(Fault("GET", r"/blobs/sha256:", "stall", times=1, arg=3))  # the layer's request waits here
        cache = tmp_path / "cache"
        pull = subprocess.Popen(launcher_command("pull", NOREG, "--cache-dir", cache, image.replace(own.host, proxy.host)),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: not proxy.pending, 60, "the pull to ask for its layer")
        own.stop()
        # down past the stall: the proxy finds no registry behind it, and answers 502
        wait_for(lambda: any(status == 502 for _, path, status in proxy.log if "/blobs/sha256:" in path), 60, "the stalled request to find no registry")
        own.start()
        out, err = pull.communicate(timeout=120)
    finally:
        own.stop()
    assert pull.returncode == 0, err
    assert Path(out.strip().splitlines()[-1]).read_bytes() == disk.read_bytes()

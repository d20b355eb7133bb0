"""`launcher run --lazy` starts the node's disk server before it prepares anything else, so the
server's own start overlaps the run's; when the run then needs the server it waits for that one,
never starting a second (which would only find the cache taken). Real server processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from launcher.diskserver.spawn import ensure_server, start_server
from launcher.diskserver.control import request
from launcher.node.cache import Cache
from tests.procs import terminate


def test_a_server_started_early_is_the_one_the_run_then_waits_for(tmp_path):
    cache = Cache(tmp_path / "cache")
    child = start_server(cache)
    assert child is not None
    try:
        assert start_server(cache) is child  # asked again before it answered: still that one
        control = ensure_server(cache)
        assert request(control, {"op": "status"})["pid"] == child.pid
        assert start_server(cache) is None and ensure_server(cache) == control  # it answers: nothing more starts
        log = (tmp_path / "cache" / "serve" / "server.log").read_text()
        assert log.count("serving NBD on") == 1 and "already serves this cache" not in log, log
    finally:
        terminate(child)


# Each process does what `launcher run --lazy` does: start the server early, then wait for it.
RACER = """
import sys, time
from launcher.diskserver.spawn import ensure_server, start_server
from launcher.node.cache import Cache
cache = Cache(sys.argv[1])
while time.time() < float(sys.argv[2]):
    time.sleep(0.001)
start_server(cache)
print(ensure_server(cache))
"""


def test_launchers_starting_together_start_one_server(tmp_path):
    # bench/density.py's finding: N lazy runs started at once each spawned a server, all but one of
    # which found the cache taken and exited, having cost an interpreter start each on a busy node.
    cache = Cache(tmp_path / "cache")
    control = cache.root / "serve" / "control.sock"
    start_at = time.time() + 3  # all interpreters up and waiting, then released together
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(cache.root), str(start_at)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(4)]
    pid = None
    try:
        results = [racer.communicate(timeout=120) for racer in racers]
        assert [r.returncode for r in racers] == [0] * 4, results
        assert {out.strip() for out, _ in results} == {str(control)}
        pid = request(control, {"op": "status"})["pid"]
        log = (cache.root / "serve" / "server.log").read_text()
        assert log.count("serving NBD on") == 1 and "already serves this cache" not in log, log
    finally:
        for racer in racers:
            if racer.poll() is None:
                racer.kill()
        if pid is not None:
            os.kill(pid, signal.SIGTERM)

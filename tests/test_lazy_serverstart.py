"""`launcher run --lazy` starts the node's disk server before it prepares anything else, so the
server's own start overlaps the run's; when the run then needs the server it waits for that one,
never starting a second (which would only find the cache taken). Real server processes."""

from __future__ import annotations

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

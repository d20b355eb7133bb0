"""Helper processes the launcher starts of itself (the node's disk server, ssh's ProxyCommand) import
the installed diskkit and launcher whatever directory they are started from: `python -m` would put the
working directory first on sys.path, and a `diskkit/` there was imported instead (issue 32, trap 6)."""

from __future__ import annotations

import subprocess

import pytest

from launcher.diskserver.control import request
from launcher.diskserver.spawn import ensure_server, start_server
from launcher.node.cache import Cache
from launcher.node.selfexec import launcher_argv
from tests.procs import terminate


@pytest.fixture
def decoys(tmp_path, monkeypatch):
    """A working directory holding a `diskkit` and a `launcher` package that fail when imported."""
    where = tmp_path / "work"
    for name in ("diskkit", "launcher"):
        (where / name).mkdir(parents=True)
        (where / name / "__init__.py").write_text(f"raise ImportError('the decoy {name} in the working directory was imported')\n")
    monkeypatch.chdir(where)
    return where


def test_the_disk_server_starts_from_a_directory_holding_a_diskkit_package(tmp_path, decoys):
    cache = Cache(tmp_path / "cache")
    child = start_server(cache)
    assert child is not None
    try:
        control = ensure_server(cache)
        assert request(control, {"op": "status"})["pid"] == child.pid
    finally:
        terminate(child)
        log = (tmp_path / "cache" / "serve" / "server.log").read_text()
        assert "decoy" not in log, log


def test_the_proxy_command_launcher_runs_from_a_directory_holding_decoys(decoys):
    out = subprocess.run([*launcher_argv(), "--version"], cwd=decoys, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("launcher"), out.stderr

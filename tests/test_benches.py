"""The benches measure the checkout they sit in, not whichever one the venv has installed in
editable mode (its console scripts import that one)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench_build():
    spec = importlib.util.spec_from_file_location("diskkit_bench_build_under_test", ROOT / "bench" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


def test_bench_commands_import_this_checkout(monkeypatch, tmp_path):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    bench = _bench_build()
    assert bench.diskkit_command() == [sys.executable, "-m", "diskkit"]
    assert bench.tool_command("launcher") == [sys.executable, "-m", "launcher"]
    # From another directory, as the benches' child processes run: only PYTHONPATH says which tree.
    probe = subprocess.run([sys.executable, "-c", "import diskkit, launcher; print(diskkit.__file__); print(launcher.__file__)"],
                           cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True, check=True)
    files = [Path(line) for line in probe.stdout.split()]
    assert [f.parent.parent for f in files] == [ROOT, ROOT]
    assert bench.machine_line("0.00 0.00 0.00").startswith(f"tree {bench.use_this_tree()}; {os.cpu_count()} CPUs, load average 0.00 0.00 0.00 before")

"""The benches measure the checkout they sit in, not whichever one the venv has installed in
editable mode (its console scripts import that one); bench/delta.py runs end to end at a tiny
size, so it cannot rot."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.slow  # casync, umoci and five pushes: half a minute
def test_delta_bench_runs_at_a_tiny_size(tmp_path):
    """bench/delta.py end to end on an 8 MiB-content disk, one run: every pair is made (the rebuilt one
    from the same disk: --debian is for the figures), pushed and
    measured three ways, each output checked against v2's disk byte for byte (the bench exits
    non-zero otherwise), and the figures add up (bytes counted at the proxies, not estimated)."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "delta.py"), "--size-mb", "8", "--runs", "1", "--json",
                           "--workdir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    pairs = {p["case"]: p for p in out["pairs"]}
    assert list(pairs) == ["raw-1", "raw-10", "qcow2-inplace", "qcow2-convert", "qcow2-rebuilt"]
    results = {(r["case"], r["variant"]): r for r in out["results"]}
    assert set(results) == {(case, v) for case in pairs for v in ("full pull", "ours", "casync")}
    for case, pair in pairs.items():
        assert 0 < pair["new_chunks"] <= pair["chunks"]
        assert 0 < pair["ideal_bytes"] < pair["image_bytes"]
        full = results[(case, "full pull")]["median"]["fetched_bytes"]
        assert full >= pair["image_bytes"]  # a full pull reads every blob of v2 through the proxy
        casync = results[(case, "casync")]["median"]["fetched_bytes"]
        assert 0 < casync < pair["casync_store_bytes"]  # v1 as the seed: casync fetched only part of its store
        assert 0 < results[(case, "ours")]["median"]["fetched_bytes"] <= full
    assert pairs["raw-10"]["new_chunks"] > pairs["raw-1"]["new_chunks"]
    # v1 really is in the cache each timed pull starts from: where chunks stay put, ours fetches the
    # issue's goal, the new chunks' members and the TOC (plus manifest and config) within 1.2x.
    for case in ("raw-1", "raw-10"):
        assert results[(case, "ours")]["median"]["fetched_bytes"] <= 1.2 * pairs[case]["ideal_bytes"]
    # A qcow2 compressed again by qemu-img convert -c moved every cluster after the first change:
    # content-defined chunks still find them in v1, so ours fetches about the ideal there too.
    assert results[("qcow2-rebuilt", "ours")]["median"]["fetched_bytes"] <= 1.2 * pairs["qcow2-rebuilt"]["ideal_bytes"]
    named = {(c["case"], c["name"]) for c in out["checks"]}
    assert {(case, "ours fetched / ideal") for case in pairs} <= named
    assert {("raw-1", "ours/casync bytes"), ("raw-1", "ours/casync wall"), ("raw-10", "ours/casync bytes")} <= named
    assert {("qcow2-rebuilt", "ours fetched"), ("qcow2-rebuilt", "ours/casync wall")} <= named


def test_launch_bench_runs_at_a_tiny_size(tmp_path):
    """bench/launch.py's pull part on a 16 MiB-content disk, one warm run: launcher, skopeo+umoci and
    the floors (bench/pullfloor.py, from storage and over HTTP) each leave the pushed disk byte for
    byte (the bench exits non-zero otherwise), and the floors' figures sit beside the target's."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "launch.py"), "--size-mb", "16", "--runs", "1", "--vms", "0",
                           "--cache", "warm", "--json", "--workdir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert sorted(r["variant"] for r in out["pull"]) == sorted(["launcher", "skopeo+umoci", "floor", "floor over HTTP", "floor, no disk"])
    assert all(r["samples"] and r["samples"][0]["wall_s"] > 0 for r in out["pull"]), out["pull"]
    checks = {c["name"]: c for c in out["checks"]}
    assert checks["pull+extract skopeo+umoci/launcher"]["pass"] in (True, False)
    for name in ("skopeo+umoci/floor (the most possible)", "launcher/floor over HTTP (beyond a download's)", "floor over HTTP/floor (the download)"):
        assert checks[name]["pass"] is None and checks[name]["value"] > 0, checks[name]


@pytest.mark.vm  # boots VMs through the bench's own launchers, which no fixture names
def test_density_bench_two_vms_of_one_image_at_once(tmp_path):
    # bench/density.py at N=2 in both modes, as the README's table is made: the figures are not
    # asserted (shared machines), what the node must do with them is: every VM up, the layer sent once.
    from tests.testguest import ensure_testguest

    guest = ensure_testguest() / "testguest-poweroff.qcow2"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "density.py"), "--vms", "2", "--workdir", str(tmp_path),
                           "--guest", str(guest), "--json"], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    rounds = {r["mode"]: r for r in report["rounds"]}
    assert set(rounds) == {"pulled", "lazy"}
    for r in rounds.values():
        assert r["running"] == 2 and r["failures"] == [], r
        assert r["all_first_line_s"] is not None and r["all_done_s"] >= r["all_first_line_s"] > 0
        assert r["launcher_rss_max_mib"] > 0 and r["qemu_cpu_median_s"] > 0
    assert rounds["pulled"]["layer_downloads"] == 1 and rounds["pulled"]["layer_served_x"] < 1.5  # two pulls at once, one download
    assert rounds["lazy"]["servers"] == 1 and rounds["lazy"]["exports"] == 1 and rounds["lazy"]["server_rss_mib"] > 0
    assert 0 < rounds["lazy"]["layer_served_x"] < 1.5  # the server's fill: the blob once at most
    assert all(c["pass"] for c in report["checks"]), report["checks"]


@pytest.mark.vm  # boots VMs through the bench's own launchers, which no fixture names
def test_lazy_bench_over_a_link_at_a_small_size(tmp_path):
    # bench/lazy.py as docs/benchmarks.md runs it over the modelled link, at 96 MiB and one run without
    # full pulls or warm-up: the figures are not asserted (shared machines), that each variant booted and the
    # timeline of a lazy run holds its requests, from the manifest to the disk's ranges, is.
    from tests.testguest import ensure_testguest

    guest = ensure_testguest() / "testguest-poweroff.qcow2"
    timeline = tmp_path / "timeline"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "lazy.py"), "--large-mb", "96", "--runs", "1", "--no-full",
                           "--no-warm-up", "--link", "5,400", "--timeline", str(timeline), "--guest", str(guest), "--workdir", str(tmp_path / "work"),
                           "--json"], capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert set(out["median_s"]) == {"lazy-small", "lazy-large", "local-small"}, out
    assert all(v > 0 for v in out["median_s"].values()), out
    assert any(c["name"].endswith("over the link") for c in out["checks"]), out["checks"]
    run = json.loads((timeline / "lazy-large-1.json").read_text())
    events = run["events"]
    assert all(0 <= e["at"] <= run["measured_s"] + 0.5 for e in events), events
    manifest = next(e["at"] for e in events if e["event"] == "arrived" and "/manifests/" in e["target"])
    ranges = [e for e in events if e["event"] == "arrived" and "/blobs/" in e["target"] and e["range"]]
    assert ranges and all(e["at"] > manifest for e in ranges), events

"""Benchmark lazy images against plain gzip images of the same disk: size and build time.

The disk is bench/build.py's real-content qcow2 (ext4 filled from /usr), or any file given with
--disk. Three variants, each a whole `diskkit build` process writing an OCI layout:

  plain  `diskkit build --no-lazy DISK -t oci:DIR:bench`  (one gzip stream)
  lazy   `diskkit build --lazy DISK -t oci:DIR:bench`     (TOC v3: one gzip member per chunk, cut by content)
  fixed  `diskkit build --lazy --lazy-chunks fixed ...`   (TOC v2: one gzip member per 1 MiB chunk,
                                                           the lazy build before content-defined chunks)

Runs are interleaved (plain lazy fixed plain ...), writeback is flushed (sync) before each, and the
disk is read once beforehand so no run pays for the first read from storage. Reported: median and
best wall time, median CPU time, peak RSS, and the layer size. Targets: lazy layer <= 1.01x the
plain one, lazy build (median wall) <= 1.15x the plain one and <= 1.05x the fixed-chunk one.
PASS/MISS is printed for each; the exit status is 0 whatever the figures.

Run from the project root (diskkit runs as `python -m diskkit`, this checkout's code):
    .venv/bin/python bench/lazygz.py                          # 700 MiB of /usr content, 5 runs
    .venv/bin/python bench/lazygz.py --disk my.qcow2 --runs 3 --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import sibling

bb = sibling.load("build")
MIB = bb.MIB
TARGET_SIZE = 1.01
TARGET_TIME = 1.15
TARGET_CUTS = 1.05  # what cutting chunks by content may cost a build over fixed chunks
VARIANTS = {"plain": ["--no-lazy"], "lazy": ["--lazy"], "fixed": ["--lazy", "--lazy-chunks", "fixed"]}


def layer_size(layout: Path) -> int:
    index = json.loads((layout / "index.json").read_text())
    blobs = layout / "blobs" / "sha256"
    manifest = json.loads((blobs / index["manifests"][0]["digest"][7:]).read_bytes())
    return sum(layer["size"] for layer in manifest["layers"])


def run_once(variant: str, disk: Path, workdir: Path) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="lazygz-", dir=workdir))
    try:
        layout = scratch / "layout"
        os.sync()
        wall, cpu, rss = bb.run_measured([*bb.diskkit_command(), "build", *VARIANTS[variant], str(disk), "-t", f"oci:{layout}:bench"],
                                         scratch / "build.log")
        return {"wall_s": wall, "cpu_s": cpu, "rss_kib": rss, "layer_bytes": layer_size(layout)}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def summary(samples: list[dict]) -> dict:
    walls = [s["wall_s"] for s in samples]
    return {"median_wall_s": statistics.median(walls), "best_wall_s": min(walls),
            "median_cpu_s": statistics.median(s["cpu_s"] for s in samples),
            "peak_rss_mib": max(s["rss_kib"] for s in samples) / 1024, "layer_bytes": samples[0]["layer_bytes"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--disk", type=Path, help="disk to build from (default: bench/build.py's /usr disk of --size-mb)")
    parser.add_argument("--size-mb", type=int, default=bb.DEFAULT_SIZE_MB, help="MiB of /usr content when making the disk (default %(default)s)")
    parser.add_argument("--workdir", type=Path, default=bb.DEFAULT_WORKDIR, help="cache for the made disk and scratch for outputs (default build/bench)")
    parser.add_argument("--runs", type=int, default=5, help="runs per variant, interleaved (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    args = parser.parse_args(argv)
    workdir = bb.checked_workdir(parser, args, ("mke2fs", "qemu-img"))
    disk = args.disk.resolve() if args.disk else Path(bb.make_disk(workdir, args.size_mb, bb.log)["path"])
    bb.warm_cache(disk)
    load_before = bb.load_average()
    samples: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for run in range(args.runs):
        for variant in VARIANTS:
            sample = run_once(variant, disk, workdir)
            bb.log(f"run {run + 1}/{args.runs} {variant}: {sample['wall_s']:.2f} s, {sample['layer_bytes']} bytes")
            samples[variant].append(sample)
    plain, lazy, fixed = summary(samples["plain"]), summary(samples["lazy"]), summary(samples["fixed"])
    size_ratio = lazy["layer_bytes"] / plain["layer_bytes"]
    time_ratio = lazy["median_wall_s"] / plain["median_wall_s"]
    cuts_ratio = lazy["median_wall_s"] / fixed["median_wall_s"]
    checks = [
        {"check": f"lazy layer / plain layer <= {TARGET_SIZE}", "value": round(size_ratio, 4), "pass": size_ratio <= TARGET_SIZE},
        {"check": f"lazy build / plain build (median wall) <= {TARGET_TIME}", "value": round(time_ratio, 4), "pass": time_ratio <= TARGET_TIME},
        {"check": f"lazy build / fixed-chunk build (median wall) <= {TARGET_CUTS}", "value": round(cuts_ratio, 4), "pass": cuts_ratio <= TARGET_CUTS},
        {"check": "lazy build / fixed-chunk build (median CPU), for information", "value": round(lazy["median_cpu_s"] / fixed["median_cpu_s"], 4), "pass": None},
    ]
    if args.json:
        print(json.dumps({"tree": bb.use_this_tree(), "cpus": os.cpu_count(), "load_average_before": load_before,
                          "load_average_after": bb.load_average(), "disk": str(disk), "disk_bytes": disk.stat().st_size, "runs": args.runs, "plain": plain, "lazy": lazy, "fixed": fixed,
                          "samples": samples, "checks": checks}, indent=2))
        return 0
    print(bb.machine_line(load_before))
    print(f"disk {disk} ({disk.stat().st_size / MIB:.0f} MiB), {args.runs} interleaved runs each, sync before each")
    print(f"{'variant':8} {'median s':>9} {'best s':>8} {'cpu s':>8} {'rss MiB':>8} {'layer bytes':>13}")
    for name, s in (("plain", plain), ("lazy", lazy), ("fixed", fixed)):
        print(f"{name:8} {s['median_wall_s']:9.2f} {s['best_wall_s']:8.2f} {s['median_cpu_s']:8.2f} {s['peak_rss_mib']:8.0f} {s['layer_bytes']:13d}")
    for check in checks:
        print(f"{ {True: 'PASS', False: 'MISS', None: '    '}[check['pass']]}  {check['check']}: {check['value']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

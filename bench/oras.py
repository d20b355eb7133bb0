"""Benchmark `diskkit build --artifact` against oras-py pushing the same raw disk as an artifact.

The design names oras-py for artifact pushes; this measures whether it is fit for a disk. One raw
blob of --size-mb (pseudo-random bytes, so nothing is cheaper than it looks; made once, cached in
the workdir) is pushed to a CNCF distribution registry this script starts on 127.0.0.1 (bench/
registry.py's), each run to a fresh repository whose blob links are deleted afterwards:

  diskkit          `diskkit build --artifact --tls-verify=false disk.img -t HOST/bench/ours-N:v1`
  oras-py          `OrasClient(insecure=True).push(target, files=["disk.img:application/vnd.kubevirt.disk.raw"])`
                   (its default: POST, then one monolithic PUT)
  oras-py chunked  the same with do_chunked=True (POST, PATCH per 16 MiB chunk, PUT)

oras-py runs under --oras-python (a Python with `pip install oras==0.2.43`; this venv does not
carry it). Reported per variant: median wall and CPU time and the largest peak RSS over --runs
interleaved runs (bench/build.py's helper: ru_maxrss of the process and its children), and the
bytes the registry holds. Whether each side streams shows in the RSS against the blob's size.
What cannot be timed is printed from reading oras-py (provider.py): whether a download checks the
blob's digest. Exit status 0 unless a command fails.

Run from the project root:
    python3 -m venv /tmp/oras-venv && /tmp/oras-venv/bin/pip install oras==0.2.43
    .venv/bin/python bench/oras.py --oras-python /tmp/oras-venv/bin/python            # 256 MiB, 3 runs
    .venv/bin/python bench/oras.py --oras-python /tmp/oras-venv/bin/python --size-mb 64 --runs 5 --json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import sibling

bb = sibling.load("build")
rb = sibling.load("registry")
MIB = bb.MIB
MEDIA = "application/vnd.kubevirt.disk.raw"

ORAS_PUSH = """
import sys
from oras.client import OrasClient
path, target, chunked = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
OrasClient(insecure=True).push(target=target, files=[f"{path}:{sys.argv[4]}"], disable_path_validation=True, do_chunked=chunked, quiet=True)
"""

OURS, ORAS, ORAS_CHUNKED = "diskkit --artifact", "oras-py", "oras-py chunked"


def make_disk(workdir: Path, size_mb: int) -> Path:
    path = workdir / f"oras-bench-{size_mb}m.img"
    if path.exists() and path.stat().st_size == size_mb * MIB:
        return path
    rng = random.Random(7)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        for _ in range(size_mb):
            out.write(rng.randbytes(MIB))
    tmp.replace(path)
    return path


def command(variant: str, disk: Path, target: str, oras_python: str) -> list[str]:
    if variant == OURS:
        return [*bb.diskkit_command(), "build", "--artifact", "--tls-verify=false", str(disk), "-t", target]
    return [oras_python, "-c", ORAS_PUSH, str(disk), target, "1" if variant == ORAS_CHUNKED else "0", MEDIA]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path("build/bench"))
    ap.add_argument("--oras-python", default=sys.executable, help="a Python that can `import oras` (0.2.43)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    check = subprocess.run([args.oras_python, "-c", "import oras.version as v; print(v.__version__)"], capture_output=True, text=True)
    if check.returncode != 0:
        raise SystemExit(f"{args.oras_python} cannot import oras: pip install oras==0.2.43 into it, or give --oras-python")
    oras_version = check.stdout.strip()
    args.workdir.mkdir(parents=True, exist_ok=True)
    load_before = bb.load_average()
    disk = make_disk(args.workdir, args.size_mb)
    registry = rb.Registry(args.workdir)
    log_path = args.workdir / "oras-bench.log"
    variants = [OURS, ORAS, ORAS_CHUNKED]
    samples: dict[str, list[tuple[float, float, int, int]]] = {v: [] for v in variants}
    try:
        for run in range(args.runs):
            for n, variant in enumerate(variants):
                repo = f"bench/{['ours', 'oras', 'chunked'][n]}-{run}"
                target = f"{registry.host}/{repo}:v1"
                wall, cpu, rss = bb.run_measured(command(variant, disk, target, args.oras_python), log_path)
                stored = registry.pushed_bytes(repo, "v1")
                registry.forget(repo, "v1")
                samples[variant].append((wall, cpu, rss, stored))
    finally:
        registry.stop()
    results = {
        v: {"wall_s": statistics.median(s[0] for s in rows), "cpu_s": statistics.median(s[1] for s in rows),
            "peak_rss_mib": max(s[2] for s in rows) / 1024, "registry_bytes": rows[0][3], "runs": len(rows)}
        for v, rows in samples.items()
    }
    findings = {
        "oras_version": oras_version,
        "monolithic_upload_reads_whole_blob_into_memory": True,  # provider.py put_upload: data=fd.read()
        "reads_the_file_twice": True,  # oci.NewLayer hashes the file, then upload_blob reads it again
        "download_checks_digest": False,  # provider.py download_blob writes iter_content chunks, no digest or size check
    }
    out = {"size_mib": args.size_mb, "machine": bb.machine_line(load_before), "results": results, "oras_py": findings}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.size_mb} MiB raw blob, {args.runs} runs each; {out['machine']}; oras-py {oras_version}")
    for variant, r in results.items():
        print(f"  {variant:18} wall {r['wall_s']:6.2f} s  cpu {r['cpu_s']:6.2f} s  peak RSS {r['peak_rss_mib']:7.1f} MiB  registry {r['registry_bytes']} bytes")
    print("  oras-py (read in provider.py): monolithic PUT reads the whole blob into memory; the file is read twice "
          "(hash, then upload); download_blob checks neither digest nor size")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How a disk from an upstream URL is best read: unwrapped as it arrives into one temporary file
(what `diskkit build URL` does), or downloaded whole first and then unwrapped into a second one.

A raw disk of --size-mb MiB (a quarter of it random, the rest a repeated text pattern and zeros,
as a cloud image's mix of data and free space) is compressed with gzip (or --kind xz/zstd) and
served on 127.0.0.1 by Python's http.server. Each variant runs --runs times, interleaved, in this
process, with `sync` before each run:

  no-file   GET, sha256 and decompress with nothing written: the floor of a build that took the
            stream itself (none can: qemu-img checks a qcow2 before it is packaged, and a tar header
            states the disk's size before its first byte; a compressed download's size is known last)
  stream    diskkit.source.fetch.download: GET, sha256, decompress, sparse write: one pass, one file
  serial    stream with fetching and hashing in the decompressing thread (no ReadAhead)
  two-pass  the same GET written to a file (fsync'd), then diskkit.disk.payload.unwrap into a second
  build     `diskkit build URL -t oci:DIR` whole (download and build), for scale

Run from the project root:
    .venv/bin/python bench/upstream.py                       # 512 MiB gzip, 3 runs
    .venv/bin/python bench/upstream.py --kind xz --size-mb 256 --runs 3
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from diskkit.disk import payload
from diskkit.registry.options import RegistryOptions
from diskkit.source import checksum, fetch, httpfile
from diskkit.streams.compression import decompressing_reader

TOOLS = {"gzip": ["gzip", "-1"], "xz": ["xz", "-0", "-T2"], "zstd": ["zstd", "-q", "-3", "--rm"]}
SUFFIX = {"gzip": ".gz", "xz": ".xz", "zstd": ".zst"}


def make_disk(path: Path, size_mb: int) -> None:
    pattern = (b"diskkit upstream bench " * 3000)[: 1 << 16]
    with open(path, "wb") as f:
        for i in range(size_mb):
            if i % 4 == 0:
                f.write(os.urandom(1 << 20))
            elif i % 4 == 1:
                f.write(pattern * 16)
            else:
                f.seek(1 << 20, 1)
        f.truncate(size_mb << 20)


def serve(directory: Path):
    quiet = type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda self, *a: None})
    handler = functools.partial(quiet, directory=str(directory))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def stream(url: str, work: Path, sha: str) -> None:
    fetch.download(url, work, [checksum.parse_value(f"sha256:{sha}")], RegistryOptions())


def no_file(url: str, work: Path, sha: str) -> None:
    """The least a build taking the stream itself would pay: GET, sha256, decompress, nothing kept."""
    hashes = checksum.Hashes([checksum.parse_value(f"sha256:{sha}")])
    kind = {".gz": "gzip", ".xz": "xz", ".zst": "zstd"}[Path(url).suffix]
    with requests.get(url, stream=True, timeout=60) as answer:
        answer.raw.decode_content = False

        class Tee:
            def read(self, n=-1):
                data = answer.raw.read(n)
                hashes.update(data)
                return data

            def readinto(self, buf):
                data = self.read(len(buf))
                buf[: len(data)] = data
                return len(data)

        buf = bytearray(1 << 20)
        with decompressing_reader(Tee(), kind) as stream:
            while stream.readinto(buf):
                pass
    assert hashes.mismatch() is None


def serial(url: str, work: Path, sha: str) -> None:
    """What stream does, with fetching and hashing in the same thread as decompressing and writing."""
    work.mkdir(parents=True)
    hashes = checksum.Hashes([checksum.parse_value(f"sha256:{sha}")])
    with httpfile.RemoteFile(url, RegistryOptions()) as raw:
        payload.unwrap_stream(fetch.Hashing(raw, hashes), Path(url).name, url, work / "disk")
    assert hashes.mismatch() is None


def two_pass(url: str, work: Path, sha: str) -> None:
    work.mkdir(parents=True)
    hashes = checksum.Hashes([checksum.parse_value(f"sha256:{sha}")])
    packed = work / url.rsplit("/", 1)[1]
    with requests.get(url, stream=True, timeout=60) as answer, open(packed, "wb") as f:
        for chunk in answer.iter_content(1 << 20):
            hashes.update(chunk)
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    assert hashes.mismatch() is None
    payload.unwrap(packed, work / "unwrapped")


def build(url: str, work: Path, sha: str) -> None:
    work.mkdir(parents=True)
    done = subprocess.run([sys.executable, "-m", "diskkit", "build", url, "--checksum", f"sha256:{sha}", "-t", f"oci:{work / 'layout'}:b"],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"diskkit build failed: {done.stderr.strip()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mb", type=int, default=512)
    parser.add_argument("--kind", choices=sorted(TOOLS), default="gzip")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="diskkit-bench-upstream-", dir=args.workdir))
    try:
        site = root / "site"
        site.mkdir()
        disk = site / "disk.img"
        make_disk(disk, args.size_mb)
        subprocess.run([*TOOLS[args.kind], str(disk)], check=True)
        packed = site / ("disk.img" + SUFFIX[args.kind])
        sha = subprocess.run(["sha256sum", str(packed)], check=True, capture_output=True, text=True).stdout.split()[0]
        httpd = serve(site)
        url = f"http://127.0.0.1:{httpd.server_address[1]}/{packed.name}"
        times: dict[str, list[float]] = {"no-file": [], "stream": [], "serial": [], "two-pass": [], "build": []}
        for run in range(args.runs):
            for name, fn in (("no-file", no_file), ("stream", stream), ("serial", serial), ("two-pass", two_pass), ("build", build)):
                work = root / f"{name}-{run}"
                subprocess.run(["sync"], check=True)
                start = time.perf_counter()
                fn(url, work, sha)
                times[name].append(time.perf_counter() - start)
                shutil.rmtree(work, ignore_errors=True)
        httpd.shutdown()
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"{args.size_mb} MiB raw disk, {packed.stat().st_size >> 20} MiB {args.kind}; {args.runs} runs; load {load}")
        for name, values in times.items():
            print(f"  {name:9s} median {statistics.median(values):6.2f} s  best {min(values):6.2f} s")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

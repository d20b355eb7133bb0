"""Helpers for the lazy-pull tests: a `launcher serve` process, its control socket, padded guests.

The disk server runs as a real process (as root or as the qemu user), on a cache of the test's
own; tests ask it what it holds through the same control socket `launcher run` uses.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
import zlib
from pathlib import Path
from typing import Iterator

import requests

from launcher.diskserver.control import request
from tests.conftest import launcher_command, run, run_diskkit
from tests.procs import terminate

QEMU_UID = 107


def control(cache: Path, obj: dict, timeout: float = 120) -> dict:
    return request(cache / "serve" / "control.sock", obj, timeout)


def open_export(cache: Path, ref: str, path: str | None = None) -> dict:
    answer = control(cache, {"op": "open", "image": ref, "path": path, "registry": {"tls_verify": False, "retries": 8, "backoff": 0.2}})
    assert answer.get("ok"), answer
    return answer


def build_lazy_image(disk: Path, ref: str) -> str:
    """`disk` built as a lazy image and pushed to `ref` (a loopback registry over plain HTTP)."""
    result = run_diskkit("build", "--tls-verify=false", "--lazy", disk, "-t", ref)
    assert result.code == 0, result.err
    return ref


def image_toc(registry, ref: str) -> dict:
    """A lazy image's TOC as a plain HTTP client reads it: manifest, layer annotations, range GET (inflated for v2)."""
    repository, tag = ref.split("/", 1)[1].rsplit(":", 1)
    manifest = requests.get(registry.url(f"/v2/{repository}/manifests/{tag}"), timeout=60,
                            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}).json()
    layer = manifest["layers"][0]
    notes = layer["annotations"]
    start = int(notes["io.diskkit.lazy.toc.offset"])
    end = start + int(notes["io.diskkit.lazy.toc.size"]) - 1
    data = requests.get(registry.url(f"/v2/{repository}/blobs/{layer['digest']}"), headers={"Range": f"bytes={start}-{end}"}, timeout=60).content
    return json.loads(zlib.decompress(data, 31) if layer["mediaType"].endswith("+gzip") else data)


def first_chunk_at(registry, ref: str) -> int:
    """Where the disk's first chunk starts in the blob: its gzip member (v2) or its first byte (v1)."""
    toc = image_toc(registry, ref)
    return toc["members"][0][0] if "members" in toc else toc["offset"]


def fetched_ahead(layer: dict, toc: dict) -> list[tuple[int, int]]:
    """The blob ranges of the disk's members an open fetches beside the TOC, whatever the node holds
    (launcher.diskserver.firstbytes: the blob's head, the TOC's tail), cut to the members."""
    from launcher.diskserver.firstbytes import HEAD_AHEAD, MAX_TAIL, TAIL_AHEAD

    size, toc_at = layer["size"], int(layer["annotations"]["io.diskkit.lazy.toc.offset"])
    start, end = toc["members"][0][0], sum(toc["members"][-1])
    tail_at = max(0, toc_at - TAIL_AHEAD)
    tail = size - toc_at <= MAX_TAIL
    pieces = [(start, min(HEAD_AHEAD, tail_at if tail else size, end))] + ([(max(tail_at, start), end)] if tail else [])
    return [(lo, hi) for lo, hi in pieces if lo < hi]


def outside(pieces: list[tuple[int, int]], lo: int, hi: int) -> int:
    """The bytes of [lo, hi) none of `pieces` holds."""
    return hi - lo - sum(max(0, min(hi, b) - max(lo, a)) for a, b in pieces)


def export_status(cache: Path, name: str) -> dict:
    for export in control(cache, {"op": "status"})["exports"]:
        if export["export"] == name:
            return export
    raise AssertionError(f"no export {name}")


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval)


@contextlib.contextmanager
def disk_server(cache: Path, *args: str, user: int | None = None, env: dict | None = None) -> Iterator[subprocess.Popen]:
    """`launcher serve --cache-dir CACHE ARGS` (--tls-verify=false unless ARGS say), ready when its
    control socket answers; SIGTERM after."""
    log = open(cache.parent / f"serve-{cache.name}.log", "ab")
    tls = [] if any(str(a).startswith("--tls-verify") for a in args) else ["--tls-verify=false"]
    command = launcher_command("serve", "--cache-dir", cache, *tls, *args, user=str(user) if user is not None else None)
    proc = subprocess.Popen(command, stdout=log, stderr=log, env={**os.environ, "CI": "true", **(env or {})})
    try:
        def ready():
            assert proc.poll() is None, (cache.parent / f"serve-{cache.name}.log").read_text()
            with contextlib.suppress(OSError, ValueError):
                return control(cache, {"op": "status"}, timeout=5).get("ok")
        wait_for(ready, 30, "the disk server to answer")
        yield proc
    finally:
        terminate(proc)
        log.close()


def stop_spawned_server(cache: Path) -> None:
    """The server `launcher run` started (detached) for a cache: SIGTERM it by the pid it reports."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        pid = control(cache, {"op": "status"}, timeout=5)["pid"]
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: not (cache / "serve" / "control.sock").exists(), 30, "the spawned server to exit")


def padded_guest(guest_qcow2: Path, out: Path, size: int, seed: int = 1) -> Path:
    """The test guest as a raw disk of `size` bytes: its 64 MiB, then pseudo-random data to the end.

    Random, so the padding is real data every byte of which has to travel (zeros would be no test
    of anything); seeded, so the same size always gives the same image."""
    if out.exists() and out.stat().st_size == size:
        return out
    tmp = out.with_name(out.name + ".tmp")
    run("qemu-img", "convert", "-f", "qcow2", "-O", "raw", guest_qcow2, tmp)
    assert size >= tmp.stat().st_size
    _append_random(tmp, size, seed)
    tmp.replace(out)
    return out


def random_disk(out: Path, size: int, seed: int = 2) -> Path:
    """A raw disk of pseudo-random bytes: no chunk is zero, every one has to be fetched and checked."""
    out.write_bytes(b"")
    _append_random(out, size, seed)
    return out


def _append_random(path: Path, size: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "ab") as f:
        left = size - f.tell()
        while left > 0:
            n = min(left, 4 << 20)
            f.write(rng.randbytes(n))
            left -= n

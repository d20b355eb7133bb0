"""Interrupted pulls: a `launcher pull` killed with SIGKILL half way through a layer resumes from the
bytes it had synced, with one range request for the rest; what killed pulls leave behind is taken
by the next pull or by `launcher gc`, and what a `diskkit push` to a layout killed half way leaves
by the next push there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from diskkit.registry.partial import KEEP_AFTER
from tests.conftest import launcher_command, run, run_diskkit, run_launcher
from tests.faultproxy import Fault
from tests.lazyhost import random_disk, wait_for

NOREG = "--tls-verify=false"
MIB = 1 << 20


@pytest.fixture(scope="module")
def big_image(registry, tmp_path_factory) -> tuple[str, Path, str, int]:
    """48 MiB of random bytes (a layer that compression cannot shrink), its layer digest and size."""
    disk = random_disk(tmp_path_factory.mktemp("resume") / "big.img", 48 * MIB, seed=5)
    ref = f"{registry.host}/resume/big:v1"
    result = run_diskkit("build", NOREG, disk, "-t", ref)
    assert result.code == 0, result.err
    manifest = json.loads(run("skopeo", "inspect", "--raw", NOREG, f"docker://{ref}").stdout)
    (layer,) = manifest["layers"]
    return ref, disk, layer["digest"], layer["size"]


def killed_half_way(cache: Path, proxy, ref: str, layer: str, size: int) -> tuple[int, int]:
    """A pull whose layer download stops a while at a quarter (so it keeps what follows, partial.KEEP_AFTER)
    and breaks at half, killed with SIGKILL while it waits to retry; the kept bytes' start and end."""
    half = size // 2
    # The whole layer's GET (a lazy layer's TOC is read first, with a range).
    proxy.add(Fault("GET", f"/blobs/{layer}", "truncate", times=1, arg=half, header=("Range", None), hold=(size // 4, KEEP_AFTER + 0.5)))
    proc = subprocess.Popen(launcher_command("pull", "--cache-dir", cache, NOREG, "--retry-times", "3", "--retry-delay", "60", ref),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "CI": "true"})
    synced = cache / "partial" / f"{layer.replace(':', '-')}.synced"
    try:
        def resume_point():
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                return int(synced.read_text().split()[1]) >= half - MIB
            except (OSError, ValueError, IndexError):
                return False
        wait_for(resume_point, 120, "the pull to keep half of the layer")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    start, end = map(int, synced.read_text().split())
    return start, end


def layer_gets(proxy, layer: str) -> int:
    return sum(1 for method, path, _ in proxy.log if method == "GET" and path.startswith("/v2/") and path.endswith(f"/blobs/{layer}"))


def test_a_killed_pull_resumes_from_its_synced_bytes(tmp_path, registry, fault_proxy, big_image):
    ref, disk, layer, size = big_image
    proxy = fault_proxy(registry)
    via = ref.replace(registry.host, proxy.host)
    cache = tmp_path / "cache"
    start, kept = killed_half_way(cache, proxy, via, layer, size)
    assert size // 4 - MIB <= start <= size // 4 and size // 2 - MIB <= kept <= size // 2
    assert len(list((cache / "tmp").iterdir())) == 1  # the killed pull's staging directory

    # The next pull asks only for what it did not keep: the bytes before the kept ones, then the rest.
    head = Fault("GET", f"/blobs/{layer}", "stall", times=1, arg=0, header=("Range", f"^bytes=0-{start - 1}$"))
    rest = Fault("GET", f"/blobs/{layer}", "stall", times=1, arg=0, header=("Range", f"^bytes={kept}-$"))
    proxy.add(head)
    proxy.add(rest)
    before = layer_gets(proxy, layer)
    pulled = run_launcher("pull", "--cache-dir", cache, NOREG, "--json", via)
    assert pulled.code == 0, pulled.err
    assert not proxy.pending and layer_gets(proxy, layer) - before == 3  # the lazy TOC's range, the head, the rest
    assert Path(json.loads(pulled.out)["path"]).read_bytes() == disk.read_bytes()
    # Nothing is left behind: the partial layer went with its use, the dead staging with this pull.
    assert list((cache / "partial").iterdir()) == [] and list((cache / "tmp").iterdir()) == []


def test_a_killed_pull_resumes_right_from_a_registry_that_ignores_range(tmp_path, registry, fault_proxy, big_image):
    """The head before the kept bytes and the rest after them each come as the whole blob (HTTP 200):
    the first is read up to the kept bytes, the second past them, and the disk is the pushed one."""
    ref, disk, layer, size = big_image
    proxy = fault_proxy(registry)
    via = ref.replace(registry.host, proxy.host)
    cache = tmp_path / "cache"
    start, _ = killed_half_way(cache, proxy, via, layer, size)
    assert start > 0
    proxy.ignore_range = True
    before = len(proxy.log)
    pulled = run_launcher("pull", "--cache-dir", cache, NOREG, "--json", via)
    assert pulled.code == 0, pulled.err
    assert Path(json.loads(pulled.out)["path"]).read_bytes() == disk.read_bytes()
    gets = [status for method, path, status in proxy.log[before:] if method == "GET" and path.endswith(f"/blobs/{layer}")]
    # The TOC's range answered whole (so the layer is read in one stream), the head, the rest: a resume
    # that read a byte from the wrong place would fail the digest and start once more from byte 0.
    assert gets == [200, 200, 200], gets
    assert list((cache / "partial").iterdir()) == []


def test_gc_takes_what_killed_pulls_left(tmp_path, registry, fault_proxy, big_image):
    ref, _, layer, size = big_image
    proxy = fault_proxy(registry)
    cache = tmp_path / "cache"
    killed_half_way(cache, proxy, ref.replace(registry.host, proxy.host), layer, size)
    part = cache / "partial" / f"{layer.replace(':', '-')}.part"
    assert part.stat().st_size >= size // 2 - MIB
    collected = run_launcher("gc", "--cache-dir", cache, "--json")
    assert collected.code == 0, collected.err
    assert str(part) in json.loads(collected.out)["removed"]
    assert list((cache / "partial").iterdir()) == [] and list((cache / "tmp").iterdir()) == []


def test_a_layer_that_failed_its_digest_is_not_resumed_from(tmp_path, registry, fault_proxy, big_image):
    ref, disk, layer, size = big_image
    proxy = fault_proxy(registry)
    via = ref.replace(registry.host, proxy.host)
    cache = tmp_path / "cache"
    proxy.add(Fault("GET", f"/blobs/{layer}", "flip", times=1, arg=size - 100, header=("Range", None)))
    refused = run_launcher("pull", "--cache-dir", cache, NOREG, via)
    assert refused.code != 0 and "digest" in refused.err, refused.err
    assert list((cache / "partial").iterdir()) == []  # its bytes are not offered to the next pull
    pulled = run_launcher("pull", "--cache-dir", cache, NOREG, "--json", via)
    assert pulled.code == 0, pulled.err
    assert Path(json.loads(pulled.out)["path"]).read_bytes() == disk.read_bytes()


def push_killed_half_way(proxy, ref: str, dest: str, layer: str, size: int, leftover) -> None:
    """`diskkit push` whose layer download breaks at half, killed with SIGKILL while it waits to retry."""
    proxy.add(Fault("GET", f"/blobs/{layer}", "truncate", times=1, arg=size // 2))
    proc = subprocess.Popen([sys.executable, "-m", "diskkit", "push", NOREG, "--retry-delay", "60", f"docker://{ref}", dest],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, "CI": "true"})
    try:
        def half_written():
            assert proc.poll() is None, proc.stderr.read().decode()
            return any(p.stat().st_size >= size // 2 - MIB for p in leftover())
        wait_for(half_written, 120, "the push to write half of the layer")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_a_push_to_a_layout_killed_half_way_leaves_nothing_after_the_next(tmp_path, registry, fault_proxy, big_image):
    ref, _, layer, size = big_image
    proxy = fault_proxy(registry)
    via = ref.replace(registry.host, proxy.host)
    layout = tmp_path / "layout"
    staged = lambda: list(tmp_path.glob(".layout.diskkit-*/blobs/sha256/.tmp-*"))  # noqa: E731
    push_killed_half_way(proxy, via, f"oci:{layout}:v1", layer, size, staged)
    assert len(list(tmp_path.glob(".layout.diskkit-*"))) == 1
    assert run_diskkit("push", NOREG, f"docker://{via}", f"oci:{layout}:v1").code == 0
    assert list(tmp_path.glob(".layout.*")) == []  # the dead push's staging directory is gone

    # Into the layout that now exists: a killed push leaves a temporary blob there, the next takes it.
    layout_tmp = lambda: list((layout / "blobs" / "sha256").glob(".tmp-*"))  # noqa: E731
    (layout / "blobs" / "sha256" / layer.removeprefix("sha256:")).unlink()  # so that it is written again
    push_killed_half_way(proxy, via, f"oci:{layout}:v2", layer, size, layout_tmp)
    assert len(layout_tmp()) == 1
    assert run_diskkit("push", NOREG, f"docker://{via}", f"oci:{layout}:v2").code == 0
    assert layout_tmp() == []
    assert run_diskkit("verify", f"oci:{layout}:v2").code == 0

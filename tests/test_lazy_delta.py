"""Lazy boots of an updated image cost its change (issue 31): with v1's disk in the node cache (a
complete lazy export, installed and recorded in the node's chunk index), the disk server serves
v2 from the chunks the node holds and fetches only the rest from the registry, counted at a proxy
in front of it. A reused chunk is hashed after it is read (a corrupted cached disk gives nothing),
and the finished export is checked end to end by the config's diffID before it is installed."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from diskkit.layers import lazytoc
from launcher.chunks.index import ChunkIndex
from tests.conftest import run, run_diskkit, run_launcher
from tests.lazyhost import build_lazy_image, disk_server, export_status, image_toc, open_export, random_disk, wait_for
from tests.test_lazygz import forged

MIB = 1 << 20
CHUNKS = 24
CHANGED = {3, 4, 10, 11}  # two aligned MiB, and 100 KiB written across the boundary of chunks 10 and 11
NOREG = "--tls-verify=false"


@pytest.fixture(scope="module")
def disks(tmp_path_factory) -> tuple[Path, Path]:
    top = tmp_path_factory.mktemp("lazydelta")
    v1 = random_disk(top / "v1.img", CHUNKS * MIB, seed=31)
    v2 = top / "v2.img"
    shutil.copyfile(v1, v2)
    with open(v2, "r+b") as f:
        f.seek(3 * MIB)
        f.write(random.Random(32).randbytes(2 * MIB))
        f.seek(11 * MIB - 50 * 1024)
        f.write(b"\x5a" * (100 * 1024))
    return v1, v2


@pytest.fixture(scope="module")
def images(registry, disks) -> tuple[str, str]:
    v1, v2 = disks
    return (build_lazy_image(v1, f"{registry.host}/lazydelta/guest:v1"),
            build_lazy_image(v2, f"{registry.host}/lazydelta/guest:v2"))


def layer_of(ref: str) -> dict:
    return json.loads(run_diskkit("inspect", NOREG, "--json", ref).out)["layers"][0]


def filled(cache: Path, ref: str) -> dict:
    answer = open_export(cache, ref)
    return wait_for(lambda: (s := export_status(cache, answer["export"]))["installed"] and s, 120, f"{ref} to be installed")


def test_v2_is_filled_from_v1s_chunks_and_fetches_only_the_changed_ones(tmp_path, registry, fault_proxy, images, disks):
    v1_ref, v2_ref = images
    toc = image_toc(registry, v2_ref)
    assert len(toc[lazytoc.CONTENT_FIELD]) == CHUNKS
    layer = layer_of(v2_ref)
    proxy = fault_proxy(registry)
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        first = filled(cache, v1_ref)
        assert first["stats"]["reused_chunks"] == 0  # nothing to reuse yet
        status = filled(cache, v2_ref.replace(registry.host, proxy.host))
        shown = run_launcher("serve", "--status", "--cache-dir", cache)
    assert status["verified"] and not status["failed"] and status["stats"]["corrupt_chunks"] == 0, status
    assert Path(status["installed"]).read_bytes() == disks[1].read_bytes()
    changed = sum(toc["members"][i][1] for i in CHANGED)
    assert status["stats"]["fetched_chunks"] == len(CHANGED) and status["stats"]["fetched_bytes"] == changed, status
    assert status["stats"]["reused_chunks"] == CHUNKS - len(CHANGED) and status["stats"]["reused_bytes"] == (CHUNKS - len(CHANGED)) * MIB
    # What a pull with v1 cached needs of the blob: the changed chunks' members, and the bytes around
    # the chunks (the tar headers, the TOC). The registry sent just that, counted at the proxy: the TOC
    # once, read with the tail that holds it.
    around = layer["size"] - sum(length for _, length in toc["members"])
    sent = sum(n for path, n in proxy.sent.items() if f"/blobs/{layer['digest']}" in path)
    assert sent == changed + around, (sent, changed, around)
    assert shown.code == 0, shown.err
    assert f"fetched {changed} bytes, reused {(CHUNKS - len(CHANGED)) * MIB} bytes" in shown.out, shown.out
    # The complete v2 is recorded in the node's chunk index: its new chunks are there for the next image.
    places = ChunkIndex(SimpleNamespace(root=cache)).lookup("blake3", toc[lazytoc.CONTENT_FIELD][3])
    assert [str(cache / p.path) for p in places] == [status["installed"]] and places[0].offset == 3 * MIB


def test_an_export_asks_the_registry_for_its_toc_once(tmp_path, registry, fault_proxy, images, disks):
    """The TOC lies in the blob's tail: the disk server reads it to find the disk and keeps the tail for
    the blob digest, one range request over the TOC's bytes for both (launcher/diskserver/imagewalk.py)."""
    layer = layer_of(images[1])
    toc_at = int(layer["annotations"][lazytoc.ANNOTATION_TOC_OFFSET])
    toc_end = toc_at + int(layer["annotations"][lazytoc.ANNOTATION_TOC_SIZE])
    proxy = fault_proxy(registry)
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        status = filled(cache, images[1].replace(registry.host, proxy.host))
    assert status["verified"] and Path(status["installed"]).read_bytes() == disks[1].read_bytes()
    asked = [value for path, value in proxy.ranges if f"/blobs/{layer['digest']}" in path]
    spans = [tuple(map(int, value.removeprefix("bytes=").split("-"))) for value in asked]
    over_toc = [(first, last) for first, last in spans if first < toc_end and last >= toc_at]
    assert len(over_toc) == 1, (toc_at, toc_end, spans)


def test_a_corrupted_cached_chunk_is_fetched_instead(tmp_path, registry, images, disks):
    """A byte flipped in v1's installed disk (chunk 7, unchanged in v2): the reused chunk's hash
    says so, and it is fetched; v2 still comes out right and verified by its diffID."""
    v1_ref, v2_ref = images
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        first = filled(cache, v1_ref)
        with open(first["installed"], "r+b") as f:
            f.seek(7 * MIB + 12345)
            byte = f.read(1)
            f.seek(7 * MIB + 12345)
            f.write(bytes([byte[0] ^ 1]))
        status = filled(cache, v2_ref)
    assert status["verified"] and not status["failed"], status
    assert Path(status["installed"]).read_bytes() == disks[1].read_bytes()
    assert status["stats"]["fetched_chunks"] == len(CHANGED) + 1 and status["stats"]["reused_chunks"] == CHUNKS - len(CHANGED) - 1, status


def test_reused_chunks_are_checked_end_to_end_by_the_diffid(tmp_path, registry, images, disks):
    """A TOC that names chunk 5 by chunk 6's content (every pin re-made up to the manifest: a
    consistent lie) gets v1's chunk 6 from the node as chunk 5. Each chunk matched the TOC, but the
    disk does not unpack to the config's diffID: the export fails and nothing is installed."""
    v1_ref, _ = images
    layout = tmp_path / "layout"
    assert run_diskkit("build", "--lazy", disks[1], "-t", f"oci:{layout}:v2").code == 0

    def liar(toc, data):
        toc[lazytoc.CONTENT_FIELD][5] = toc[lazytoc.CONTENT_FIELD][6]

    ref = f"{registry.host}/lazydelta/liar:v2"
    assert run_diskkit("push", NOREG, f"oci:{forged(tmp_path, layout, 'liar', liar)}:v2", ref).code == 0
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        filled(cache, v1_ref)
        answer = open_export(cache, ref)
        status = wait_for(lambda: (s := export_status(cache, answer["export"]))["failed"] and s, 120, "the diffID check")
    assert "not the config's diffID" in status["failed"] and not status["installed"] and not status["verified"], status
    assert status["stats"]["reused_chunks"] == CHUNKS - len(CHANGED) and status["stats"]["corrupt_chunks"] == 0, status
    assert not list((cache / "disks").glob(f"sha256/{answer['layer'][7:]}/*/disk.img"))


def test_a_restarted_server_resumes_and_still_checks_reused_chunks(tmp_path, registry, images, disks):
    """The chunks taken from the node are recorded with the bitmap: a server stopped half way and
    started again knows the members it lacks, and checks the finished disk by the diffID, not by a
    blob digest those holes would fail."""
    v1_ref, v2_ref = images
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        filled(cache, v1_ref)
    with disk_server(cache, "--prefetch-rate", "1K"):  # no prefetching: only what is read arrives
        answer = open_export(cache, v2_ref)
        # All but chunks 10 and 11: every chunk the node gives is taken in this run, none in the next.
        run("qemu-io", "-r", "-f", "raw", "-c", f"read 0 {10 * MIB}", "-c", f"read {12 * MIB} {12 * MIB}", answer["url"])
        half = export_status(cache, answer["export"])
    assert half["present"] == 22 and half["stats"]["reused_chunks"] == CHUNKS - len(CHANGED) and half["stats"]["fetched_chunks"] == 2, half
    with disk_server(cache):
        status = filled(cache, v2_ref)
    assert status["verified"] and not status["failed"] and status["stats"]["verify_attempts"] == 1, status
    assert status["stats"]["reused_chunks"] == CHUNKS - len(CHANGED) and status["stats"]["fetched_chunks"] == len(CHANGED), status
    assert Path(status["installed"]).read_bytes() == disks[1].read_bytes()


def test_with_v1_pulled_the_fill_of_v2_fetches_what_its_pull_fetches(tmp_path, registry, fault_proxy, images, disks):
    """v1 pulled (launcher pull records its chunks), then v2 lazily exported and filled; beside it, on
    another cache with v1 pulled, v2 pulled. The registry sends both the same bytes of v2's layer,
    counted at proxies, but for the TOC: the export reads it once, with the tail; the pull reads it
    alone to plan, then again with the tail (launcher/node/deltapull.py)."""
    v1_ref, v2_ref = images
    layer = layer_of(v2_ref)

    def layer_bytes(proxy) -> int:
        return sum(n for path, n in proxy.sent.items() if f"/blobs/{layer['digest']}" in path)

    lazy, pulled = tmp_path / "lazy", tmp_path / "pulled"
    for cache in (lazy, pulled):
        cache.mkdir()
        assert run_launcher("pull", "--cache-dir", cache, NOREG, v1_ref).code == 0
    by_export, by_pull = fault_proxy(registry), fault_proxy(registry)
    with disk_server(lazy):
        status = filled(lazy, v2_ref.replace(registry.host, by_export.host))
    assert status["verified"] and Path(status["installed"]).read_bytes() == disks[1].read_bytes(), status
    assert status["stats"]["fetched_chunks"] == len(CHANGED) and status["stats"]["reused_chunks"] == CHUNKS - len(CHANGED), status
    second = run_launcher("pull", "--cache-dir", pulled, NOREG, "--json", v2_ref.replace(registry.host, by_pull.host))
    assert second.code == 0, second.err
    toc_member = int(layer["annotations"][lazytoc.ANNOTATION_TOC_SIZE])
    assert layer_bytes(by_export) + toc_member == layer_bytes(by_pull), (layer_bytes(by_export), layer_bytes(by_pull), toc_member)
    assert json.loads(second.out)["fetched"] <= layer_bytes(by_pull)

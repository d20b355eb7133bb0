"""Lazy boots of an updated image cost its change (issue 31): with v1's disk in the node cache (a
complete lazy export, installed and recorded in the node's chunk index), the disk server serves
v2 from the chunks the node holds and fetches only the rest from the registry, counted at a proxy
in front of it. A reused chunk is hashed after it is read (a corrupted cached disk gives nothing),
and the finished export is checked end to end by the config's diffID before it is installed. The
chunks are cut where their content says (TOC v3): which of v2's are new is what its TOC names that
v1's does not, and a qcow2 rebuilt with `qemu-img convert -c` fetches about its change too."""

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
from tests.lazyhost import build_lazy_image, disk_server, export_status, fetched_ahead, image_toc, open_export, outside, random_disk, wait_for
from tests.test_chunk_index import rebuilt_qcow2_pair
from tests.test_lazygz import chunk_ranges, forged

MIB = 1 << 20
SIZE = 24 * MIB  # two MiB written at 3 MiB, and 100 KiB at 11 MiB - 50 KiB
NOREG = "--tls-verify=false"


@pytest.fixture(scope="module")
def disks(tmp_path_factory) -> tuple[Path, Path]:
    top = tmp_path_factory.mktemp("lazydelta")
    v1 = random_disk(top / "v1.img", SIZE, seed=31)
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


@pytest.fixture(scope="module")
def toc(registry, images) -> dict:
    """v2's TOC, with "changed": the chunks whose content v1's TOC names nowhere (all others the node holds once v1 is here)."""
    old = set(image_toc(registry, images[0])[lazytoc.CONTENT_FIELD])
    new = image_toc(registry, images[1])
    new["changed"] = {i for i, h in enumerate(new[lazytoc.CONTENT_FIELD]) if h not in old}
    new["ranges"] = chunk_ranges(new)
    assert new["version"] == 3 and 2 < len(new["changed"]) < 30 and len(new["ranges"]) > 3 * len(new["changed"])
    return new


def reused_bytes(toc: dict) -> int:
    return SIZE - sum(end - start for i, (start, end) in enumerate(toc["ranges"]) if i in toc["changed"])


def fetched_for(layer: dict, toc: dict, changed) -> int:
    """What an export fetches of the blob's members: the changed chunks', and what its open asked for
    beside the TOC before it knew which chunks the node holds (fetched_ahead: at most 192 KiB)."""
    ahead = fetched_ahead(layer, toc)
    return sum(outside(ahead, at, at + length) for i, (at, length) in enumerate(toc["members"]) if i in changed) + sum(hi - lo for lo, hi in ahead)


def layer_of(ref: str) -> dict:
    return json.loads(run_diskkit("inspect", NOREG, "--json", ref).out)["layers"][0]


def filled(cache: Path, ref: str) -> dict:
    answer = open_export(cache, ref)
    return wait_for(lambda: (s := export_status(cache, answer["export"]))["installed"] and s, 120, f"{ref} to be installed")


def test_v2_is_filled_from_v1s_chunks_and_fetches_only_the_changed_ones(tmp_path, registry, fault_proxy, images, disks, toc):
    v1_ref, v2_ref = images
    count, changed = len(toc["ranges"]), toc["changed"]
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
    fetched = fetched_for(layer, toc, changed)
    assert status["stats"]["fetched_chunks"] == len(changed) and status["stats"]["fetched_bytes"] == fetched, status
    assert status["stats"]["reused_chunks"] == count - len(changed) and status["stats"]["reused_bytes"] == reused_bytes(toc)
    # What a pull with v1 cached needs of the blob: the changed chunks' members, and the bytes around
    # the chunks (the tar headers, the TOC), with what the open asked for ahead. The registry sent
    # just that, counted at the proxy: no byte twice, the TOC once, read with the tail that holds it.
    around = layer["size"] - sum(length for _, length in toc["members"])
    sent = sum(n for path, n in proxy.sent.items() if f"/blobs/{layer['digest']}" in path)
    assert sent == fetched + around, (sent, fetched, around)
    assert shown.code == 0, shown.err
    assert f"fetched {fetched} bytes, reused {reused_bytes(toc)} bytes" in shown.out, shown.out
    # The complete v2 is recorded in the node's chunk index: its new chunks are there for the next image.
    first_new = min(changed)
    places = ChunkIndex(SimpleNamespace(root=cache)).lookup("blake3", toc[lazytoc.CONTENT_FIELD][first_new])
    assert [str(cache / p.path) for p in places] == [status["installed"]] and places[0].offset == toc["ranges"][first_new][0]


def test_a_rebuilt_qcow2_is_filled_from_the_chunks_that_moved(tmp_path, registry, fault_proxy):
    """v2 rebuilt as `qemu-img convert -c -O qcow2` makes it (1 MiB of the guest changed, every
    compressed cluster after it at another offset of the file): the export of v2 takes what moved
    from v1's disk and fetches about the change, checked by the diffID as ever."""
    v1, v2 = rebuilt_qcow2_pair(tmp_path)
    v1_ref = build_lazy_image(v1, f"{registry.host}/lazydelta/rebuilt:v1")
    v2_ref = build_lazy_image(v2, f"{registry.host}/lazydelta/rebuilt:v2")
    old = set(image_toc(registry, v1_ref)[lazytoc.CONTENT_FIELD])
    new = image_toc(registry, v2_ref)
    changed = [i for i, h in enumerate(new[lazytoc.CONTENT_FIELD]) if h not in old]
    proxy = fault_proxy(registry)
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        filled(cache, v1_ref)
        status = filled(cache, v2_ref.replace(registry.host, proxy.host))
    assert status["verified"] and not status["failed"] and Path(status["installed"]).read_bytes() == v2.read_bytes(), status
    layer = layer_of(v2_ref)
    fetched = fetched_for(layer, new, changed)
    assert status["stats"]["fetched_chunks"] == len(changed) and status["stats"]["fetched_bytes"] == fetched, status
    assert fetched < 2 * MIB < layer["size"] // 5 and status["stats"]["reused_bytes"] > v2.stat().st_size - 2 * MIB, status


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


def test_a_corrupted_cached_chunk_is_fetched_instead(tmp_path, registry, images, disks, toc):
    """A byte flipped in v1's installed disk (at 7 MiB, in a chunk v2 has too): the reused chunk's
    hash says so, and it is fetched; v2 still comes out right and verified by its diffID."""
    v1_ref, v2_ref = images
    flipped = next(i for i, (start, end) in enumerate(toc["ranges"]) if start <= 7 * MIB + 12345 < end)
    assert flipped not in toc["changed"]
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
    count, changed = len(toc["ranges"]), len(toc["changed"])
    assert status["stats"]["fetched_chunks"] == changed + 1 and status["stats"]["reused_chunks"] == count - changed - 1, status


def test_reused_chunks_are_checked_end_to_end_by_the_diffid(tmp_path, registry, images, disks, toc):
    """A TOC that swaps two neighbouring unchanged chunks (their lengths and content hashes; every
    pin re-made up to the manifest: a consistent lie) gets each from the node in the other's place.
    Each chunk matched the TOC, but the disk does not unpack to the config's diffID: the export fails
    and nothing is installed."""
    v1_ref, _ = images
    pair = next(i for i in range(len(toc["ranges"]) - 1) if not {i, i + 1} & toc["changed"]
                and toc[lazytoc.LENGTHS_FIELD][i] != toc[lazytoc.LENGTHS_FIELD][i + 1])
    layout = tmp_path / "layout"
    assert run_diskkit("build", "--lazy", disks[1], "-t", f"oci:{layout}:v2").code == 0

    def liar(lied, data):
        for field in (lazytoc.LENGTHS_FIELD, lazytoc.CONTENT_FIELD):
            lied[field][pair], lied[field][pair + 1] = lied[field][pair + 1], lied[field][pair]

    ref = f"{registry.host}/lazydelta/liar:v2"
    assert run_diskkit("push", NOREG, f"oci:{forged(tmp_path, layout, 'liar', liar)}:v2", ref).code == 0
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        filled(cache, v1_ref)
        answer = open_export(cache, ref)
        status = wait_for(lambda: (s := export_status(cache, answer["export"]))["failed"] and s, 120, "the diffID check")
    assert "not the config's diffID" in status["failed"] and not status["installed"] and not status["verified"], status
    assert status["stats"]["reused_chunks"] == len(toc["ranges"]) - len(toc["changed"]) and status["stats"]["corrupt_chunks"] == 0, status
    assert not list((cache / "disks").glob(f"sha256/{answer['layer'][7:]}/*/disk.img"))


def test_a_restarted_server_resumes_and_still_checks_reused_chunks(tmp_path, registry, images, disks, toc):
    """The chunks taken from the node are recorded with the bitmap: a server stopped half way and
    started again knows the members it lacks, and checks the finished disk by the diffID, not by a
    blob digest those holes would fail."""
    v1_ref, v2_ref = images
    count, changed = len(toc["ranges"]), toc["changed"]
    # The chunks over the 100 KiB written at 11 MiB are left for the next run; every chunk the node gives is taken in this one.
    later = [i for i, (start, end) in enumerate(toc["ranges"]) if start < 11 * MIB + 50 * 1024 and end > 11 * MIB - 50 * 1024]
    assert set(later) <= changed and later == list(range(later[0], later[-1] + 1))
    low, high = toc["ranges"][later[0]][0] // 512 * 512, -(-toc["ranges"][later[-1]][1] // 512) * 512  # reads stay clear of them
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        filled(cache, v1_ref)
    with disk_server(cache, "--prefetch-rate", "1K"):  # no prefetching: only what is read arrives
        answer = open_export(cache, v2_ref)
        run("qemu-io", "-r", "-f", "raw", "-c", f"read 0 {low}", "-c", f"read {high} {SIZE - high}", answer["url"])
        half = export_status(cache, answer["export"])
    assert half["present"] == count - len(later) and half["stats"]["reused_chunks"] == count - len(changed), half
    assert half["stats"]["fetched_chunks"] == len(changed) - len(later), half
    with disk_server(cache):
        status = filled(cache, v2_ref)
    assert status["verified"] and not status["failed"] and status["stats"]["verify_attempts"] == 1, status
    assert status["stats"]["reused_chunks"] == count - len(changed) and status["stats"]["fetched_chunks"] == len(changed), status
    assert Path(status["installed"]).read_bytes() == disks[1].read_bytes()


def test_with_v1_pulled_the_fill_of_v2_fetches_what_its_pull_fetches(tmp_path, registry, fault_proxy, images, disks, toc):
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
    count, changed = len(toc["ranges"]), len(toc["changed"])
    assert status["stats"]["fetched_chunks"] == changed and status["stats"]["reused_chunks"] == count - changed, status
    second = run_launcher("pull", "--cache-dir", pulled, NOREG, "--json", v2_ref.replace(registry.host, by_pull.host))
    assert second.code == 0, second.err
    toc_member = int(layer["annotations"][lazytoc.ANNOTATION_TOC_SIZE])
    # ... and for what the export's open asked for ahead, before it knew which chunks the node holds.
    ahead = fetched_ahead(layer, toc)
    unused = sum(hi - lo for lo, hi in ahead) - sum(length - outside(ahead, at, at + length) for i, (at, length) in enumerate(toc["members"]) if i in toc["changed"])
    assert layer_bytes(by_export) + toc_member == layer_bytes(by_pull) + unused, (layer_bytes(by_export), layer_bytes(by_pull), toc_member, unused)
    assert json.loads(second.out)["fetched"] <= layer_bytes(by_pull)

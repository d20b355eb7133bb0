"""The node's link is one link (launcher.diskserver.firstbytes, linkshare, registrychunks): what an open
asks for before a guest's first disk byte goes out beside the config, no byte of the blob travels
twice, a guest's read shares the link with one prefetch request at most, and a reader gets its chunk
once that chunk's bytes arrived, not the whole prefetched run. Real registry, real server, qemu-io as
the guest; a fault proxy (tests/faultproxy.py) in front of the registry logs the order of requests
and answers, and models a slow link where prefetch must still be running when the guest reads.
Orders of events are asserted, never times."""

from __future__ import annotations

import json
import random
import subprocess
import threading
from pathlib import Path

import pytest
import requests

from diskkit.layers import lazytoc
from launcher.diskserver.firstbytes import HEAD_AHEAD, MAX_LAYERS, MAX_TAIL, TAIL_AHEAD, held_ends
from launcher.diskserver.lazydisk import HEAD_PREFETCH, READ_AHEAD
from launcher.diskserver.linkshare import SLOW_LINK, LinkShare
from tests.conftest import run
from tests.faultproxy import Fault, FaultProxy, Link
from tests.lazyhost import build_lazy_image, control, disk_server, export_status, image_toc, open_export, random_disk, wait_for
from tests.test_peers import push_blob

MIB = 1 << 20
DISK = 64 * MIB  # the head (32 MiB), a read-ahead, and room for a read past both


@pytest.fixture(scope="module")
def disk(tmp_path_factory) -> Path:
    """A first MiB that compresses well, as a disk's header and partition table do, then random bytes."""
    out = random_disk(tmp_path_factory.mktemp("link") / "disk-64m.img", DISK, seed=11)
    with open(out, "r+b") as f:
        f.write((b"a disk header, its partition table, a boot loader " * 30000)[:MIB])
    return out


@pytest.fixture(scope="module")
def image(registry, disk) -> str:
    return build_lazy_image(disk, f"{registry.host}/link/disk:v3")


@pytest.fixture(scope="module")
def facts(registry, image) -> dict:
    """The image's manifest and lazy TOC, and where its disk lies in the layer blob."""
    repository, tag = image.split("/", 1)[1].rsplit(":", 1)
    manifest = requests.get(registry.url(f"/v2/{repository}/manifests/{tag}"), timeout=60,
                            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}).json()
    (layer,) = manifest["layers"]
    toc = image_toc(registry, image)
    return {
        "repository": repository,
        "layer": layer,
        "config": manifest["config"]["digest"],
        "toc": toc,
        "toc_at": int(layer["annotations"][lazytoc.ANNOTATION_TOC_OFFSET]),
        "members": [tuple(m) for m in toc["members"]],
        "grid": lazytoc.Grid(toc["size"], toc["chunkSize"], tuple(toc[lazytoc.LENGTHS_FIELD])),
    }


def through(proxy: FaultProxy, registry, image: str) -> str:
    return image.replace(registry.host, proxy.host)


def layer_requests(timeline: list[tuple], facts: dict) -> list[dict]:
    """The range requests of the layer blob, in the order they arrived, with where in the timeline
    they arrived and were answered (None: not yet)."""
    path = f"/v2/{facts['repository']}/blobs/{facts['layer']['digest']}"
    out: dict[int, dict] = {}
    for at, (kind, number, _, method, target, value) in enumerate(timeline):
        if method != "GET" or target != path or value is None:
            continue
        if kind == "arrived":
            first, last = value.removeprefix("bytes=").split("-")
            out[number] = {"number": number, "start": int(first), "end": int(last) + 1, "arrived": at, "answered": None}
        else:
            out[number]["answered"] = at
    return list(out.values())


def open_at_once(requests_) -> list[int]:
    """For each request, how many (itself included) were open when it arrived."""
    requests_ = list(requests_)
    return [1 + sum(1 for o in requests_ if o["arrived"] < r["arrived"] and (o["answered"] is None or o["answered"] > r["arrived"]))
            for r in requests_] or [0]


def answered_at(timeline: list[tuple], target: str) -> int:
    return next(at for at, event in enumerate(timeline) if event[0] == "answered" and event[4] == target)


def test_an_open_asks_for_the_toc_and_the_disk_head_beside_the_config(tmp_path, registry, image, facts):
    """Before the first disk byte an open used to wait for the manifest, then the config, then the
    TOC, the bytes before the disk, those after it and the disk's first chunk, one after the other.
    Now the TOC (with what lies around it) and the disk's head are asked for as soon as the manifest
    is read: the config's answer is held here until they arrive, which it would wait for in vain if
    they were asked for only after it. The walk and the header check find everything in them, and
    the /v2/ probe's connection carries the manifest."""
    members, toc_at = facts["members"], facts["toc_at"]
    layer = facts["layer"]
    config_path = f"/v2/{facts['repository']}/blobs/{facts['config']}"
    layer_path = f"/v2/{facts['repository']}/blobs/{layer['digest']}"
    cache = tmp_path / "cache"
    cache.mkdir()
    both = threading.Event()
    seen = []

    def answer(method, target, read_body):
        if target == layer_path:
            seen.append(target)
            if len(seen) >= 2:
                both.set()
        elif target == config_path:
            both.wait(20)  # only in vain when the layer's ranges wait for the config
        return None

    with FaultProxy(registry.host) as proxy, disk_server(cache):
        proxy.answer = answer
        answer_ = open_export(cache, through(proxy, registry, image))
        run("qemu-io", "-r", "-f", "raw", "-c", "read 0 512", answer_["url"])  # the guest's first disk byte
        timeline = list(proxy.timeline)
    config_answered = answered_at(timeline, config_path)
    ranges = layer_requests(timeline, facts)
    early = [r for r in ranges if r["arrived"] < config_answered]
    assert len(early) == 2, (ranges, config_answered)
    covered = lambda low, high: any(r["start"] <= low and high <= r["end"] for r in early)  # noqa: E731
    assert covered(toc_at, layer["size"]), early  # the TOC and what follows it
    assert covered(0, members[0][0]), early  # the tar header before the disk
    assert sum(members[0]) <= HEAD_AHEAD, members[0]  # the disk's first chunk compresses well
    assert covered(members[0][0], sum(members[0])), early  # the header check's and the guest's first byte: no request of its own
    # No byte of the blob was asked for twice: what the early ranges held, the walk and the export took from them.
    spans = sorted((r["start"], r["end"]) for r in ranges)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    # The manifest came on the connection the /v2/ probe opened: its answer was read, the connection kept.
    probe = next(event for event in timeline if event[0] == "arrived" and event[4] == "/v2/")
    manifest = next(event for event in timeline if event[0] == "arrived" and "/manifests/" in event[4])
    assert manifest[2] == probe[2], (probe, manifest)


def test_a_guest_read_shares_the_link_with_one_prefetch_request_at_most(tmp_path, registry, image, facts):
    """While a VM boots, the head is prefetched one request at a time, each sized to what the link
    carries in a tenth of a second (the next asked for during the last round trip of the one
    before): a read of the guest past the head shares the link with that one request (and the
    end of the one before), and no other prefetch request starts before the guest's is answered."""
    grid, members = facts["grid"], facts["members"]
    at = grid.index(60 * MIB)
    assert at >= grid.past(0, HEAD_PREFETCH + READ_AHEAD)  # neither in the head nor read ahead of the header check
    cache = tmp_path / "cache"
    cache.mkdir()
    # 4 MiB/s for every connection together: the 32 MiB head takes seconds, so it is still coming when the guest reads.
    with FaultProxy(registry.host, link=Link(rate=4 * MIB)) as proxy, disk_server(cache):
        answer = open_export(cache, through(proxy, registry, image))
        # Past the open's own ranges (the first two), a prefetch request is on the way.
        wait_for(lambda: any(r["answered"] is None for r in layer_requests(proxy.timeline, facts)[2:]), 60, "a prefetch request in flight")
        run("qemu-io", "-r", "-f", "raw", "-c", f"read {60 * MIB} 512", answer["url"])
        timeline = list(proxy.timeline)
    ranges = layer_requests(timeline, facts)[2:]
    (demand,) = [r for r in ranges if r["start"] == members[at][0]]
    assert demand["answered"] is not None, demand
    prefetch = [r for r in ranges if r is not demand]
    alongside = [r for r in prefetch if r["arrived"] < demand["answered"] and (r["answered"] is None or r["answered"] > demand["arrived"])]
    assert len(alongside) <= 2, (demand, alongside)
    assert not [r for r in prefetch if demand["arrived"] < r["arrived"] < demand["answered"]], (demand, prefetch)
    # Nor did three prefetch requests ever share the link while the VM booted.
    assert max(open_at_once(r for r in prefetch if r["arrived"] < demand["answered"])) <= 2, prefetch


def test_the_next_prefetch_request_goes_out_before_the_one_before_has_ended(tmp_path, registry, image, facts):
    """While a VM boots, one prefetch request at a time has the link, but the next is asked for
    once what is left of the current answer takes the link about a round trip (measured): its
    first bytes follow the last of the one before, where they used to come a round trip after
    them (the link idle meanwhile, a sixth of it at 20 ms and 0.1 s pieces). The requests overlap
    by that much only: never three at once."""
    cache = tmp_path / "cache"
    cache.mkdir()
    # 50 ms round trips and 4 MiB/s: pieces of 0.4 MiB, each asked for about half way through the one before.
    with FaultProxy(registry.host, link=Link(rtt=0.05, rate=4 * MIB)) as proxy, disk_server(cache):
        open_export(cache, through(proxy, registry, image))
        # Past the open's own ranges (the first two): the head's prefetch, while the VM the open announced boots.
        wait_for(lambda: sum(r["answered"] is not None for r in layer_requests(proxy.timeline, facts)[2:]) >= 8, 120,
                 "eight prefetch requests answered")
        timeline = list(proxy.timeline)
    prefetch = [r for r in layer_requests(timeline, facts)[2:] if r["answered"] is not None][:8]
    assert all(r["end"] <= sum(facts["members"][facts["grid"].past(0, HEAD_PREFETCH) - 1]) for r in prefetch), prefetch  # the head's
    early = [b for a, b in zip(prefetch, prefetch[1:]) if b["arrived"] < a["answered"]]
    # The first request measures the round trip: from the second on, each next one went out early.
    assert len(early) >= 4, prefetch
    assert max(open_at_once(prefetch)) <= 2, prefetch


def test_over_a_slow_link_the_rest_of_a_disk_comes_while_the_guest_boots(tmp_path, registry, image, facts):
    """Below SLOW_LINK the link is what a lazy boot waits for, not the CPU: prefetch goes on after the
    head and the read-ahead while the guest boots, one request at a time, though the guest reads
    only its head (a kernel booting from its initrd reads nothing more for seconds), and the disk is
    whole before the guest has stopped reading: its init then finds its root filesystem here. Held
    until the guest read past the head, the Debian guest's lazy boot over 20 ms and 100 Mbit/s left
    the link idle for 5 s and came 2.8 s later (docs/benchmarks.md). Over a fast link the rest waits
    (test_lazy_prefetch.py), where its fetch would only take the boot's CPU."""
    grid = facts["grid"]
    assert grid.count > grid.past(0, HEAD_PREFETCH) + grid.past(0, READ_AHEAD)  # a rest beyond the head and read-ahead
    cache = tmp_path / "cache"
    cache.mkdir()
    rate = 8 * MIB
    assert rate < SLOW_LINK
    with FaultProxy(registry.host, link=Link(rtt=0.02, rate=rate)) as proxy, disk_server(cache):
        answer = open_export(cache, through(proxy, registry, image))
        # The guest reads its first sector every half second for 60 s: busy all along (GUEST_BUSY is 3 s).
        reads = [arg for _ in range(120) for arg in ("-c", "read 0 512", "-c", "sleep 500")]
        guest = subprocess.Popen(["qemu-io", "-r", "-f", "raw", *reads, answer["url"]], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            whole = wait_for(lambda: (s := export_status(cache, answer["export"]))["present"] == grid.count and s, 120, "the whole disk")
            assert guest.poll() is None, guest.communicate()  # the guest was still reading
        finally:
            guest.kill()
            guest.wait()
        timeline = list(proxy.timeline)
    assert whole["stats"]["demand_fetches"] == 0, whole  # every read found its bytes prefetched
    assert max(open_at_once(layer_requests(timeline, facts)[2:])) <= 2, "one prefetch request at a time while the guest boots"


def test_a_burst_off_an_idle_link_does_not_make_a_slow_link_fast():
    """A body whose bytes were in the link's buffers when its first arrived (the link idle a moment,
    as when prefetch is held) comes in a burst: 150 KiB in 2 ms on an 8 MiB/s link. Each body weighs
    the seconds it took, so the link stays slow; as a sample of its own the burst measured it at
    30 MB/s, and the rest of a disk the guest had read past waited for the guest to stop reading."""
    link = LinkShare()
    for _ in range(6):
        link.measured(8 * MIB // 10, 0.1)  # prefetch pieces back to back: 8 MiB/s
    assert link.slow()
    link.measured(150 << 10, 0.002)
    assert link.slow(), link.throughput
    assert link.throughput < 9 * MIB
    for _ in range(6):
        link.measured(8 * MIB, 0.1)  # the link got faster: 80 MiB/s
    assert not link.slow(), link.throughput


def test_a_reader_gets_its_chunk_before_the_rest_of_the_prefetched_run(tmp_path, registry, image, facts):
    """The answer to a prefetch request stops once its first chunk's member is complete (the proxy
    holds the rest): a guest reading that chunk gets it while the rest of the run is held."""
    grid, members, toc_at, layer = facts["grid"], facts["members"], facts["toc_at"], facts["layer"]

    def first_member(start: int) -> int:
        """The chunk whose member holds blob byte `start`: a run's first (its bytes before `start` were held)."""
        return max(i for i, (offset, _) in enumerate(members) if offset <= start)

    def pause_at(value: str) -> int:
        start = int(value.removeprefix("bytes=").split("-")[0])
        return sum(members[first_member(start)]) - start

    # Not the open's own ranges (now: the head and the TOC's tail; before: the TOC, the bytes around
    # the disk, the header check's first chunk), nor a run the head's bytes began: a prefetch run.
    opens = {0, max(0, toc_at - (64 << 10)), toc_at, sum(members[-1]), members[0][0], HEAD_AHEAD}
    release = threading.Event()
    cache = tmp_path / "cache"
    cache.mkdir()
    with FaultProxy(registry.host) as proxy, disk_server(cache):
        proxy.add(Fault("GET", f"/blobs/{layer['digest']}$", "pause", arg=pause_at, release=release,
                        header=("Range", r"^bytes=(?!(?:%s)-)" % "|".join(map(str, sorted(opens))))))
        try:
            answer = open_export(cache, through(proxy, registry, image))
            paused = wait_for(lambda: [r for r in layer_requests(proxy.timeline, facts) if r["start"] not in opens], 60, "a prefetch request")[0]
            index = first_member(paused["start"])
            assert paused["end"] > sum(members[index]), (paused, members[index])  # the run goes on past its first chunk
            guest = subprocess.Popen(["qemu-io", "-r", "-f", "raw", "-c", f"read {grid.range(index)[0]} 512", answer["url"]],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                _, err = guest.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                guest.kill()
                guest.communicate()
                raise AssertionError("the guest's read waited for the rest of the prefetched run") from None
            assert guest.returncode == 0, err
            after_read = layer_requests(proxy.timeline, facts)
            assert next(r for r in after_read if r["number"] == paused["number"])["answered"] is None, paused
        finally:
            release.set()


def test_what_an_open_asks_for_ahead_of_the_walk_is_bounded(tmp_path, registry):
    """Attack: a manifest naming many layers, each pinning a TOC (annotations only: the liar is the
    image's author) as large as a TOC may be, hoping the open fetches them all ahead of the walk.
    It asks for the head and TOC's tail of MAX_LAYERS layers at most, each piece within its bound,
    then the walk refuses the first TOC, which does not match its pin."""
    base, repository = f"http://{registry.host}", "link/many"
    rng = random.Random(3)
    layers = []
    for i in range(MAX_LAYERS + 2):
        data = rng.randbytes(5 * MIB + i)
        notes = {lazytoc.ANNOTATION_TOC_OFFSET: str(MIB), lazytoc.ANNOTATION_TOC_SIZE: str(lazytoc.MAX_TOC_BYTES),
                 lazytoc.ANNOTATION_TOC_DIGEST: "sha256:" + "0" * 64}
        layers.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": push_blob(base, repository, data),
                       "size": len(data), "annotations": notes})
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "rootfs": {"type": "layers", "diff_ids": ["sha256:" + "1" * 64] * len(layers)}}).encode()
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": push_blob(base, repository, config), "size": len(config)},
                "layers": layers, "annotations": {lazytoc.ANNOTATION_LAZY: lazytoc.LAZY_VALUE_GZIP}}
    put = requests.put(f"{base}/v2/{repository}/manifests/v1", data=json.dumps(manifest), timeout=30,
                       headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"})
    assert put.status_code == 201, put.text
    cache = tmp_path / "cache"
    cache.mkdir()
    with FaultProxy(registry.host) as proxy, disk_server(cache):
        answer = control(cache, {"op": "open", "image": f"{proxy.host}/{repository}:v1", "registry": {"tls_verify": False, "retries": 1}})
        timeline = list(proxy.timeline)
    assert not answer.get("ok") and "lazy TOC" in answer.get("error", "") and "\n" not in answer["error"], answer
    asked: dict[str, list[int]] = {}
    for kind, _, _, method, target, value in timeline:
        if kind == "arrived" and value is not None and "/blobs/sha256:" in target:
            first, last = value.removeprefix("bytes=").split("-")
            asked.setdefault(target.rsplit("/", 1)[1], []).append(int(last) + 1 - int(first))
    assert 0 < len(asked) <= MAX_LAYERS, asked
    assert all(length <= MAX_TAIL + TAIL_AHEAD for lengths in asked.values() for length in lengths), asked


@pytest.mark.parametrize("start,stop,front,back", [
    (0, 10, b"0123456789", b""),  # wholly in the head piece
    (5, 200, b"56789", b""),  # begins in it: only the rest is asked for
    (50, 105, b"", b"abcde"),  # ends in the tail piece
    (8, 103, b"89", b"abc"),  # both: the middle alone travels
    (20, 40, b"", b""),  # neither
])
def test_a_read_takes_the_held_ends_of_its_range(start, stop, front, back):
    held = [(0, b"0123456789"), (100, b"abcdefghij")]
    assert held_ends(held, start, stop) == (front, back)

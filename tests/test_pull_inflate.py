"""`launcher pull` inflates a lazy gzip layer's chunk members on every core (diskkit/layers/lazyinflate.py):
the same bytes as one serial inflater, in order; a member the registry corrupts on the way and a TOC
that lies (re-pinned all the way up, so blob digest and diffID still agree) are refused before
anything is installed."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import os
import threading
import re
from pathlib import Path

import pytest

from diskkit.errors import DiskkitError
from diskkit.layers import lazygzip, lazytoc
from diskkit.layers.layer import entries_for
from diskkit.layers.lazyinflate import MemberInflater
from diskkit.limits import member_limit
from tests.conftest import run_diskkit, run_launcher
from tests.faultproxy import Fault
from tests.lazyhost import build_lazy_image, image_toc
from tests.test_lazygz import blob, disk, forged, layout, layout_v2, manifest_of, old_pins, sha256_pins  # noqa: F401 (fixtures)

NOREG = "--tls-verify=false"
MIB = 1 << 20


def lazy_layer(tmp_path: Path, files: list[tuple[str, bytes]], disk_path: str, content_defined: bool = True) -> tuple[bytes, lazytoc.Toc]:
    """A layer as `diskkit build --lazy` writes it (TOC v3, or v2 with fixed chunks), and its parsed TOC."""
    sources = []
    for name, data in files:
        local = tmp_path / name.strip("/").replace("/", "_")
        local.write_bytes(data)
        sources.append((name, local))
    sink = io.BytesIO()
    result = lazygzip.write_layer(entries_for(sources), sink, toc_for=disk_path.strip("/"), content_defined=content_defined)
    data = sink.getvalue()
    loc = result.toc
    toc = lazytoc.parse(lazytoc.read_stored(data[loc.offset : loc.offset + loc.size], 2, "layer"), loc, "layer", 2)
    return data, toc


def inflated(data: bytes, toc: lazytoc.Toc, workers: int, read_size: int) -> bytes:
    reader = MemberInflater(io.BufferedReader(io.BytesIO(data), 7777), toc, "layer", workers)
    try:
        out = bytearray()
        while piece := reader.read(read_size):
            out += piece
        return bytes(out)
    finally:
        reader.close()


@pytest.mark.parametrize("content_defined", [True, False], ids=["v3", "v2"])
def test_members_inflate_in_parallel_to_the_serial_stream(tmp_path, content_defined):
    """Files before and after the disk (their bytes in members of up to 1 MiB, inflated in order),
    a disk of text, zeros and random bytes with a short last chunk: any pool size, any read size."""
    text = b" ".join(b"word%d" % (i % 977) for i in range(700_000))[: 3 * MIB + 5]
    disk = text + bytes(2 * MIB) + os.urandom(MIB + 4321)
    files = [("/boot/initrd", os.urandom(2 * MIB + 17)), ("/disk/disk.img", disk), ("/zz/after", text[: MIB + 3])]
    data, toc = lazy_layer(tmp_path, files, "/disk/disk.img", content_defined)
    assert (toc.version, toc.count == 7) == ((3, False) if content_defined else (2, True)) and len(data) > member_limit(MIB)
    serial = gzip.decompress(data)
    for workers, read_size in ((1, MIB), (2, 4096), (4, 3 * MIB), (3, 1)):
        if read_size == 1:
            data_small, toc_small = lazy_layer(tmp_path, [("/disk/disk.img", disk[:9000])], "/disk/disk.img", content_defined)
            assert inflated(data_small, toc_small, workers, read_size) == gzip.decompress(data_small)
            continue
        assert inflated(data, toc, workers, read_size) == serial, (workers, read_size)


def test_a_member_that_is_not_where_the_toc_says_is_refused(tmp_path):
    """Refusals the TOC's parse cannot see: a member cut short by the blob, a member placed inside
    another, a member pinned by other bytes, and garbage (a member longer than its chunk takes is
    refused by the parse: test_trust_bounds.py)."""
    disk = os.urandom(2 * MIB + 99)
    data, toc = lazy_layer(tmp_path, [("/disk/disk.img", disk)], "/disk/disk.img")
    (at0, len0), (at1, len1) = toc.members[:2]

    def refused(data: bytes, toc: lazytoc.Toc, match: str) -> None:
        with pytest.raises(DiskkitError, match=match):
            inflated(data, toc, 2, MIB)

    refused(data[: at1 + 10], toc, rf"the blob ends inside chunk 1's gzip member at {at1}\+{len1}")
    # Shifted by 16 bytes with the lengths kept back to back: chunk 0 now starts inside the tar headers' member.
    shifted = tuple((at - 16, n) for at, n in toc.members)
    refused(data, dataclasses.replace(toc, members=shifted), "places chunk 0's gzip member at .*, inside another gzip member")
    pins = list(toc.member_digests)
    pins[1] = "0" * 64
    refused(data, dataclasses.replace(toc, member_digests=tuple(pins)), rf"chunk 1's gzip member at {at1}\+{len1} does not match its digest in the lazy TOC")
    flipped = bytearray(data)
    flipped[at0 + 5] ^= 1  # inside the member's header: the pin catches it before the inflater would
    refused(bytes(flipped), toc, "chunk 0's gzip member at .* does not match its digest")
    tail = data[: -5] + b"\x1f\x8b\x08\x00\x00"  # the last member's end replaced by the start of another
    refused(tail, toc, "gzip stream cannot be decompressed")


def test_closing_the_inflater_mid_layer_stops_its_feeding_thread_and_its_pool(tmp_path):
    """A reader that stops early (a refusal further down the pull): the thread cutting members, waiting
    for room behind the bounded queue, and the pool's workers all end; nothing is left running."""
    data, toc = lazy_layer(tmp_path, [("/disk/disk.img", bytes(32 * MIB))], "/disk/disk.img")
    before = set(threading.enumerate())
    reader = MemberInflater(io.BufferedReader(io.BytesIO(data), 7777), toc, "layer", 2)
    assert reader.read(4096) == gzip.decompress(data[: toc.members[0][0]])[:4096]  # the tar headers
    started = set(threading.enumerate()) - before
    reader.close()
    assert started and not any(thread.is_alive() for thread in started)


@pytest.fixture(scope="module")
def remote(registry, disk) -> str:  # noqa: F811 (the disk fixture of test_lazygz)
    return build_lazy_image(disk, f"{registry.host}/inflate/guest:v2")


def nothing_installed(cache: Path) -> None:
    """No disk in the cache, no staging left behind, no ref recorded."""
    assert not list(cache.glob("disks/**/disk.img")) and not list(cache.glob("tmp/*")) and not list(cache.glob("refs/**/*.json")), sorted(cache.rglob("*"))


def test_pull_gives_the_disk_bytes_and_refuses_a_member_corrupted_on_the_way(tmp_path, registry, fault_proxy, remote, disk):  # noqa: F811
    toc = image_toc(registry, remote)
    layer = json.loads(run_diskkit("inspect", NOREG, "--json", remote).out)["layers"][0]["digest"]
    proxy = fault_proxy(registry)
    at, length = toc["members"][7]
    # The first GET of the blob is the TOC's range; the second streams the blob: one bit flipped inside chunk 7's member.
    proxy.add(Fault("GET", rf"/blobs/{layer}", "flip", times=1, skip=1, arg=at + length // 2))
    cache = tmp_path / "cache"
    refused = run_launcher("pull", "--cache-dir", cache, NOREG, remote.replace(registry.host, proxy.host))
    assert refused.code != 0 and f"chunk 7's gzip member at {at}+{length} does not match its digest in the lazy TOC" in refused.err, refused.err
    assert len(refused.err.strip().splitlines()) == 1, refused.err
    assert not proxy.pending
    nothing_installed(cache)
    pulled = run_launcher("pull", "--cache-dir", cache, NOREG, "--json", remote.replace(registry.host, proxy.host))
    assert pulled.code == 0, pulled.err
    assert Path(json.loads(pulled.out)["path"]).read_bytes() == disk.read_bytes()


def test_pull_refuses_a_toc_that_lies(tmp_path, layout, layout_v2):  # noqa: F811
    """Each lie re-pinned all the way up (TOC digest annotation, blob digest, diffID): a serial
    inflater would take the layer, the parallel one is refused on the TOC's word, nothing installed."""

    def wrong_member(toc, data):
        toc["memberBlake3s"][3] = "0" * 64

    def wrong_sha256_member(toc, data):
        sha256_pins(toc, data)
        toc["memberDigests"][3] = "0" * 64

    def wrong_chunk(toc, data):
        old_pins(toc, data)
        toc["chunks"][3] = "0" * 64

    def swapped(toc, data):  # two members' places exchanged: each still one member, pinned, back to back
        (a, n), (b, m) = toc["members"][3], toc["members"][4]
        toc["members"][3], toc["members"][4] = [a, m], [a + m, n]
        toc["memberBlake3s"][3], toc["memberBlake3s"][4] = toc["memberBlake3s"][4], toc["memberBlake3s"][3]

    cases = (("member", wrong_member, "chunk 3's gzip member at .* does not match its digest in the lazy TOC"),
             ("sha256", wrong_sha256_member, "chunk 3's gzip member at .* does not match its digest in the lazy TOC"),
             ("chunk", wrong_chunk, "the lazy TOC's digest of chunk 3 does not match"),
             ("swapped", swapped, "chunk 3's gzip member at .* does not match its digest in the lazy TOC"))
    # Pins as older diskkit wrote them exist in fixed-chunk TOCs (v2) only.
    for name, change, match, lied in [*((f"{n}-v3", c, m, layout) for n, c, m in cases if n in ("member", "swapped")),
                                      *((n, c, m, layout_v2) for n, c, m in cases)]:
        lying = forged(tmp_path, lied, name, change)
        cache = tmp_path / f"cache-{name}"
        refused = run_launcher("pull", "--cache-dir", cache, f"oci:{lying}:v2")
        assert refused.code != 0 and refused.err.strip().count("\n") == 0, (name, refused.err)
        assert re.search(match, refused.err), (name, refused.err)
        nothing_installed(cache)
    # The honest layout: the same pull installs the disk.
    honest = run_launcher("pull", "--cache-dir", tmp_path / "cache", "--json", f"oci:{layout}:v2")
    assert honest.code == 0, honest.err


def test_pull_refuses_a_toc_its_annotations_do_not_pin(tmp_path, layout):  # noqa: F811
    """The TOC is read before the blob streams: a TOC digest annotation that does not match is refused in one line."""
    out = tmp_path / "badpin"
    forged_layout = forged(tmp_path, layout, "badpin-src", lambda toc, data: None)
    os.rename(forged_layout, out)
    manifest = manifest_of(out)
    manifest["layers"][0]["annotations"][lazytoc.ANNOTATION_TOC_DIGEST] = "sha256:" + "2" * 64
    mbytes = json.dumps(manifest, separators=(",", ":"), sort_keys=True).encode()
    (out / "blobs" / "sha256" / hashlib.sha256(mbytes).hexdigest()).write_bytes(mbytes)
    index = json.loads((out / "index.json").read_text())
    index["manifests"][0].update(digest="sha256:" + hashlib.sha256(mbytes).hexdigest(), size=len(mbytes))
    (out / "index.json").write_text(json.dumps(index))
    cache = tmp_path / "cache"
    refused = run_launcher("pull", "--cache-dir", cache, f"oci:{out}:v2")
    assert refused.code != 0 and "lazy TOC does not match its digest sha256:2222" in refused.err, refused.err
    assert refused.err.strip().count("\n") == 0, refused.err
    nothing_installed(cache)

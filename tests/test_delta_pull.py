"""`launcher pull` of an updated image costs its change (issue 31): with v1 cached, v2's lazy layer
is assembled from the chunks the node holds and range requests for the rest, through a real registry
and a proxy that counts the bytes; every reused chunk is hashed, every fetched member checked, and the
whole layer checked against its diffID before anything is installed. Chunks are cut where their
content says (TOC v3), so a v2 rebuilt the usual way (`qemu-img convert -c`, every compressed cluster
after the change moved) fetches about its change too, and disks of images with older TOCs (fixed
chunks) are found by the chunks new TOCs name."""

from __future__ import annotations

import hashlib
import json
import os
import random
import zlib
from pathlib import Path

import blake3
import pytest

from diskkit.layers import chunkcut, lazytoc
from launcher.chunks.index import ChunkIndex
from launcher.node.cache import Cache
from tests.conftest import run_diskkit, run_launcher
from tests.test_chunk_index import rebuilt_qcow2_pair
from tests.test_lazygz import blob, manifest_of, rewrite_toc

NOREG = "--tls-verify=false"
MIB = 1 << 20
KIB = 1 << 10


def sparse_disk(path: Path, size: int, pieces: list[tuple[int, bytes]]) -> Path:
    """A disk of `size` bytes, holes but for `pieces` (offset, bytes): quick to make, build and pull."""
    with open(path, "wb") as f:
        f.truncate(size)
        for offset, data in pieces:
            f.seek(offset)
            f.write(data)
    return path


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def build(registry_host: str, disk: Path, name: str, *extra: str) -> str:
    ref = f"{registry_host}/delta/{name}"
    built = run_diskkit("build", NOREG, *extra, disk, "-t", ref)
    assert built.code == 0, built.err
    return ref


def pull(cache: Path, ref: str):
    result = run_launcher("pull", "--cache-dir", cache, NOREG, "--json", ref)
    assert result.code == 0, result.err
    return json.loads(result.out), result.err


def cuts(data: bytes) -> list[tuple[int, int]]:
    """(start, length) of each chunk `diskkit build` cuts a disk of these bytes into (TOC v3)."""
    return [(c.offset, c.length) for c in chunkcut.params_for(len(data)).chunker().cut_buf(data)]


def chunk_at(data: bytes, offset: int) -> tuple[int, int]:
    """The (start, length) of the chunk of `data` that holds byte `offset`."""
    return next((start, length) for start, length in cuts(data) if start <= offset < start + length)


def new_bytes(v1: bytes, v2: bytes) -> int:
    """The length of v2's chunks whose content v1's chunks do not have: what a pull with v1 fetches."""
    have = {blake3.blake3(v1[start : start + length]).digest() for start, length in cuts(v1)}
    return sum(length for start, length in cuts(v2) if blake3.blake3(v2[start : start + length]).digest() not in have)


def blob_bytes(proxy) -> int:
    """Layer and config bytes the proxy relayed: what the pull really fetched."""
    return sum(n for path, n in proxy.sent.items() if "/blobs/sha256:" in path)


@pytest.mark.slow  # two 1 GiB disks built, pushed and pulled
def test_with_v1_cached_v2_fetches_its_change_only(tmp_path, registry, fault_proxy):
    """The issue's check: 1 GiB raw disks, v2 with 8 aligned MiB and a 100 KiB write across a chunk
    boundary changed, both `diskkit build` (lazy by default). v1 pulled, then v2 through a counting
    proxy: at most 12 MiB fetched, and v2's disk byte for byte."""
    rng = random.Random(31)
    v1_pieces = [(i * 64 * MIB + 3 * MIB, rng.randbytes(MIB)) for i in range(16)]  # 16 MiB that is not zeros
    v2_pieces = v1_pieces + [(200 * MIB, rng.randbytes(8 * MIB)), (500 * MIB - 50 * KIB, rng.randbytes(100 * KIB))]
    v1 = sparse_disk(tmp_path / "v1.img", 1 << 30, v1_pieces)
    v2 = sparse_disk(tmp_path / "v2.img", 1 << 30, v2_pieces)
    ref1 = build(registry.host, v1, "big:v1")
    build(registry.host, v2, "big:v2")
    cache = tmp_path / "cache"
    first, _ = pull(cache, ref1)
    assert first["reused"] == 0 and first["fetched"] > 16 * MIB
    proxy = fault_proxy(registry)
    second, err = pull(cache, f"{proxy.host}/delta/big:v2")
    fetched = blob_bytes(proxy)
    assert fetched <= 12 * MIB, (fetched, err)
    assert sha256_file(Path(second["path"])) == sha256_file(v2)
    # What the pull says is what the proxy saw (the manifest's config blob aside), and the rest was reused.
    assert second["fetched"] <= fetched <= second["fetched"] + 64 * KIB
    # Not reused: the 8 MiB and the 100 KiB with the chunks around them, and the first chunk of the
    # next data after each (its start in the zeros before it moved with the cuts through them).
    assert second["reused"] >= (1 << 30) - 16 * MIB
    assert "bytes fetched" in err and "reused from the node" in err
    # Coalesced: the 8 changed MiB are one range, not eight.
    ranged = [path for method, path, status in proxy.log if method == "GET" and status == 206]
    assert len(ranged) <= 6, ranged


def test_what_the_readme_says_an_update_does_not_cost_its_change(tmp_path, registry, fault_proxy):
    """The README's caveat, as it holds: a v2 whose layer has no chunk table (`--no-lazy`, as another
    tool's) is pulled whole though the node holds all but its changed MiB; disks over 16 GiB keep fixed
    1 MiB chunks; the chunks grow past 2, 4 and 8 GiB, so disks on either side share none."""
    v1, v2, _ = _disks(tmp_path)
    cache = tmp_path / "cache"
    pull(cache, build(registry.host, v1, "whole:v1"))
    build(registry.host, v2, "whole:v2", "--no-lazy")
    proxy = fault_proxy(registry)
    pulled, _ = pull(cache, f"{proxy.host}/delta/whole:v2")
    assert pulled["reused"] == 0 and blob_bytes(proxy) >= 32 * MIB, (pulled, blob_bytes(proxy))  # random bytes: gzip saves nothing
    assert sha256_file(Path(pulled["path"])) == sha256_file(v2)
    readme = " ".join((Path(__file__).resolve().parent.parent / "README.md").read_text().split())
    assert ("a layer without their chunk table (another tool's, `--no-lazy`, a docker-archive) is pulled whole, a disk over 16 GiB "
            "keeps fixed 1 MiB chunks, which find bytes only where they stayed, and disks on either side of 2, 4 or 8 GiB") in readme
    gib = 1 << 30
    assert chunkcut.params_for(16 * gib) is not None and chunkcut.params_for(16 * gib + 1) is None
    for edge in (2 * gib, 4 * gib, 8 * gib):
        assert chunkcut.params_for(edge).min * 2 == chunkcut.params_for(edge + 1).min


def _disks(tmp_path: Path) -> tuple[Path, Path, Path]:
    """32 MiB of distinct random chunks; v2 with chunk 5 new; v3 with chunks 5 and 20 new."""
    rng = random.Random(5)
    base = bytearray(rng.randbytes(32 * MIB))
    v1 = tmp_path / "v1.img"
    v1.write_bytes(base)
    base[5 * MIB : 6 * MIB] = rng.randbytes(MIB)
    v2 = tmp_path / "v2.img"
    v2.write_bytes(base)
    base[20 * MIB + 7 : 20 * MIB + 9] = b"\x00\x01"
    v3 = tmp_path / "v3.img"
    v3.write_bytes(base)
    return v1, v2, v3


def test_a_corrupted_cached_chunk_is_fetched_instead(tmp_path, registry, fault_proxy):
    """A byte flipped in v1's cached disk: the chunk it falls in fails its hash when read, is fetched
    from the registry, its stale place leaves the index, and v2 still comes out byte for byte."""
    v1, v2, _ = _disks(tmp_path)
    ref1, _ = build(registry.host, v1, "flip:v1"), build(registry.host, v2, "flip:v2")
    cache = tmp_path / "cache"
    first, _ = pull(cache, ref1)
    cached = Path(first["path"])
    os.chmod(cached, 0o644)
    with open(cached, "r+b") as f:
        f.seek(10 * MIB + 4321)
        byte = f.read(1)
        f.seek(10 * MIB + 4321)
        f.write(bytes([byte[0] ^ 0x40]))
    proxy = fault_proxy(registry)
    second, _ = pull(cache, f"{proxy.host}/delta/flip:v2")
    assert sha256_file(Path(second["path"])) == sha256_file(v2)
    old, new = v1.read_bytes(), v2.read_bytes()
    start, length = chunk_at(old, 10 * MIB + 4321)
    assert (start, length) in cuts(new)  # unchanged in v2
    changed = new_bytes(old, new)
    assert second["reused"] == 32 * MIB - changed - length  # the 5th MiB changed, the chunk at 10 MiB corrupted: both fetched
    assert changed + length < blob_bytes(proxy) < changed + length + 256 * KIB
    index = ChunkIndex(Cache(cache))
    flipped = blake3.blake3(old[start : start + length]).hexdigest()
    assert [p.path for p in index.lookup("blake3", flipped)] == [str(Path(second["path"]).relative_to(cache))]


def test_a_registry_that_ignores_ranges_gets_a_whole_pull(tmp_path, registry, fault_proxy):
    """Range requests answered with the whole blob: said in one note, and the blob streamed once."""
    v1, v2, _ = _disks(tmp_path)
    ref1, _ = build(registry.host, v1, "norange:v1"), build(registry.host, v2, "norange:v2")
    cache = tmp_path / "cache"
    pull(cache, ref1)
    proxy = fault_proxy(registry)
    proxy.ignore_range = True
    second, err = pull(cache, f"{proxy.host}/delta/norange:v2")
    assert sha256_file(Path(second["path"])) == sha256_file(v2)
    assert "answered a range request with the whole blob" in err and second["reused"] == 0
    layer = manifest_digest_layer(proxy, "norange:v2")
    assert layer["size"] <= blob_bytes(proxy) < layer["size"] + 64 * KIB  # once, not once for the TOC and again


def test_a_fresh_node_pulls_from_a_registry_that_ignores_ranges_once(tmp_path, registry, fault_proxy):
    """No chunk to reuse, so no delta plan: the parallel inflater's TOC range is refused, not read up
    to (the TOC is at the blob's end), and the layer is streamed once and inflated on one core."""
    _, v2, _ = _disks(tmp_path)
    build(registry.host, v2, "norange-fresh:v2")
    proxy = fault_proxy(registry)
    proxy.ignore_range = True
    pulled, _ = pull(tmp_path / "cache", f"{proxy.host}/delta/norange-fresh:v2")
    assert sha256_file(Path(pulled["path"])) == sha256_file(v2)
    layer = manifest_digest_layer(proxy, "norange-fresh:v2")
    assert layer["size"] <= blob_bytes(proxy) < layer["size"] + 64 * KIB


def manifest_digest_layer(proxy, tag: str) -> dict:
    import requests

    manifest = requests.get(f"http://{proxy.host}/v2/delta/{tag.split(':')[0]}/manifests/{tag.split(':')[1]}",
                            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}, timeout=30).json()
    return manifest["layers"][0]


def test_a_toc_that_lies_about_a_chunk_is_caught_by_the_diffid(tmp_path, registry):
    """v3's TOC re-pinned to name the chunk it changed (2 bytes at 20 MiB) by the content v1 has
    there (which the node holds): the chunk is reused, but the assembled layer does not hash to the
    config's diffID, so the pull is refused in one line and nothing is installed."""
    v1, _, v3 = _disks(tmp_path)
    start, length = chunk_at(v3.read_bytes(), 20 * MIB + 7)
    assert (start, length) in cuts(v1.read_bytes())  # two bytes moved no cut
    lied = cuts(v3.read_bytes()).index((start, length))
    ref1 = build(registry.host, v1, "lie:v1")
    layout = tmp_path / "v3"
    built = run_diskkit("build", v3, "-t", f"oci:{layout}:v3")
    assert built.code == 0, built.err
    manifest = manifest_of(layout)
    data = blob(layout, manifest["layers"][0]["digest"])
    notes = manifest["layers"][0]["annotations"]
    at, size = int(notes[lazytoc.ANNOTATION_TOC_OFFSET]), int(notes[lazytoc.ANNOTATION_TOC_SIZE])
    toc = json.loads(zlib.decompress(data[at : at + size], 31))
    toc[lazytoc.CONTENT_FIELD][lied] = blake3.blake3(v1.read_bytes()[start : start + length]).hexdigest()
    rewrite_toc(layout, manifest, data, at, size, json.dumps(toc, separators=(",", ":"), sort_keys=True).encode())
    pushed = run_diskkit("push", NOREG, f"oci:{layout}:v3", f"{registry.host}/delta/lie:v3")
    assert pushed.code == 0, pushed.err
    cache = tmp_path / "cache"
    pull(cache, ref1)
    before = sorted(p.name for p in (cache / "disks" / "sha256").iterdir())
    refused = run_launcher("pull", "--cache-dir", cache, NOREG, f"{registry.host}/delta/lie:v3")
    assert refused.code != 0 and "does not match its diffID" in refused.err and len(refused.err.strip().splitlines()) == 1, refused.err
    assert sorted(p.name for p in (cache / "disks" / "sha256").iterdir()) == before
    assert list((cache / "tmp").iterdir()) == []


def test_gc_forgets_the_chunks_of_removed_disks(tmp_path, registry):
    """`launcher gc` removes an unused disk and its places leave the index with it."""
    v1, _, _ = _disks(tmp_path)
    ref1 = build(registry.host, v1, "gc:v1")
    cache = tmp_path / "cache"
    first, _ = pull(cache, ref1)
    rel = str(Path(first["path"]).relative_to(cache))
    assert ChunkIndex(Cache(cache)).paths() == [rel]
    collected = run_launcher("gc", "--cache-dir", cache)
    assert collected.code == 0, collected.err
    assert not Path(first["path"]).exists() and ChunkIndex(Cache(cache)).paths() == []


def test_disks_of_older_images_are_indexed_too(tmp_path, registry, fault_proxy):
    """A v1 lazy layer (uncompressed, TOC `chunks` by sha256) is recorded by its sha256s, and by
    BLAKE3 over content-defined chunks as today's TOCs name them; a layer with no TOC at all
    (--no-lazy) by hashing the disk so; a TOC v2 (fixed 1 MiB chunks) by its own and by those: a
    later v3 reuses any of them, and a later v2 still reuses the v2's."""
    v1, v2, _ = _disks(tmp_path)
    changed = new_bytes(v1.read_bytes(), v2.read_bytes())
    assert MIB <= changed < 2 * MIB
    cache = tmp_path / "cache"
    old = build(registry.host, v1, "old:v1", "--lazy", "--compression", "none")
    first, _ = pull(cache, old)
    rel = str(Path(first["path"]).relative_to(cache))
    chunk0 = v1.read_bytes()[:MIB]
    index = ChunkIndex(Cache(cache))
    assert [p.path for p in index.lookup("sha256", hashlib.sha256(chunk0).hexdigest())] == [rel]
    # ... and by BLAKE3 too, so that a gzip v2 built today reuses it.
    build(registry.host, v2, "old:v2")
    proxy = fault_proxy(registry)
    reused, _ = pull(cache, f"{proxy.host}/delta/old:v2")
    assert reused["reused"] == 32 * MIB - changed and sha256_file(Path(reused["path"])) == sha256_file(v2) and blob_bytes(proxy) < changed + 256 * KIB
    plain = build(registry.host, v1, "plain:v1", "--no-lazy")
    other = tmp_path / "cache2"
    second, _ = pull(other, plain)
    first = v1.read_bytes()[: cuts(v1.read_bytes())[0][1]]
    assert [p.path for p in ChunkIndex(Cache(other)).lookup("blake3", blake3.blake3(first).hexdigest())] == [str(Path(second["path"]).relative_to(other))]
    build(registry.host, v2, "plain:v2")
    proxy = fault_proxy(registry)
    third, _ = pull(other, f"{proxy.host}/delta/plain:v2")
    assert third["reused"] == 32 * MIB - changed and sha256_file(Path(third["path"])) == sha256_file(v2)
    assert blob_bytes(proxy) < changed + 256 * KIB
    fixed = build(registry.host, v1, "fixed:v1", "--lazy-chunks", "fixed")
    for name, chunks, reuse in (("fixed:v2", "fixed", 31 * MIB), ("fixed:v3", "content", 32 * MIB - changed)):
        cache = tmp_path / f"cache-{name}"
        pull(cache, fixed)
        build(registry.host, v2, name, "--lazy-chunks", chunks)
        proxy = fault_proxy(registry)
        pulled, _ = pull(cache, f"{proxy.host}/delta/{name}")
        assert pulled["reused"] == reuse and sha256_file(Path(pulled["path"])) == sha256_file(v2), name
        assert blob_bytes(proxy) < 32 * MIB - reuse + 256 * KIB, name


def test_a_kernel_boot_image_is_assembled_with_its_other_files(tmp_path, registry, fault_proxy):
    """Files before and after the disk (kernelBoot's kernel and initrd, the TOC, the trailer) come
    from the head and tail members, inflated one after another: the diffID holds and the pull reuses."""
    v1, v2, _ = _disks(tmp_path)
    rng = random.Random(9)
    (tmp_path / "vmlinuz").write_bytes(rng.randbytes(300 * KIB))
    (tmp_path / "initrd").write_bytes(b"initrd " * 200000)
    files = ("--kernel", tmp_path / "vmlinuz", "--initrd", tmp_path / "initrd")
    ref1 = build(registry.host, v1, "kb:v1", *files)
    build(registry.host, v2, "kb:v2", *files)
    cache = tmp_path / "cache"
    pull(cache, ref1)
    proxy = fault_proxy(registry)
    second, _ = pull(cache, f"{proxy.host}/delta/kb:v2")
    changed = new_bytes(v1.read_bytes(), v2.read_bytes())
    assert sha256_file(Path(second["path"])) == sha256_file(v2) and second["reused"] == 32 * MIB - changed
    assert blob_bytes(proxy) < changed + 400 * KIB


def test_a_qcow2_rebuilt_with_qemu_img_convert_fetches_about_its_change(tmp_path, registry, fault_proxy):
    """v1 and v2 as `qemu-img convert -c -O qcow2` makes them from a guest with 1 MiB changed: every
    compressed cluster after the change lies at another, unaligned offset of v2's file. Content-defined
    chunks (the default) find them in v1: the pull fetches about the change; with fixed chunks
    (`--lazy-chunks fixed`, as before TOC v3) nearly every chunk after the change is new."""
    v1, v2 = rebuilt_qcow2_pair(tmp_path)
    changed = new_bytes(v1.read_bytes(), v2.read_bytes())
    assert changed < 2 * MIB < 10 * MIB < v2.stat().st_size
    fetched = {}
    for chunks in ("content", "fixed"):
        ref1 = build(registry.host, v1, f"rebuilt-{chunks}:v1", "--lazy-chunks", chunks)
        build(registry.host, v2, f"rebuilt-{chunks}:v2", "--lazy-chunks", chunks)
        cache = tmp_path / f"cache-{chunks}"
        pull(cache, ref1)
        proxy = fault_proxy(registry)
        pulled, _ = pull(cache, f"{proxy.host}/delta/rebuilt-{chunks}:v2")
        assert sha256_file(Path(pulled["path"])) == sha256_file(v2), chunks
        fetched[chunks] = blob_bytes(proxy)
        if chunks == "content":
            assert pulled["reused"] == v2.stat().st_size - changed
    layer = manifest_digest_layer(proxy, "rebuilt-fixed:v2")["size"]
    assert fetched["content"] < changed + 256 * KIB < layer // 4, fetched
    assert fetched["fixed"] > layer // 2, fetched

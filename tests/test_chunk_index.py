"""The chunk content hashes of lazy TOCs and the node's chunk index (issue 31): `diskkit build`
names every chunk by the BLAKE3 of its uncompressed bytes, older TOCs still say what they can, and
the index over the cache finds chunks across processes, survives being deleted or corrupted, and
never gives a chunk that does not hash right."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import random
import zlib
from pathlib import Path

import blake3
import pytest

from diskkit.errors import DiskkitError
from diskkit.layers import chunkcut, lazytoc
from launcher.chunks.index import CHUNKS_FILE, ChunkIndex, Place, Record
from launcher.chunks.source import LocalChunks
from launcher.node.cache import Cache
from tests.conftest import run, run_diskkit

MIB = 1 << 20
GZIP_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def _layout_toc(layout: Path) -> tuple[dict, bytes]:
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads((layout / "blobs/sha256" / index["manifests"][0]["digest"][7:]).read_text())
    layer = manifest["layers"][0]
    data = (layout / "blobs/sha256" / layer["digest"][7:]).read_bytes()
    notes = layer["annotations"]
    at, size = int(notes[lazytoc.ANNOTATION_TOC_OFFSET]), int(notes[lazytoc.ANNOTATION_TOC_SIZE])
    return layer, data[at : at + size]


def _toc(layout: Path, content: bytes) -> tuple[lazytoc.Toc, dict]:
    layer, stored = _layout_toc(layout)
    assert layer["mediaType"] == GZIP_LAYER
    doc = zlib.decompress(stored, 31)
    loc = lazytoc.TocLocation(int(layer["annotations"][lazytoc.ANNOTATION_TOC_OFFSET]), len(stored), "sha256:" + hashlib.sha256(doc).hexdigest())
    toc = lazytoc.parse(doc, loc, "here", lazytoc.VERSION_GZIP)
    assert lazytoc.parse(toc.render(), lazytoc.TocLocation(loc.offset, loc.size, "sha256:" + hashlib.sha256(toc.render()).hexdigest()), "here", 2) == toc
    return toc, json.loads(doc)


def test_build_names_each_chunk_by_its_uncompressed_blake3(tmp_path):
    """The TOC `diskkit build` writes (lazy v3) cuts the disk where its content says (chunkLengths,
    each at most chunkSize, the cutter's longest, adding up to the disk) and lists chunkBlake3s:
    BLAKE3-256 of each chunk's uncompressed bytes; content_hashes gives them."""
    rng = random.Random(31)
    content = rng.randbytes(2 * MIB) + bytes(MIB) + rng.randbytes(MIB // 2 + 4096)
    (tmp_path / "d.img").write_bytes(content)
    built = run_diskkit("build", tmp_path / "d.img", "-t", f"oci:{tmp_path / 'out'}:v3")
    assert built.code == 0, built.err
    toc, obj = _toc(tmp_path / "out", content)
    params = chunkcut.params_for(len(content))
    assert obj["version"] == 3 and obj["chunkSize"] == params.max == MIB and sum(obj[lazytoc.LENGTHS_FIELD]) == len(content)
    assert all(params.min <= n <= params.max for n in obj[lazytoc.LENGTHS_FIELD][:-1])
    # The cuts are FastCDC's over the whole disk, whatever pieces the build read it in.
    assert obj[lazytoc.LENGTHS_FIELD] == [c.length for c in params.chunker().cut_buf(content)]
    want = [blake3.blake3(content[start:end]).hexdigest() for start, end in map(toc.chunk_range, range(toc.count))]
    assert obj[lazytoc.CONTENT_FIELD] == want and toc.content_hashes == ("blake3", tuple(want))
    assert manifest_annotations(tmp_path / "out")[lazytoc.ANNOTATION_LAZY] == lazytoc.LAZY_VALUE_CDC


def test_fixed_chunks_are_still_written_on_request(tmp_path):
    """`--lazy-chunks fixed` writes the TOC v2 launchers before v3 read: 1 MiB chunks, the last one short."""
    rng = random.Random(31)
    content = rng.randbytes(2 * MIB) + bytes(MIB) + rng.randbytes(MIB // 2 + 4096)
    (tmp_path / "d.img").write_bytes(content)
    built = run_diskkit("build", "--lazy-chunks", "fixed", tmp_path / "d.img", "-t", f"oci:{tmp_path / 'out'}:v2")
    assert built.code == 0, built.err
    toc, obj = _toc(tmp_path / "out", content)
    want = [blake3.blake3(content[i : i + MIB]).hexdigest() for i in range(0, len(content), MIB)]
    assert obj["version"] == 2 and lazytoc.LENGTHS_FIELD not in obj and obj[lazytoc.CONTENT_FIELD] == want and len(want) == 4
    assert toc.content_hashes == ("blake3", tuple(want)) and toc.chunk_range(3) == (3 * MIB, len(content))
    assert manifest_annotations(tmp_path / "out")[lazytoc.ANNOTATION_LAZY] == lazytoc.LAZY_VALUE_GZIP
    refused = run_diskkit("build", "--lazy-chunks", "fixed", "--compression", "none", tmp_path / "d.img", "-t", f"oci:{tmp_path / 'none'}:v1")
    assert refused.code != 0 and "--lazy-chunks" in refused.err and len(refused.err.strip().splitlines()) == 1, refused.err


def test_the_cutter_cuts_a_stream_as_it_cuts_one_buffer():
    """The build reads a disk in pieces (recycled buffers): whatever their sizes, the chunks are the
    ones FastCDC cuts from the whole stream at once, the bytes are all there in order, and every
    piece goes back to its reader once the chunks cut from it are released."""
    rng = random.Random(9)
    params = chunkcut.Params(4096, 32768)
    for trial in range(150):
        n = rng.randrange(0, 300_000)
        data = (rng.randbytes(n), bytes(n), (rng.randbytes(50) * (n // 50 + 1))[:n])[trial % 3]  # random, zeros, a short period
        pieces, at = [], 0
        while at < n:
            size = rng.choice([1, 7, 4096, 5000, 32768, 65536, rng.randrange(1, 100_000)])
            pieces.append(memoryview(data)[at : at + size])
            at += size
        returned: list[int] = []
        cutter = chunkcut.Cutter(params)
        chunks, holds = [], []
        for i, piece in enumerate(pieces):
            for chunk, release in cutter.feed(piece, lambda i=i: returned.append(i)):
                chunks.append(bytes(chunk))
                holds.append(release)
        for chunk, release in cutter.finish():
            chunks.append(bytes(chunk))
            holds.append(release)
        assert b"".join(chunks) == data
        assert [len(c) for c in chunks] == ([c.length for c in params.chunker().cut_buf(data)] if data else []), trial
        for release in holds:
            if release is not None:
                release()
        assert sorted(returned) == list(range(len(pieces))), trial


def manifest_annotations(layout: Path) -> dict:
    index = json.loads((layout / "index.json").read_text())
    return json.loads((layout / "blobs/sha256" / index["manifests"][0]["digest"][7:]).read_text())["annotations"]


def rebuilt_qcow2_pair(tmp_path: Path) -> tuple[Path, Path]:
    """A guest rebuilt the usual way: v1 = `qemu-img convert -c -O qcow2` of a raw disk of text-like
    content; v2 = the same with 1 MiB changed, converted again, so every compressed cluster after the
    change sits at another, unaligned offset of the file (and the L2 table that points at them changed)."""
    rng = random.Random(42)
    table = bytes(b"etaoinshrdlucmfw"[b % 16] for b in range(256))  # 4 bits a byte: deflate keeps about 55 %
    raw = bytearray(rng.randbytes(24 * MIB).translate(table))
    (tmp_path / "v1.raw").write_bytes(raw)
    raw[5 * MIB : 6 * MIB] = rng.randbytes(MIB).translate(table)
    (tmp_path / "v2.raw").write_bytes(raw)
    for name in ("v1", "v2"):
        run("qemu-img", "convert", "-c", "-f", "raw", "-O", "qcow2", tmp_path / f"{name}.raw", tmp_path / f"{name}.qcow2")
    return tmp_path / "v1.qcow2", tmp_path / "v2.qcow2"


def _new_bytes(v1: lazytoc.Toc, v2: lazytoc.Toc) -> int:
    """The uncompressed bytes of v2's chunks whose content v1 has nowhere."""
    have = set(v1.content_hashes[1])
    return sum(end - start for i, (start, end) in enumerate(map(v2.chunk_range, range(v2.count))) if v2.content_hashes[1][i] not in have)


def test_a_run_of_bytes_that_moved_keeps_its_chunks(tmp_path):
    """After `qemu-img convert -c` the unchanged clusters of a rebuilt qcow2 are the same bytes at
    other offsets: content-defined chunks find them (what is new is the change, its neighbours and
    the qcow2 tables), where fixed 1 MiB windows lose everything after the change."""
    v1, v2 = rebuilt_qcow2_pair(tmp_path)
    tocs = {}
    for chunks in ("content", "fixed"):
        for disk in (v1, v2):
            out = tmp_path / f"{chunks}-{disk.stem}"
            built = run_diskkit("build", "--lazy-chunks", chunks, disk, "-t", f"oci:{out}:x")
            assert built.code == 0, built.err
            tocs[chunks, disk.stem] = _toc(out, disk.read_bytes())[0]
    size = v2.stat().st_size
    assert 10 * MIB < size < 16 * MIB
    assert _new_bytes(tocs["content", "v1"], tocs["content", "v2"]) < 2 * MIB  # the change is ~0.6 MiB as stored
    assert _new_bytes(tocs["fixed", "v1"], tocs["fixed", "v2"]) > size // 2


def test_content_defined_tocs_are_checked_before_they_are_used():
    """A v3 TOC's chunkLengths must be there, one per chunk, none empty or over chunkSize, adding up
    to the disk; a v2 TOC lists none. Each refused in one line."""
    v3 = _v2(chunk_size=8192, chunk_blake3s=("1" * 64, "2" * 64), chunk_lengths=(3000, 5192))
    obj = json.loads(v3.render())
    assert obj["version"] == 3 and _reparse(obj, 2) == v3 and _reparse(obj, 2).chunk_range(1) == (3000, 8192)
    assert _reparse(obj, 2).grid.index(2999) == 0 and _reparse(obj, 2).grid.index(3000) == 1
    for lengths, words in (([3000, 5000], "add up to 8000 bytes, not the disk's 8192"), ([3000], "1 chunk lengths for 2 chunks"),
                           ([0, 8192], "outside 1..8192"), ([8193, -1], "outside 1..8192"), (["3000", 5192], "not the JSON object")):
        with pytest.raises(DiskkitError, match=words):
            _reparse({**obj, lazytoc.LENGTHS_FIELD: lengths}, 2)
    with pytest.raises(DiskkitError, match="version 3 must list chunkLengths"):
        _reparse({**obj, lazytoc.LENGTHS_FIELD: None}, 2)
    with pytest.raises(DiskkitError, match="version 2 does not hold what that version lists"):
        _reparse({**obj, "version": 2}, 2)
    with pytest.raises(DiskkitError, match="version 3 is not supported in this layer"):
        _reparse(obj, 1)


def _v2(**extra) -> lazytoc.Toc:
    base = dict(disk="disk/a.img", offset=1536, size=8192, chunk_size=4096, chunks=None, members=((1024, 100), (1124, 100)),
                files=(), member_digests=("a" * 64, "b" * 64), member_hash="blake3")
    return lazytoc.Toc(**{**base, **extra})


def _reparse(toc_obj: dict, version: int, loc_offset: int = 4096):
    doc = json.dumps(toc_obj).encode()
    return lazytoc.parse(doc, lazytoc.TocLocation(loc_offset, 200, "sha256:" + hashlib.sha256(doc).hexdigest()), "here", version)


def test_older_tocs_stay_readable_and_say_what_they_can():
    """v1 TOCs and v2 TOCs from before `memberBlake3s` name chunks by sha256 (`chunks`); v2 TOCs with
    member pins only have nothing to match by; a chunkBlake3s that does not fit the disk is refused."""
    v1 = _reparse({"version": 1, "disk": "disk/a.img", "offset": 1536, "size": 8192, "chunkSize": 4096, "chunks": ["c" * 64, "d" * 64]}, 1, 20000)
    assert v1.content_hashes == ("sha256", ("c" * 64, "d" * 64))
    old_v2 = json.loads(_v2().render())
    old_v2.pop("memberBlake3s")
    old_v2["chunks"] = ["e" * 64, "f" * 64]
    assert _reparse(old_v2, 2).content_hashes == ("sha256", ("e" * 64, "f" * 64))
    pins_only = _reparse(json.loads(_v2().render()), 2)
    assert pins_only.content_hashes is None and lazytoc.CONTENT_FIELD not in json.loads(_v2().render())
    with_content = _v2(chunk_blake3s=("1" * 64, "2" * 64))
    assert _reparse(json.loads(with_content.render()), 2) == with_content
    for wrong in (["1" * 64], ["1" * 64, "2" * 63]):
        with pytest.raises(DiskkitError, match="chunkBlake3s|64 hex digits"):
            _reparse({**json.loads(with_content.render()), lazytoc.CONTENT_FIELD: wrong}, 2)
    with pytest.raises(DiskkitError, match="chunkBlake3s must list one hash per chunk of a gzip layer"):
        _reparse({"version": 1, "disk": "disk/a.img", "offset": 1536, "size": 8192, "chunkSize": 4096, "chunks": ["c" * 64] * 2,
                  lazytoc.CONTENT_FIELD: ["1" * 64] * 2}, 1, 20000)


def _disk(cache: Cache, name: str, content: bytes, record: bool = True) -> str:
    """A disk entry as install_disk leaves it, with (or, as older pulls left it, without) its chunks' record."""
    entry = cache.root / "disks" / "sha256" / hashlib.sha256(name.encode()).hexdigest() / "m"
    entry.mkdir(parents=True)
    (entry / "disk.img").write_bytes(content)
    if record:
        hexes = [blake3.blake3(content[i : i + MIB]).hexdigest() for i in range(0, len(content), MIB)]
        (entry / CHUNKS_FILE).write_bytes(Record("blake3", tuple(hexes), lazytoc.Grid(len(content), MIB)).render())
    return str((entry / "disk.img").relative_to(cache.root))


def _toc_of(content: bytes, hash_name: str = "blake3") -> lazytoc.Toc:
    hexes = tuple(lazytoc.content_hash(hash_name, content[i : i + MIB]) for i in range(0, len(content), MIB))
    count = len(hexes)
    if hash_name == "sha256":
        return lazytoc.Toc("disk/x", 1536, len(content), MIB, hexes)
    return lazytoc.Toc("disk/x", 1536, len(content), MIB, None, tuple((1024 + i, 1) for i in range(count)), (), ("0" * 64,) * count,
                       chunk_blake3s=hexes)


def test_index_finds_chunks_and_local_chunks_checks_them(tmp_path):
    """A chunk recorded for one file is found for another disk's TOC; a byte flipped in the file
    afterwards makes it unavailable (None) and drops the place; all-zero chunks need no file."""
    cache = Cache(tmp_path / "cache")
    rng = random.Random(7)
    a, b, c = rng.randbytes(MIB), rng.randbytes(MIB), rng.randbytes(MIB)
    index = ChunkIndex(cache)
    rel = _disk(cache, "v1", a + b + c[:1000])
    assert set(index.paths()) == {rel}  # a fresh index is rebuilt from the disks' records
    v2 = b + bytes(MIB) + rng.randbytes(MIB) + a
    local = LocalChunks(index, cache, _toc_of(v2))
    assert local.get(0) == b and local.get(1) == bytes(MIB) and local.get(2) is None and local.get(3) == a
    assert local.reused == 3 * MIB
    assert index.lookup("blake3", blake3.blake3(a).hexdigest()) == [Place(rel, 0, MIB)]
    with open(cache.root / rel, "r+b") as f:
        f.seek(5)
        f.write(bytes([a[5] ^ 1]))
    fresh = LocalChunks(index, cache, _toc_of(v2))
    assert fresh.get(3) is None and fresh.stale == 1 and index.lookup("blake3", blake3.blake3(a).hexdigest()) == []
    assert fresh.get(0) == b  # the file's other chunks are still good
    index.forget(rel)
    assert index.paths() == [] and LocalChunks(index, cache, _toc_of(v2)).get(0) is None
    # TOCs naming chunks by sha256 (v1) are matched against places recorded by sha256.
    index.add_file(rel, Record("sha256", tuple(hashlib.sha256(x).hexdigest() for x in (a, b, c[:1000])), lazytoc.Grid(2 * MIB + 1000, MIB)))
    assert LocalChunks(index, cache, _toc_of(b + c[:1000], "sha256")).get(0) == b


def test_local_chunks_follow_no_link(tmp_path):
    """A place whose path turned into a symbolic link (to a file holding the right bytes) gives nothing."""
    cache = Cache(tmp_path / "cache")
    a = random.Random(3).randbytes(MIB)
    rel = _disk(cache, "v1", a)
    index = ChunkIndex(cache)
    target = tmp_path / "elsewhere.img"
    target.write_bytes(a)
    disk = cache.root / rel
    disk.unlink()
    disk.symlink_to(target)
    assert LocalChunks(index, cache, _toc_of(a)).get(0) is None
    (disk.parent).rename(disk.parent.with_name("gone"))
    disk.parent.symlink_to(target.parent)
    assert LocalChunks(index, cache, _toc_of(a)).get(0) is None


def test_index_is_rebuilt_when_missing_or_corrupt(tmp_path):
    """Deleted or overwritten with garbage, the index comes back from the disks: recorded hashes
    where install left them, the disk cut and hashed as new TOCs cut it where an older pull left
    none, or left fixed chunks' (as TOCs before v3 cut them): both are found."""
    cache = Cache(tmp_path / "cache")
    rng = random.Random(11)
    a, b = rng.randbytes(MIB + 10), rng.randbytes(2 * MIB)
    ra, rb = _disk(cache, "a", a), _disk(cache, "b", b, record=False)
    index = ChunkIndex(cache)
    assert sorted(index.paths()) == sorted([ra, rb])
    index.close()
    db = cache.root / "chunks" / "index.sqlite"
    for suffix in ("-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    db.write_bytes(b"this is not a database" * 1000)
    again = ChunkIndex(cache)
    for rel, data in ((ra, a), (rb, b)):
        params = chunkcut.params_for(len(data))
        for cut in params.chunker().cut_buf(data):
            assert Place(rel, cut.offset, cut.length) in again.lookup("blake3", blake3.blake3(cut.data).hexdigest())
    assert again.lookup("blake3", blake3.blake3(a[MIB:]).hexdigest()) == [Place(ra, MIB, 10)]  # a's recorded fixed chunks'
    assert again.lookup("blake3", blake3.blake3(b[MIB:]).hexdigest()) == []  # b had no record: cut by content only
    again.close()
    db.unlink()
    assert sorted(ChunkIndex(cache).paths()) == sorted([ra, rb])
    assert ChunkIndex(cache).rebuild() == 2


def _writer(root: str, worker: int, files: int) -> None:
    index = ChunkIndex(Cache(root))
    for n in range(files):
        hexes = [hashlib.sha256(f"{worker}-{n}-{i}".encode()).hexdigest() for i in range(64)]
        index.add_file(f"lazy/w{worker}/f{n}", Record("sha256", tuple(hexes), lazytoc.Grid(64 * 4096, 4096)))
        assert index.lookup("sha256", hexes[5]) == [Place(f"lazy/w{worker}/f{n}", 5 * 4096, 4096)]
        if n % 2:
            index.forget(f"lazy/w{worker}/f{n}")


def test_index_is_shared_by_concurrent_processes(tmp_path):
    """Four processes add, look up and forget at once: no 'database is locked', nothing lost."""
    cache = Cache(tmp_path / "cache")
    ChunkIndex(cache).paths()
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(cache.root), w, 30)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0] * 4
    assert sorted(ChunkIndex(cache).paths()) == sorted(f"lazy/w{w}/f{n}" for w in range(4) for n in range(0, 30, 2))
    assert os.stat(cache.root / "chunks").st_mode & 0o077 == 0

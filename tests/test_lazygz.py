"""Lazy gzip images (`diskkit build --lazy`): a gzip layer of one member per disk chunk, the chunks
cut where their content says (TOC v3, the default) or every MiB (TOC v2, `--lazy-chunks fixed`, as
diskkit wrote them before). The layer is taken apart with zlib alone, unpacked by skopeo+umoci,
podman, buildah and docker 20.10, pulled whole by `launcher pull`, and served chunk by chunk by the
disk server, which refuses a corrupted member (fault proxy) and fetches it again. TOCs as older
diskkit wrote them (fixed chunks, sha256 or uncompressed pins) still verify and are served."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import random
import shutil
import subprocess
import tarfile
import zlib
from pathlib import Path

import blake3
import pytest

from diskkit.layers import lazytoc
from tests.conftest import run, run_diskkit, run_launcher
from tests.engines import podman_env
from tests.faultproxy import Fault
from tests.lazyhost import (
    build_lazy_image,
    control,
    disk_server,
    export_status,
    image_toc,
    open_export,
    wait_for,
)

NOREG = "--tls-verify=false"
MIB = 1 << 20
GZIP_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


@pytest.fixture(scope="module")
def disk(tmp_path_factory) -> Path:
    """24 chunks: compressible text, 6 MiB of zeros (holes in a sparse file), random bytes, a short last chunk."""
    rng = random.Random(5)
    words = [bytes(rng.choices(b"abcdefghij klmnop", k=rng.randint(2, 9))) for _ in range(500)]
    text = b" ".join(rng.choices(words, k=3 << 20))[: 8 * MIB]
    out = tmp_path_factory.mktemp("lazygz") / "guest.img"
    out.write_bytes(text + bytes(6 * MIB) + rng.randbytes(9 * MIB + 12345))
    return out


@pytest.fixture(scope="module")
def layout(tmp_path_factory, disk) -> Path:
    out = tmp_path_factory.mktemp("lazygz-layout") / "layout"
    built = run_diskkit("build", "--lazy", disk, "-t", f"oci:{out}:v2")
    assert built.code == 0, built.err
    return out


@pytest.fixture(scope="module")
def layout_v2(tmp_path_factory, disk) -> Path:
    """The disk in 1 MiB chunks (TOC v2), as diskkit wrote every lazy gzip layer before TOC v3."""
    out = tmp_path_factory.mktemp("lazygz-layout-v2") / "layout"
    built = run_diskkit("build", "--lazy", "--lazy-chunks", "fixed", disk, "-t", f"oci:{out}:v2")
    assert built.code == 0, built.err
    return out


def chunk_ranges(toc: dict) -> list[tuple[int, int]]:
    """Each chunk's [start, end) in the disk, from a TOC's JSON (fixed or content-defined chunks)."""
    grid = lazytoc.Grid(toc["size"], toc["chunkSize"], tuple(toc[lazytoc.LENGTHS_FIELD]) if lazytoc.LENGTHS_FIELD in toc else None)
    return [grid.range(i) for i in range(grid.count)]


def blob(layout: Path, digest: str) -> bytes:
    return (layout / "blobs" / "sha256" / digest.removeprefix("sha256:")).read_bytes()


def manifest_of(layout: Path) -> dict:
    index = json.loads((layout / "index.json").read_text())
    return json.loads(blob(layout, index["manifests"][0]["digest"]))


@pytest.mark.parametrize("version", [3, 2])
def test_lazy_layer_is_one_gzip_member_per_chunk(tmp_path, layout, layout_v2, disk, version):
    layout = layout if version == 3 else layout_v2
    manifest = manifest_of(layout)
    assert manifest["annotations"][lazytoc.ANNOTATION_LAZY] == f"toc-v{version}"
    (layer,) = manifest["layers"]
    assert layer["mediaType"] == GZIP_LAYER
    data = blob(layout, layer["digest"])
    config = json.loads(blob(layout, manifest["config"]["digest"]))
    tar_bytes = gzip.decompress(data)  # concatenated members read as one gzip stream
    whole = bytearray()
    rest = data
    while rest:  # every member read alone, as a reader of one chunk reads it
        inflater = zlib.decompressobj(31)
        whole += inflater.decompress(rest)
        assert inflater.eof
        rest = inflater.unused_data
    assert bytes(whole) == tar_bytes
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(tar_bytes).hexdigest()]

    # The annotations pin the TOC's own member; the TOC pins each chunk's member.
    notes = layer["annotations"]
    at, size = int(notes[lazytoc.ANNOTATION_TOC_OFFSET]), int(notes[lazytoc.ANNOTATION_TOC_SIZE])
    doc = zlib.decompress(data[at : at + size], 31)
    assert "sha256:" + hashlib.sha256(doc).hexdigest() == notes[lazytoc.ANNOTATION_TOC_DIGEST]
    toc = json.loads(doc)
    content = disk.read_bytes()
    assert toc["version"] == version and toc["disk"] == f"disk/{disk.name}" and toc["size"] == len(content) and toc["chunkSize"] == MIB
    assert tar_bytes[toc["offset"] : toc["offset"] + toc["size"]] == content
    # Chunks are pinned by their members as stored (BLAKE3), never by their uncompressed bytes (the old `chunks`).
    ranges = chunk_ranges(toc)
    assert "chunks" not in toc and "memberDigests" not in toc and len(toc["members"]) == len(toc["memberBlake3s"]) == len(ranges)
    assert len(ranges) == 24 if version == 2 else len(ranges) > 24  # text and random bytes: chunks of about 190 KiB
    for index, ((offset, length), digest, (start, end)) in enumerate(zip(toc["members"], toc["memberBlake3s"], ranges)):
        inflater = zlib.decompressobj(31)
        chunk = inflater.decompress(data[offset : offset + length])
        assert inflater.eof and not inflater.unused_data, index  # exactly one member
        assert chunk == content[start:end] and blake3.blake3(data[offset : offset + length]).hexdigest() == digest
        assert toc[lazytoc.CONTENT_FIELD][index] == blake3.blake3(chunk).hexdigest()  # and by its content (issue 31)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        assert [m.name for m in tar] == ["disk", f"disk/{disk.name}", ".diskkit", ".diskkit/lazy-toc.json"]
    # Compressed after all: the text and the zeros shrink, the random chunks stay.
    assert len(data) < len(content) * 0.75
    verified = run_diskkit("verify", f"oci:{layout}:v2")
    assert verified.code == 0, verified.err
    again = run_diskkit("build", "--lazy", *(["--lazy-chunks", "fixed"] if version == 2 else []), disk, "-t", f"oci:{tmp_path / 'again'}:v2")
    assert again.last_line == json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]  # reproducible


def forged(tmp_path: Path, layout: Path, name: str, change) -> Path:
    """A copy of `layout` whose TOC `change(toc, data)` edited, re-pinned all the way up (see rewrite_toc)."""
    out = tmp_path / name
    shutil.copytree(layout, out)
    manifest = manifest_of(out)
    data = blob(out, manifest["layers"][0]["digest"])
    notes = manifest["layers"][0]["annotations"]
    at, size = int(notes[lazytoc.ANNOTATION_TOC_OFFSET]), int(notes[lazytoc.ANNOTATION_TOC_SIZE])
    doc = zlib.decompress(data[at : at + size], 31)
    toc = json.loads(doc)
    change(toc, data)
    new = json.dumps(toc, separators=(",", ":"), sort_keys=True).encode()
    # The tar header before the TOC keeps its size: a shorter TOC is padded with JSON whitespace.
    assert len(new) <= len(doc), "a forged TOC may not be longer than the original"
    rewrite_toc(out, manifest, data, at, size, new + b" " * (len(doc) - len(new)))
    return out


def old_pins(toc: dict, data: bytes) -> None:
    """The TOC as diskkit wrote it before member pins: each chunk pinned by its uncompressed bytes."""
    pins = toc.pop("memberBlake3s")
    toc.pop(lazytoc.CONTENT_FIELD)  # written since issue 31
    toc["chunks"] = []
    for (at, length), pin in zip(toc["members"], pins):
        assert blake3.blake3(data[at : at + length]).hexdigest() == pin
        toc["chunks"].append(hashlib.sha256(zlib.decompress(data[at : at + length], 31)).hexdigest())


def sha256_pins(toc: dict, data: bytes) -> None:
    """The TOC as diskkit wrote it before BLAKE3: each member pinned by its sha256 (memberDigests)."""
    toc.pop("memberBlake3s")
    toc.pop(lazytoc.CONTENT_FIELD)
    toc["memberDigests"] = [hashlib.sha256(data[at : at + length]).hexdigest() for at, length in toc["members"]]


def test_verify_refuses_a_toc_that_disagrees_with_the_layer(tmp_path, layout_v2):
    """The TOC is checked against the layer verify unpacks: a member digest changed (and the TOC
    re-pinned) is named while the blob streams; so is an uncompressed chunk digest in an old TOC."""
    layout = layout_v2

    def wrong_member(toc, data):
        toc["memberBlake3s"][3] = "0" * 64

    def wrong_sha256_member(toc, data):
        sha256_pins(toc, data)
        toc["memberDigests"][3] = "0" * 64

    def wrong_chunk(toc, data):
        old_pins(toc, data)
        toc["chunks"][3] = "0" * 64

    for name, change in (("member", wrong_member), ("sha256-member", wrong_sha256_member)):
        refused = run_diskkit("verify", f"oci:{forged(tmp_path, layout, name, change)}:v2")
        assert refused.code != 0 and "chunk 3's gzip member at" in refused.err and "does not match its digest in the lazy TOC" in refused.err, refused.err
    accepted = run_diskkit("verify", f"oci:{forged(tmp_path, layout, 'sha256', sha256_pins)}:v2")
    assert accepted.code == 0, accepted.err  # TOCs written before BLAKE3 still verify
    refused = run_diskkit("verify", f"oci:{forged(tmp_path, layout, 'chunk', wrong_chunk)}:v2")
    assert refused.code != 0 and "lazy TOC's digest of chunk 3 does not match" in refused.err, refused.err


def test_a_toc_pins_chunks_one_way_only():
    """A TOC holding two kinds of pins, or none, is refused: which one a reader trusts would be ambiguous."""
    for member_hash, field in (("blake3", "memberBlake3s"), ("sha256", "memberDigests")):
        toc = lazytoc.Toc("disk/a.img", 1536, 8192, 4096, None, ((1024, 100), (1124, 100)), (), ("a" * 64, "b" * 64), member_hash)
        doc = toc.render()
        assert json.loads(doc)[field] == ["a" * 64, "b" * 64] and set(json.loads(doc)) & {"chunks", "memberBlake3s", "memberDigests"} == {field}
        loc = lazytoc.TocLocation(4096, 200, "sha256:" + hashlib.sha256(doc).hexdigest())
        assert lazytoc.parse(doc, loc, "here", lazytoc.VERSION_GZIP) == toc
    for name, change in (("chunks too", {"chunks": ["c" * 64] * 2}), ("both member pins", {"memberBlake3s": ["c" * 64] * 2}), ("neither", {"memberDigests": None})):
        obj = {**json.loads(doc), **change}
        forged_doc = json.dumps({k: v for k, v in obj.items() if v is not None}).encode()
        with pytest.raises(lazytoc.DiskkitError, match="exactly one of chunks .uncompressed., memberBlake3s and memberDigests"):
            lazytoc.parse(forged_doc, lazytoc.TocLocation(4096, 200, "sha256:" + hashlib.sha256(forged_doc).hexdigest()), "here", 2)


def test_verify_checks_the_files_the_toc_pins(tmp_path, disk):
    """kernelBoot's kernel and initrd, pinned in the TOC's `files`: a wrong digest there is refused."""
    (tmp_path / "vmlinuz").write_bytes(b"kernel " * 1000)
    (tmp_path / "initrd").write_bytes(b"initrd " * 1000)
    out = tmp_path / "kb"
    built = run_diskkit("build", "--lazy", disk, "--kernel", tmp_path / "vmlinuz", "--initrd", tmp_path / "initrd", "-t", f"oci:{out}:v2")
    assert built.code == 0, built.err
    verified = run_diskkit("verify", f"oci:{out}:v2")
    assert verified.code == 0, verified.err

    def wrong_kernel(toc, data):
        assert toc["files"]["boot/vmlinuz"] == hashlib.sha256(b"kernel " * 1000).hexdigest()
        toc["files"]["boot/vmlinuz"] = hashlib.sha256(b"another kernel").hexdigest()

    refused = run_diskkit("verify", f"oci:{forged(tmp_path, out, 'wrongkernel', wrong_kernel)}:v2")
    assert refused.code != 0 and "/boot/vmlinuz does not match its digest in the lazy TOC's files" in refused.err, refused.err
    # Same length as the original TOC (the tar header before it keeps its size): the kernel listed under another name.
    missing = forged(tmp_path, out, "missing", lambda toc, data: toc["files"].update({"boot/vmlinux": toc["files"].pop("boot/vmlinuz")}))
    refused = run_diskkit("verify", f"oci:{missing}:v2")
    assert refused.code != 0 and "files list /boot/vmlinux, which is not a regular file of this layer" in refused.err, refused.err


def rewrite_toc(layout: Path, manifest: dict, data: bytes, at: int, size: int, doc: bytes) -> None:
    """A forged layer: the TOC member replaced, every digest on the way up recomputed (a consistent lie)."""
    member = gzip.compress(doc, mtime=0)
    new = data[:at] + member + data[at + size :]
    digest = "sha256:" + hashlib.sha256(new).hexdigest()
    (layout / "blobs" / "sha256" / digest[7:]).write_bytes(new)
    layer = manifest["layers"][0]
    layer.update(digest=digest, size=len(new))
    layer["annotations"][lazytoc.ANNOTATION_TOC_SIZE] = str(len(member))
    layer["annotations"][lazytoc.ANNOTATION_TOC_DIGEST] = "sha256:" + hashlib.sha256(doc).hexdigest()
    rewrite_config(layout, manifest, "sha256:" + hashlib.sha256(gzip.decompress(new)).hexdigest())


def rewrite_config(layout: Path, manifest: dict, diff_id: str) -> None:
    """The config's diffID set, the config, manifest and index digests recomputed."""
    config = json.loads(blob(layout, manifest["config"]["digest"]))
    config["rootfs"]["diff_ids"] = [diff_id]
    cbytes = json.dumps(config, separators=(",", ":"), sort_keys=True).encode()
    (layout / "blobs" / "sha256" / hashlib.sha256(cbytes).hexdigest()).write_bytes(cbytes)
    manifest["config"].update(digest="sha256:" + hashlib.sha256(cbytes).hexdigest(), size=len(cbytes))
    mbytes = json.dumps(manifest, separators=(",", ":"), sort_keys=True).encode()
    (layout / "blobs" / "sha256" / hashlib.sha256(mbytes).hexdigest()).write_bytes(mbytes)
    index = json.loads((layout / "index.json").read_text())
    index["manifests"][0].update(digest="sha256:" + hashlib.sha256(mbytes).hexdigest(), size=len(mbytes))
    (layout / "index.json").write_text(json.dumps(index))


def test_peers_unpack_the_lazy_layer_byte_identical(tmp_path, layout, disk, registry, dockerd):
    content_digest = hashlib.sha256(disk.read_bytes()).hexdigest()
    inside = f"disk/{disk.name}"

    def same(path: Path) -> bool:
        return hashlib.sha256(path.read_bytes()).hexdigest() == content_digest

    # skopeo copies it (blobs as they are), umoci unpacks the copy.
    copied = tmp_path / "copied"
    run("skopeo", "copy", f"oci:{layout}:v2", f"oci:{copied}:v2")
    run("umoci", "unpack", "--rootless", "--image", f"{copied}:v2", tmp_path / "bundle")
    assert same(tmp_path / "bundle" / "rootfs" / inside)

    # podman and buildah, each into a private vfs store, from an oci-archive made by skopeo.
    archive = tmp_path / "v2.tar"
    run("skopeo", "copy", f"oci:{layout}:v2", f"oci-archive:{archive}:v2")
    for tool in ("podman", "buildah"):
        store = tmp_path / f"store-{tool}"
        store.mkdir()
        env = {**os.environ, **podman_env(store), "STORAGE_DRIVER": "vfs"}
        image = run(tool, "pull", "-q", f"oci-archive:{archive}", env=env).stdout.strip().splitlines()[-1]
        if tool == "podman":
            mounted = run("podman", "image", "mount", image, env=env).stdout.strip()
        else:
            container = run("buildah", "from", "-q", image, env=env).stdout.strip()
            mounted = run("buildah", "mount", container, env=env).stdout.strip()
        assert same(Path(mounted) / inside), tool

    # docker 20.10 pulls it from the loopback registry and hands the file back from a created container.
    remote = f"{registry.host}/lazygz/peer:v2"
    assert run_diskkit("push", NOREG, f"oci:{layout}:v2", remote).code == 0
    client = dockerd.client()
    client.images.pull(remote)
    container = client.containers.create(remote, command=["/none"])
    try:
        stream, _ = container.get_archive(f"/{inside}")
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            got = tar.extractfile(disk.name).read()
        assert hashlib.sha256(got).hexdigest() == content_digest
    finally:
        container.remove()


@pytest.fixture(scope="module")
def remote(registry, disk) -> str:
    return build_lazy_image(disk, f"{registry.host}/lazygz/guest:v2")


def test_served_chunk_by_chunk_then_installed_without_a_second_fetch(tmp_path, registry, remote, disk):
    cache = tmp_path / "cache"
    cache.mkdir()
    toc = image_toc(registry, remote)
    with disk_server(cache, "--prefetch-rate", "2M"):
        answer = open_export(cache, remote)
        url, name = answer["url"], answer["export"]
        assert export_status(cache, name)["present"] < len(toc["members"])  # demand reads below fill the gaps
        assert run("qemu-img", "compare", "-f", "raw", "-F", "raw", url, disk).stdout.strip() == "Images are identical."
        # The fill's leftovers go just after the status says installed: both are waited for.
        members = cache / "lazy" / name / "members.gz"
        status = wait_for(lambda: (s := export_status(cache, name))["installed"] and not members.exists() and s, 120,
                          "the disk to be verified and installed, and the fetched members to go")
    assert status["verified"] and status["toc"] and status["stats"]["corrupt_chunks"] == 0
    assert status["stats"]["demand_fetches"] > 0
    # Each member travelled once, but the all-zero chunks' (the node needs no file to give zeros,
    # launcher.chunks.source): the disk was checked by the config's diffID.
    content = disk.read_bytes()
    zero = {i for i, (start, end) in enumerate(chunk_ranges(toc)) if content[start:end].count(0) == end - start}
    assert len(zero) >= 5 and status["stats"]["reused_chunks"] == len(zero)  # the 6 zero MiB: 1 MiB chunks, the longest
    assert status["stats"]["fetched_bytes"] == sum(length for i, (_, length) in enumerate(toc["members"]) if i not in zero)
    assert Path(status["installed"]).read_bytes() == disk.read_bytes()
    blob_gets = registry.log_text().count(f"/blobs/{answer['layer']}")
    pulled = run_launcher("pull", "--cache-dir", cache, NOREG, "--json", remote)
    assert pulled.code == 0, pulled.err
    assert json.loads(pulled.out)["path"] == status["installed"]
    assert registry.log_text().count(f"/blobs/{answer['layer']}") == blob_gets


def test_a_corrupted_member_is_refused_and_fetched_again(tmp_path, registry, fault_proxy, remote, disk):
    toc = image_toc(registry, remote)
    proxy = fault_proxy(registry)
    # One bit flipped inside chunk 0's member, in the first answer that carries it (the open's head of
    # the blob, asked for beside the TOC, or the header check's range).
    at, length = toc["members"][0]
    proxy.add(Fault("GET", r"/blobs/sha256:", "flip", times=1, byte=at + length // 2))
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache, "--prefetch-rate", "1K"):  # no prefetching: every chunk is read on demand
        answer = open_export(cache, remote.replace(registry.host, proxy.host))
        assert run("qemu-img", "compare", "-f", "raw", "-F", "raw", answer["url"], disk).stdout.strip() == "Images are identical."
        assert not proxy.pending  # the flip happened, and was never served
        # Installed follows verified (qemu-img's checks run in between): wait for both.
        status = wait_for(lambda: (s := export_status(cache, answer["export"]))["verified"] and s["installed"] and s, 120, "verification")
    assert status["stats"]["corrupt_chunks"] == 1 and status["stats"]["verify_attempts"] == 1, status
    assert status["installed"] and Path(status["installed"]).read_bytes() == disk.read_bytes()


def test_old_pins_are_still_served(tmp_path, registry, layout_v2, disk):
    """Images whose TOC pins chunks as diskkit wrote them before: by their uncompressed bytes
    (`chunks`, each chunk checked once inflated) and by their members' sha256 (`memberDigests`),
    verify and are served chunk by chunk."""
    for name, change, field in (("old", old_pins, "chunks"), ("sha256", sha256_pins, "memberDigests")):
        old = forged(tmp_path, layout_v2, name, change)
        assert run_diskkit("verify", f"oci:{old}:v2").code == 0
        ref = f"{registry.host}/lazygz/{name}:v2"
        assert run_diskkit("push", NOREG, f"oci:{old}:v2", ref).code == 0
        toc = image_toc(registry, ref)
        assert "memberBlake3s" not in toc and len(toc[field]) == 24
        cache = tmp_path / f"cache-{name}"
        cache.mkdir()
        with disk_server(cache, "--prefetch-rate", "1K"):
            answer = open_export(cache, ref)
            assert run("qemu-img", "compare", "-f", "raw", "-F", "raw", answer["url"], disk).stdout.strip() == "Images are identical."
            status = wait_for(lambda: (s := export_status(cache, answer["export"]))["verified"] and s["installed"] and s, 120, "verification")
        assert status["toc"] and status["stats"]["corrupt_chunks"] == 0 and status["stats"]["verify_attempts"] == 1, (name, status)


def test_a_member_corrupted_in_the_registry_is_named_by_verify_and_never_served(tmp_path, registry, disk):
    """One byte flipped in the member of the chunk at 5 MiB in the registry's storage: verify names that
    member (before the inflater sees it), and the disk server refuses it on every fetch."""
    own = tmp_path / "own.img"  # a blob of its own: the registry stores blobs once for every repository
    own.write_bytes(b"own" + disk.read_bytes()[3:])
    ref = f"{registry.host}/lazygz/corrupt:v2"
    assert run_diskkit("build", NOREG, "--lazy", own, "-t", ref).code == 0
    toc = image_toc(registry, ref)
    five = next(i for i, (start, end) in enumerate(chunk_ranges(toc)) if start <= 5 * MIB < end)
    at, length = toc["members"][five]
    layer = json.loads(run_diskkit("inspect", NOREG, "--json", ref).out)["layers"][0]["digest"]
    stored = registry.blob_data_path(layer)
    with open(stored, "r+b") as f:
        f.seek(at + length // 2)
        byte = f.read(1)
        f.seek(at + length // 2)
        f.write(bytes([byte[0] ^ 1]))
    refused = run_diskkit("verify", NOREG, ref)
    assert refused.code != 0 and f"chunk {five}'s gzip member at {at}+{length} does not match its digest in the lazy TOC" in refused.err, refused.err
    cache = tmp_path / "cache"
    cache.mkdir()
    # A read of a chunk that never verifies fails once the fetch timeout is spent: the shortest there is.
    with disk_server(cache, "--prefetch-rate", "1K", "--fetch-timeout", "1"):
        answer = open_export(cache, ref)
        good = subprocess.run(["qemu-io", "-r", "-f", "raw", "-c", f"read -P 0 {9 * MIB} 4K", answer["url"]], capture_output=True, text=True, timeout=120)
        assert good.returncode == 0 and "read 4096/4096 bytes" in good.stdout, good  # zeros, as built
        bad = subprocess.run(["qemu-io", "-r", "-f", "raw", "-c", f"read {5 * MIB} 4K", answer["url"]], capture_output=True, text=True, timeout=120)
        assert "Input/output error" in bad.stdout + bad.stderr, bad
        status = export_status(cache, answer["export"])
    assert status["stats"]["corrupt_chunks"] >= 1 and not status["verified"] and not status["installed"], status


def test_the_server_refuses_a_member_that_inflates_but_differs_from_its_pin(tmp_path, registry, layout_v2):
    """A sound gzip member whose digest is not the TOC's (the TOC re-pinned all the way up) is never
    inflated nor served: the gzip CRC alone would have let it through."""

    def wrong_member(toc, data):
        toc["memberBlake3s"][3] = "0" * 64

    def wrong_sha256_member(toc, data):
        sha256_pins(toc, data)
        toc["memberDigests"][3] = "0" * 64

    cache = tmp_path / "cache"
    cache.mkdir()
    refs = {}
    for name, change in (("wrongpin", wrong_member), ("wrongsha256pin", wrong_sha256_member)):
        refs[name] = f"{registry.host}/lazygz/{name}:v2"
        assert run_diskkit("push", NOREG, f"oci:{forged(tmp_path, layout_v2, name, change)}:v2", refs[name]).code == 0
    with disk_server(cache, "--prefetch-rate", "1K", "--fetch-timeout", "1"):  # the bad read's wait: the shortest
        exports = set()
        for name, ref in refs.items():  # two exports (their TOCs, so their blobs, differ), each with its own stats
            answer = open_export(cache, ref)
            exports.add(answer["export"])
            bad = subprocess.run(["qemu-io", "-r", "-f", "raw", "-c", f"read {3 * MIB} 4K", answer["url"]], capture_output=True, text=True, timeout=120)
            assert "Input/output error" in bad.stdout + bad.stderr, (name, bad)
            status = export_status(cache, answer["export"])
            assert status["stats"]["corrupt_chunks"] >= 1 and not status["installed"], (name, status)
    assert len(exports) == 2


def test_launcher_pull_takes_a_lazy_image_whole(tmp_path, remote, disk):
    pulled = run_launcher("pull", "--cache-dir", tmp_path / "cache", NOREG, "--json", remote)
    assert pulled.code == 0, pulled.err
    assert Path(json.loads(pulled.out)["path"]).read_bytes() == disk.read_bytes()


def test_the_server_refuses_a_toc_it_cannot_rely_on_and_a_wrong_diffid(tmp_path, registry, disk):
    """Members not back to back are refused at open, in one line; a config whose diffID is not the
    layer's is found once the disk is complete: nothing is installed, as a pull would refuse it."""
    out = tmp_path / "layout"
    assert run_diskkit("build", "--lazy", disk, "-t", f"oci:{out}:v2").code == 0
    manifest = manifest_of(out)
    data = blob(out, manifest["layers"][0]["digest"])
    notes = manifest["layers"][0]["annotations"]
    at, size = int(notes[lazytoc.ANNOTATION_TOC_OFFSET]), int(notes[lazytoc.ANNOTATION_TOC_SIZE])
    toc = json.loads(zlib.decompress(data[at : at + size], 31))
    toc["members"][2][0] += 1  # a gap between members 1 and 2
    doc = json.dumps(toc, separators=(",", ":"), sort_keys=True).encode()
    gapped = tmp_path / "gapped"
    shutil.copytree(out, gapped)
    rewrite_toc(gapped, json.loads(json.dumps(manifest)), data, at, size, doc)
    wrong = tmp_path / "wrong"
    shutil.copytree(out, wrong)
    rewrite_config(wrong, json.loads(json.dumps(manifest)), "sha256:" + "1" * 64)
    refs = {}
    for name, layout in (("gapped", gapped), ("wrong", wrong)):
        refs[name] = f"{registry.host}/lazygz/{name}:v2"
        assert run_diskkit("push", NOREG, f"oci:{layout}:v2", refs[name]).code == 0
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        refused = control(cache, {"op": "open", "image": refs["gapped"], "registry": {"tls_verify": False}})
        assert not refused["ok"] and "lazy TOC's gzip members are not back to back" in refused["error"], refused
        answer = open_export(cache, refs["wrong"])
        status = wait_for(lambda: (s := export_status(cache, answer["export"]))["failed"] and s, 120, "the diffID check")
    assert "not the config's diffID sha256:11111111111" in status["failed"] and not status["installed"], status


def test_a_re_encoded_copy_drops_the_toc_annotations(tmp_path, layout, disk):
    """The TOC's offsets are offsets in this blob: a copy that recompresses the layer keeps the TOC
    member inside (it is part of the tar) but not the annotations that would point into the old blob."""
    copied = tmp_path / "zstd"
    result = run_diskkit("copy", "--dest-compress-format", "zstd", f"oci:{layout}:v2", f"oci:{copied}:v2")
    assert result.code == 0, result.err
    (layer,) = manifest_of(copied)["layers"]
    assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar+zstd"
    assert not any(k.startswith("io.diskkit.lazy.toc.") for k in layer.get("annotations", {})), layer
    verified = run_diskkit("verify", f"oci:{copied}:v2")
    assert verified.code == 0, verified.err

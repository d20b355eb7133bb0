"""Lazy images (v1: uncompressed, `--lazy --compression none`; gzip, v2 and v3, in test_lazygz.py) and the disk server, without a VM: the layer format against real OCI tools, the NBD
export against real NBD clients (qemu-img, nbdinfo, nbdcopy), chunk verification with a fault proxy
flipping bytes in range responses, --strict, and the hand-over to the normal disk store."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest
import requests

from diskkit.layers import lazytoc
from tests.conftest import make_qcow2, run, run_diskkit, run_launcher
from tests.faultproxy import Fault
from tests.imagecraft import Member, dir_, write_layout
from tests.lazyhost import (
    control,
    disk_server,
    export_status,
    open_export,
    random_disk,
    wait_for,
)

NOREG = "--tls-verify=false"
MIB = 1 << 20


@pytest.fixture(scope="module")
def guest_raw(tmp_path_factory) -> Path:
    """A 24 MiB raw disk of random bytes: 24 chunks, enough to see some missing."""
    return random_disk(tmp_path_factory.mktemp("lazy") / "guest-24m.img", 24 * MIB)


def layout_blobs(layout: Path) -> dict:
    index = json.loads((layout / "index.json").read_text())
    manifest = json.loads((layout / "blobs" / "sha256" / index["manifests"][0]["digest"][7:]).read_bytes())
    return manifest


def test_lazy_layer_is_an_ordinary_oci_image(tmp_path, guest_raw):
    layout = tmp_path / "layout"
    built = run_diskkit("build", "--lazy", "--compression", "none", "--json", guest_raw, "-t", f"oci:{layout}:v1")
    assert built.code == 0, built.err
    manifest = layout_blobs(layout)
    assert manifest["annotations"][lazytoc.ANNOTATION_LAZY] == lazytoc.LAZY_VALUE
    (layer,) = manifest["layers"]
    assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar"
    blob = layout / "blobs" / "sha256" / layer["digest"][7:]
    config = json.loads((layout / "blobs" / "sha256" / manifest["config"]["digest"][7:]).read_bytes())
    assert config["rootfs"]["diff_ids"] == [layer["digest"]]  # uncompressed: the blob is its own diffID

    # The TOC is where the annotations say, pinned by digest, and describes the disk bytes exactly.
    notes = layer["annotations"]
    data = blob.read_bytes()
    toc_bytes = data[int(notes[lazytoc.ANNOTATION_TOC_OFFSET]) :][: int(notes[lazytoc.ANNOTATION_TOC_SIZE])]
    assert "sha256:" + hashlib.sha256(toc_bytes).hexdigest() == notes[lazytoc.ANNOTATION_TOC_DIGEST]
    toc = json.loads(toc_bytes)
    disk = guest_raw.read_bytes()
    assert toc["disk"] == f"disk/{guest_raw.name}" and toc["size"] == len(disk) and toc["chunkSize"] == MIB
    assert data[toc["offset"] : toc["offset"] + toc["size"]] == disk
    assert toc["chunks"] == [hashlib.sha256(disk[i : i + MIB]).hexdigest() for i in range(0, len(disk), MIB)]
    with tarfile.open(blob) as tar:
        assert [m.name for m in tar] == ["disk", f"disk/{guest_raw.name}", ".diskkit", ".diskkit/lazy-toc.json"]

    # Every other client consumes it as usual: skopeo copies it, umoci unpacks it, diskkit verifies it.
    copied = tmp_path / "copied"
    run("skopeo", "copy", f"oci:{layout}:v1", f"oci:{copied}:v1")
    run("umoci", "unpack", "--rootless", "--image", f"{copied}:v1", tmp_path / "bundle")
    assert (tmp_path / "bundle" / "rootfs" / "disk" / guest_raw.name).read_bytes() == disk
    verified = run_diskkit("verify", f"oci:{copied}:v1")
    assert verified.code == 0, verified.err
    # Reproducible, like every build.
    again = run_diskkit("build", "--lazy", "--compression", "none", guest_raw, "-t", f"oci:{tmp_path / 'again'}:v1")
    assert again.last_line == json.loads(built.out)["digest"]


def test_lazy_refuses_what_it_cannot_make(tmp_path, guest_raw):
    zstd = run_diskkit("build", "--lazy", "--compression", "zstd", guest_raw, "-t", f"oci:{tmp_path / 'l'}:v1")
    assert zstd.code != 0 and "gzip or an uncompressed layer" in zstd.err and "zstd" in zstd.err
    assert not (tmp_path / "l").exists()
    docker = run_diskkit("build", "--lazy", guest_raw, "-t", f"docker-archive:{tmp_path / 'd.tar'}")
    assert docker.code != 0 and "annotations" in docker.err
    assert not (tmp_path / "d.tar").exists()


@pytest.fixture(scope="module")
def lazy_image(registry, guest_raw) -> str:
    ref = f"{registry.host}/lazy/guest:toc"
    result = run_diskkit("build", NOREG, "--lazy", "--compression", "none", guest_raw, "-t", ref)
    assert result.code == 0, result.err
    return ref


@pytest.fixture(scope="module")
def plain_image(registry, guest_raw) -> str:
    """Seekable but without a TOC: `--compression none`, as any uncompressed single-layer image."""
    ref = f"{registry.host}/lazy/guest:plain"
    result = run_diskkit("build", NOREG, "--compression", "none", guest_raw, "-t", ref)
    assert result.code == 0, result.err
    return ref


def nbd_bytes(url: str, out: Path) -> bytes:
    run("nbdcopy", url, out)
    return out.read_bytes()


def test_export_is_the_disk_for_real_nbd_clients_then_joins_the_cache(tmp_path, lazy_image, guest_raw, registry):
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache, "--prefetch-rate", "2M"):
        answer = open_export(cache, lazy_image)
        url, name = answer["url"], answer["export"]
        listing = run("nbdinfo", "--list", url).stdout
        assert f'export="{name}"' in listing and "is_read_only: true" in listing and f"export-size: {24 * MIB}" in listing
        # Read before the prefetcher (2 MiB/s) could have fetched it all: demand reads fill the gaps.
        assert export_status(cache, name)["present"] < 24
        assert run("qemu-img", "compare", "-f", "raw", "-F", "raw", url, guest_raw).stdout.strip() == "Images are identical."
        status = wait_for(lambda: (s := export_status(cache, name))["installed"] and s, 120, "the disk to be verified and installed")
        assert status["verified"] and status["toc"] and status["present"] == 24 and status["stats"]["corrupt_chunks"] == 0
        assert status["stats"]["demand_fetches"] > 0
        # Still served from the same file, now in the disk store.
        assert nbd_bytes(url, tmp_path / "copy.img") == guest_raw.read_bytes()
    installed = Path(status["installed"])
    assert installed.read_bytes() == guest_raw.read_bytes()
    assert not (cache / "lazy" / name / "disk.img").exists()
    # `launcher pull` of the same image finds the disk: no second download of the layer.
    blob_gets = registry.log_text().count(f"/blobs/{answer['layer']}")
    pulled = run_launcher("pull", "--cache-dir", cache, NOREG, "--json", lazy_image)
    assert pulled.code == 0, pulled.err
    assert json.loads(pulled.out)["path"] == str(installed)
    assert registry.log_text().count(f"/blobs/{answer['layer']}") == blob_gets


def test_images_that_cannot_be_read_at_offsets_are_pulled_whole(tmp_path, registry):
    ref = f"{registry.host}/lazy/gzipped:v1"
    assert run_diskkit("build", NOREG, "--no-lazy", make_qcow2(tmp_path / "g.qcow2", "8M"), "-t", ref).code == 0
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        answer = control(cache, {"op": "open", "image": ref, "registry": {"tls_verify": False}})
        assert answer == {"ok": False, "seekable": False, "reason": f"docker://{ref}: its layer is gzip-compressed; build it with --lazy or --compression none"}
        missing = control(cache, {"op": "open", "image": f"{registry.host}/lazy/absent:v1", "registry": {"tls_verify": False}})
        assert not missing["ok"] and "not found" in missing["error"]



def test_a_disk_uid_107_cannot_read_is_refused_as_pull_and_verify_refuse_it(tmp_path, registry):
    """root:0600, seekable: the server used to export it with a note; qemu in virt-launcher fails on it."""
    disk = random_disk(tmp_path / "locked.img", 2 * MIB).read_bytes()
    layout = write_layout(tmp_path / "locked", [[dir_("disk"), Member("disk/locked.img", disk, mode=0o600, uid=0, gid=0)]], gzipped=False)
    ref = f"{registry.host}/lazy/locked:v1"
    assert run_diskkit("push", NOREG, f"oci:{layout}:t", ref).code == 0
    rule = "/disk/locked.img is not readable by UID 107 (owner 0:0, mode 0600)"
    verified = run_diskkit("verify", NOREG, ref)
    assert verified.code == 8 and rule in verified.err
    pulled = run_launcher("pull", "--cache-dir", tmp_path / "pulled", NOREG, ref)
    assert pulled.code != 0 and rule in pulled.err
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        answer = control(cache, {"op": "open", "image": ref, "registry": {"tls_verify": False}})
        assert not answer["ok"] and rule in answer["error"], answer
        assert control(cache, {"op": "status"})["exports"] == []

def disk_offset(registry, ref: str) -> int:
    """Where the disk's bytes start in the image's layer blob, read with plain tools."""
    manifest = json.loads(run("skopeo", "inspect", "--raw", NOREG, f"docker://{ref}").stdout)
    repository = ref.split("/", 1)[1].rsplit(":", 1)[0]
    blob = requests.get(registry.url(f"/v2/{repository}/blobs/{manifest['layers'][0]['digest']}"), timeout=60).content
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        return next(m.offset_data for m in tar if m.name.startswith("disk/"))


def flip_first_disk_range(proxy, registry, ref: str) -> Fault:
    """One flipped bit in the first range response that starts at the disk's first byte."""
    fault = Fault("GET", r"/blobs/sha256:", "flip", times=1, arg=100, header=("Range", rf"^bytes={disk_offset(registry, ref)}-"))
    proxy.add(fault)
    return fault


def test_corrupt_chunk_is_detected_and_fetched_again(tmp_path, registry, fault_proxy, lazy_image, guest_raw):
    proxy = fault_proxy(registry)
    # In the first answer that carries the disk's byte 100: the open's head of the blob, asked for
    # beside the TOC (launcher.diskserver.firstbytes), which the first chunk is then cut from.
    proxy.add(Fault("GET", r"/blobs/sha256:", "flip", times=1, byte=disk_offset(registry, lazy_image) + 100))
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        answer = open_export(cache, lazy_image.replace(registry.host, proxy.host))
        assert run("qemu-img", "compare", "-f", "raw", "-F", "raw", answer["url"], guest_raw).stdout.strip() == "Images are identical."
        assert not proxy.pending  # the flip happened, and was caught
        status = wait_for(lambda: (s := export_status(cache, answer["export"]))["verified"] and s, 120, "verification")
        assert status["stats"]["corrupt_chunks"] == 1 and status["stats"]["verify_attempts"] == 1, status


def test_strict_serves_only_verified_bytes(tmp_path, registry, fault_proxy, plain_image, guest_raw):
    """Without a TOC nothing is verified before the whole blob: only --strict keeps reads waiting till then."""
    proxy = fault_proxy(registry)
    ref = plain_image.replace(registry.host, proxy.host)
    disk = guest_raw.read_bytes()

    # Not strict, prefetching held back: the first read gets the flipped bytes as they came.
    flip_first_disk_range(proxy, registry, plain_image)
    loose = tmp_path / "loose"
    loose.mkdir()
    with disk_server(loose, "--prefetch-rate", "64K"):
        answer = open_export(loose, ref)
        served = nbd_bytes(answer["url"], tmp_path / "loose.img")
        assert served != disk and served[:100] == disk[:100]
        assert served[100] == disk[100] ^ 1  # the very bit the proxy flipped reached the reader
        status = export_status(loose, answer["export"])
        assert not status["toc"] and not status["verified"]

    # Strict: the same fault, and every byte served is the disk's.
    flip_first_disk_range(proxy, registry, plain_image)
    strict = tmp_path / "strict"
    strict.mkdir()
    with disk_server(strict, "--strict"):
        answer = open_export(strict, ref)
        assert nbd_bytes(answer["url"], tmp_path / "strict.img") == disk
        assert not proxy.pending
        status = export_status(strict, answer["export"])
        # The first assembled blob failed its digest, so every chunk was fetched again before any read.
        assert status["verified"] and status["stats"]["verify_attempts"] == 2, status



def test_a_restarted_server_resumes_from_its_bitmap(tmp_path, lazy_image, guest_raw, registry):
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache, "--prefetch-rate", "1K"):  # nothing but what readers ask for
        answer = open_export(cache, lazy_image)
        run("qemu-io", "-r", "-f", "raw", "-c", "read 0 3M", "-c", f"read {20 * MIB} 1M", answer["url"])
        before = export_status(cache, answer["export"])
        assert before["present"] == 4, before  # chunks 0-2 and 20
    # Stopped (SIGTERM): the bitmap on disk holds exactly what was fetched, after the data was synced.
    bits = (cache / "lazy" / answer["export"] / "bitmap").read_bytes()
    assert [i for i in range(24) if bits[i // 8] >> (i % 8) & 1] == [0, 1, 2, 20]
    served = registry.log_text().count(f"/blobs/{answer['layer']}")
    with disk_server(cache):
        # A client reconnecting by name alone (a VM after a server restart) finds the export again.
        assert run("qemu-img", "compare", "-f", "raw", "-F", "raw", answer["url"], guest_raw).stdout.strip() == "Images are identical."
        status = wait_for(lambda: (s := export_status(cache, answer["export"]))["installed"] and s, 120, "installation")
        assert status["stats"]["fetched_chunks"] == 24  # 4 before the restart, the 20 missing after: none twice
    # Only the missing chunks travelled after the restart: at most a request per missing chunk.
    fetched = registry.log_text().count(f"/blobs/{answer['layer']}")
    assert fetched - served <= 20
    # The image opened before the restart is recorded for `launcher pull` all the same.
    pulled = run_launcher("pull", "--cache-dir", cache, NOREG, "--json", lazy_image)
    assert pulled.code == 0 and json.loads(pulled.out)["path"] == status["installed"], pulled.err
    assert registry.log_text().count(f"/blobs/{answer['layer']}") == fetched


def test_auth_tls_and_tokens_as_the_registry_client(tmp_path, auth_registry, tls_registry, token_registry, guest_raw):
    """Each open request carries its own registry options (a VM's pull secret), as `launcher run` sends them."""
    cases = [
        (auth_registry, {"tls_verify": False, "creds": f"{auth_registry.username}:{auth_registry.password}"}, {"tls_verify": False}),
        (token_registry, {"tls_verify": False, "creds": f"{token_registry.username}:{token_registry.password}"}, None),
        (tls_registry, {"cert_dir": str(tls_registry.ca_dir)}, {"tls_verify": True}),
    ]
    for index, (reg, good, bad) in enumerate(cases):
        ref = f"{reg.host}/lazy/auth:v{index}"
        flags = ["--cert-dir", str(reg.ca_dir)] if reg.tls else [NOREG]
        creds = ["--creds", good["creds"]] if "creds" in good else []
        assert run_diskkit("build", "--lazy", *flags, *creds, guest_raw, "-t", ref).code == 0
        cache = tmp_path / f"cache{index}"
        cache.mkdir()
        with disk_server(cache):
            if bad is not None:
                refused = control(cache, {"op": "open", "image": ref, "registry": bad})
                assert not refused["ok"] and ("denied" in refused["error"] or "TLS verification failed" in refused["error"]), refused
            answer = control(cache, {"op": "open", "image": ref, "registry": good})
            assert answer["ok"], answer
            assert run("qemu-img", "compare", "-f", "raw", "-F", "raw", answer["url"], guest_raw).stdout.strip() == "Images are identical."
    # The server asked the token service for a pull-only token, with the request's credentials.
    assert {"user": token_registry.username, "scope": ["repository:lazy/auth:pull"], "service": "diskkit-test"} in token_registry.token_requests


def test_gc_takes_partly_fetched_disks_only_when_no_server_uses_them(tmp_path, lazy_image):
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache, "--prefetch-rate", "1K"):
        answer = open_export(cache, lazy_image)
        partial = cache / "lazy" / answer["export"]
        kept = run_launcher("gc", "--cache-dir", cache, "--json")
        assert kept.code == 0 and str(partial) not in json.loads(kept.out)["removed"]
        assert (partial / "disk.img").is_file()
    collected = run_launcher("gc", "--cache-dir", cache, "--json")
    assert collected.code == 0 and str(partial) in json.loads(collected.out)["removed"]
    assert not partial.exists()

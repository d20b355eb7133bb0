"""Lazy images of several layers: `diskkit build` writes the lazy disk layer, and other layers are
added on top as another tool adds them (tests/imagecraft.py: plain tarfile + gzip), whiteouts
included. The disk server finds the disk in the final filesystem (KubeVirt's rules, as `launcher
pull`), serves it lazily from its own layer and reads only the small layers whole; kernelBoot
artifacts come out of a small layer without the disk's layer being fetched. Real registry, real
NBD clients, real boots of the test guest as the qemu user."""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path

from launcher.node.cache import key
from tests.conftest import run, run_diskkit, run_launcher
from tests.imagecraft import Member, add_layer, dir_
from tests.lazyhost import (
    QEMU_UID,
    control,
    disk_server,
    export_status,
    open_export,
    wait_for,
)
from tests.test_lazygz import rewrite_toc
from tests.testguest import KERNEL_CMDLINE, ensure_testguest, parse_console
from tests.vmhost import NOREG, assert_clean

GUEST_SIZE = 64 << 20  # the test guest's virtual size


def installed_at(cache: Path, layer_digest: str, member: str) -> Path:
    """Where a pull installs `member` of a layer in `cache` (launcher.node.cache.Cache.disk_dir), found
    without opening the cache as this process's user: root refuses a cache another user owns."""
    return Path(cache) / "disks" / "sha256" / layer_digest.removeprefix("sha256:") / key(member)


def manifest(layout: Path, tag: str) -> dict:
    index = json.loads((layout / "index.json").read_text())
    (entry,) = [m for m in index["manifests"] if m["annotations"]["org.opencontainers.image.ref.name"] == tag]
    return json.loads((layout / "blobs/sha256" / entry["digest"][7:]).read_text())


def build_lazy(root: Path, *flags: str) -> Path:
    layout = root / "layout"
    built = run_diskkit("build", "--lazy", *flags, ensure_testguest() / "testguest-poweroff.qcow2", "-t", f"oci:{layout}:base")
    assert built.code == 0, built.err
    return layout


def push(layout: Path, tag: str, ref: str) -> str:
    pushed = run_diskkit("push", NOREG, f"oci:{layout}:{tag}", ref)
    assert pushed.code == 0, pushed.err
    return ref


def disk_path(layout: Path) -> str:
    return manifest(layout, "base")["annotations"]["io.diskkit.disk.path"].lstrip("/")


def blob_gets(proxy, digest: str) -> int:
    return sum(1 for method, path, _ in proxy.log if method == "GET" and path.endswith(f"/blobs/{digest}"))


def layer_toc(layout: Path, layer: dict) -> tuple[bytes, int, int, dict]:
    """A v2 lazy layer's blob, where its TOC member is (offset, size) and the TOC it holds."""
    data = (layout / "blobs/sha256" / layer["digest"][7:]).read_bytes()
    notes = layer["annotations"]
    at, size = int(notes["io.diskkit.lazy.toc.offset"]), int(notes["io.diskkit.lazy.toc.size"])
    return data, at, size, json.loads(zlib.decompress(data[at : at + size], 31))


def kernel_boot_vmi(path: Path, name: str, ref: str) -> Path:
    """A VMI whose disk and kernelBoot kernel both come from `ref`."""
    path.write_text(json.dumps({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": name},
        "spec": {"domain": {"resources": {"requests": {"memory": "128Mi"}}, "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]},
                            "firmware": {"kernelBoot": {"container": {"image": ref, "kernelPath": "/boot/vmlinuz"}}}},
                 "volumes": [{"name": "root", "containerDisk": {"image": ref}}]}}))
    return path


def test_the_disk_under_an_upper_layer_is_served_lazily_and_its_head_and_tail_fetched_once(tmp_path, registry, fault_proxy):
    layout = build_lazy(tmp_path)
    disk = disk_path(layout)
    # The upper layer hides the TOC's directory (opaque whiteout), deletes nothing of /disk and adds files.
    add_layer(layout, "base", "two", [dir_(".diskkit"), Member(".diskkit/.wh..wh..opq"), dir_("etc"), Member("etc/motd", b"hello\n")])
    ref = push(layout, "two", f"{registry.host}/layers/guest:two")
    lower, upper = (layer["digest"] for layer in manifest(layout, "two")["layers"])
    proxy = fault_proxy(registry)
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache, "--prefetch-rate", "1K"):  # no prefetching: only what the open and the reads ask for
        answer = open_export(cache, ref.replace(registry.host, proxy.host))
        assert answer["layer"] == lower and answer["member"] == disk
        # The lazy layer at open, in two requests sent together beside the config
        # (launcher.diskserver.firstbytes): the TOC's tail (the members after the chunks, the TOC)
        # and the blob's head (the members before the chunks, the disk's first chunk for the header
        # check), each handed to the export once. The small layer: once, whole.
        assert blob_gets(proxy, lower) == 2, proxy.log
        assert blob_gets(proxy, upper) == 1
        lower_size = next(layer["size"] for layer in manifest(layout, "two")["layers"] if layer["digest"] == lower)
        assert proxy.sent[f"/v2/layers/guest/blobs/{lower}"] < lower_size // 4
        same = run("qemu-img", "compare", "-f", "qcow2", "-F", "qcow2", answer["url"], ensure_testguest() / "testguest-poweroff.qcow2")
        assert same.stdout.strip() == "Images are identical."
        status = wait_for(lambda: (s := export_status(cache, answer["export"]))["installed"] and s, 180, "the disk to be verified and installed")
    assert status["verified"] and status["toc"], status
    # The disk store entry is the one `launcher pull` makes for this image: (layer, member).
    pulled = run_launcher("pull", "--cache-dir", cache, NOREG, "--json", ref)
    assert pulled.code == 0, pulled.err
    assert json.loads(pulled.out)["path"] == status["installed"] and json.loads(pulled.out)["layer"] == lower


def test_a_whiteout_that_removes_the_disk_is_refused_as_pull_refuses_it(tmp_path, registry):
    layout = build_lazy(tmp_path)
    name = disk_path(layout).split("/", 1)[1]
    add_layer(layout, "base", "gone", [dir_("disk"), Member(f"disk/.wh.{name}")])
    ref = push(layout, "gone", f"{registry.host}/layers/guest:gone")
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        refused = control(cache, {"op": "open", "image": ref, "registry": {"tls_verify": False}})
    pulled = run_launcher("pull", "--cache-dir", tmp_path / "pullcache", NOREG, ref)
    assert pulled.code != 0
    assert not refused["ok"] and refused["error"] == f"docker://{ref}: no file found in folder /disk, no disk present", refused
    assert pulled.err.strip().splitlines()[-1] == f"launcher: {refused['error']}"


def test_a_disk_replaced_in_a_small_upper_layer_is_pulled_whole(tmp_path, registry):
    """An opaque /disk with another disk above: that disk's layer is plain gzip, read whole, so no lazy export."""
    layout = build_lazy(tmp_path)
    add_layer(layout, "base", "other", [dir_("disk"), Member("disk/.wh..wh..opq"), Member("disk/other.img", bytes(1 << 20))])
    ref = push(layout, "other", f"{registry.host}/layers/guest:other")
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        answer = control(cache, {"op": "open", "image": ref, "registry": {"tls_verify": False}})
    assert answer == {"ok": False, "seekable": False,
                      "reason": f"docker://{ref}: the disk /disk/other.img is in layer 1, which is neither lazy nor uncompressed"}


def test_an_uncompressed_lazy_layer_under_a_layer_whose_manifest_lost_the_mark(tmp_path, registry):
    """TOC v1 (`--compression none`) below a gzip layer, in a manifest without `io.diskkit.lazy` (as
    a tool building FROM the image may leave it): the layer's TOC annotations still mark it lazy,
    and its tar headers are walked with range requests."""
    layout = build_lazy(tmp_path, "--compression", "none")
    add_layer(layout, "base", "v1", [dir_("etc"), Member("etc/motd", b"hello\n")], keep_annotations=False)
    doc = manifest(layout, "v1")
    assert "annotations" not in doc and doc["layers"][0]["mediaType"] == "application/vnd.oci.image.layer.v1.tar"
    ref = push(layout, "v1", f"{registry.host}/layers/guest:v1")
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache, "--prefetch-rate", "1K"):
        answer = control(cache, {"op": "open", "image": ref, "marked": True, "registry": {"tls_verify": False}})
        assert answer["ok"] and answer["layer"] == doc["layers"][0]["digest"], answer
        same = run("qemu-img", "compare", "-f", "qcow2", "-F", "qcow2", answer["url"], ensure_testguest() / "testguest-poweroff.qcow2")
        assert same.stdout.strip() == "Images are identical."
        status = export_status(cache, answer["export"])
    assert status["toc"] and status["stats"]["corrupt_chunks"] == 0, status


def kernel_layer() -> list[Member]:
    guest = ensure_testguest()
    return [dir_("boot", mode=0o555, uid=0, gid=0),
            Member("boot/vmlinuz", (guest / "vmlinuz").read_bytes(), mode=0o444, uid=0, gid=0),
            Member("boot/initrd.img", (guest / "initrd.img").read_bytes(), mode=0o444, uid=0, gid=0)]


def test_boots_lazily_from_a_two_layer_image(tmp_path, qemu_user, registry):
    layout = build_lazy(tmp_path)
    add_layer(layout, "base", "two", [dir_("etc", uid=0, gid=0), Member("etc/motd", b"hello\n"), Member(".diskkit/.wh.lazy-toc.json")])
    ref = push(layout, "two", f"{registry.host}/layers/boot:two")
    lower = manifest(layout, "two")["layers"][0]["digest"]
    cache = qemu_user.cache
    with disk_server(cache, "--prefetch-rate", "1K", user=QEMU_UID, env=qemu_user.env):
        vmi = qemu_user.write_vmi("layers-two", ref)
        result = qemu_user.launcher("run", NOREG, "--lazy", "--console", "--timeout", "300", vmi)
        assert result.code == 0, result.err
        console = parse_console(result.out)
        assert console["done"] and console["disks"]["vda"]["size"] == GUEST_SIZE, result.out
        assert console["disks"]["vda"]["head"].startswith("33c0")  # the guest's MBR, read through the export
        (export,) = control(cache, {"op": "status"})["exports"]
        assert export["layer"] == lower and export["member"] == disk_path(layout), export
    assert_clean(qemu_user, "default_layers-two")


def kernel_boot_lazily(qemu_user, name: str, ref: str, path: str | None = None):
    """Boot `ref`'s disk and its kernelBoot kernel and initrd through a node server prefetching almost
    nothing; the run's result and the one export, as the server listed it while the VM ran."""
    firmware = {"kernelBoot": {"kernelArgs": KERNEL_CMDLINE,
                               "container": {"image": ref, "kernelPath": "/boot/vmlinuz", "initrdPath": "/boot/initrd.img"}}}
    with disk_server(qemu_user.cache, "--prefetch-rate", "1K", user=QEMU_UID, env=qemu_user.env):
        vmi = qemu_user.write_vmi(name, ref, path=path, domain={"firmware": firmware})
        result = qemu_user.launcher("run", NOREG, "--lazy", "--console", "--timeout", "300", vmi)
        assert result.code == 0, result.err
        console = parse_console(result.out)
        assert console["done"] and console["disks"]["vda"]["size"] == GUEST_SIZE, result.out
        (export,) = control(qemu_user.cache, {"op": "status"})["exports"]
        assert export["present"] < export["chunks"], export  # the disk's layer read only where the guest read
    return result, export


def test_kernel_boot_and_a_custom_path_from_a_three_layer_lazy_image(tmp_path, qemu_user, registry, fault_proxy):
    """containerDisk.path names the disk `diskkit build --path` put elsewhere; kernelBoot's kernel and
    initrd come from a layer above it, read whole and verified, while the disk's layer is only
    read where the guest reads: its bytes fetched stay far below its size."""
    layout = build_lazy(tmp_path, "--path", "/images/vm/guest.qcow2")
    add_layer(layout, "base", "kb", kernel_layer())
    add_layer(layout, "kb", "three", [dir_("images", mode=0o555, uid=0, gid=0), Member("images/README", b"the disk is in vm/\n")])
    lazy_layer, kernel_blob, _ = (layer for layer in manifest(layout, "three")["layers"])
    proxy = fault_proxy(registry)
    ref = push(layout, "three", f"{registry.host}/layers/boot:three").replace(registry.host, proxy.host)
    cache = qemu_user.cache
    _, export = kernel_boot_lazily(qemu_user, "layers-kb", ref, path="/images/vm/guest.qcow2")
    assert export["layer"] == lazy_layer["digest"] and export["member"] == "images/vm/guest.qcow2"
    fetched = proxy.sent[f"/v2/layers/boot/blobs/{lazy_layer['digest']}"]
    assert fetched < lazy_layer["size"] // 2, (fetched, lazy_layer["size"])
    # Read whole once by the server, for the disk (its headers are part of the image's filesystem), and
    # kept for both files (launcher.diskserver.blobranges.SmallBlobs).
    assert proxy.sent[f"/v2/layers/boot/blobs/{kernel_blob['digest']}"] == kernel_blob["size"]
    # In the cache where a pull installs it: the file of the layer that holds it, keyed (layer, member).
    installed = installed_at(cache, kernel_blob["digest"], "boot/vmlinuz") / "disk.img"
    assert installed.read_bytes() == (ensure_testguest() / "vmlinuz").read_bytes()
    assert_clean(qemu_user, "default_layers-kb")



def test_kernel_boot_from_the_lazy_layer_itself(tmp_path, qemu_user, registry, fault_proxy):
    """`diskkit build --kernel --initrd` puts them in the lazy layer, beside the disk: the TOC pins
    each (`files`), so the run takes them out of the members around the disk's and checks them;
    the disk's own members are fetched only where the guest reads."""
    guest = ensure_testguest()
    layout = build_lazy(tmp_path, "--kernel", f"/boot/vmlinuz={guest / 'vmlinuz'}", "--initrd", f"/boot/initrd.img={guest / 'initrd.img'}")
    (layer,) = manifest(layout, "base")["layers"]
    data, toc_at, toc_size, toc = layer_toc(layout, layer)
    assert toc["files"] == {"boot/vmlinuz": hashlib.sha256((guest / "vmlinuz").read_bytes()).hexdigest(),
                            "boot/initrd.img": hashlib.sha256((guest / "initrd.img").read_bytes()).hexdigest()}
    proxy = fault_proxy(registry)
    ref = push(layout, "base", f"{registry.host}/layers/boot:inlayer").replace(registry.host, proxy.host)
    cache = qemu_user.cache
    result, export = kernel_boot_lazily(qemu_user, "layers-inlayer", ref)
    assert "pulling it whole" not in result.err, result.err
    # The head and tail (kernel, initrd, headers, the TOC) travel once: the server takes the files, and
    # the TOC each request reads, out of the export's copy (launcher.diskserver.blobranges.KnownRanges);
    # of the disk's members only those the guest read.
    first, end = toc["members"][0][0], sum(toc["members"][-1])
    around = first + layer["size"] - end
    fetched = proxy.sent[f"/v2/layers/boot/blobs/{layer['digest']}"]
    assert fetched == around + export["stats"]["fetched_bytes"], (fetched, around, toc_size, export)
    assert export["stats"]["fetched_bytes"] < (end - first) // 2, export
    for name in ("vmlinuz", "initrd.img"):
        installed = installed_at(cache, layer["digest"], f"boot/{name}") / "disk.img"
        assert installed.read_bytes() == (guest / name).read_bytes()
    assert_clean(qemu_user, "default_layers-inlayer")


def test_a_kernel_that_does_not_match_its_toc_digest_is_refused(tmp_path, registry):
    """A consistent lie (the TOC re-pinned by the annotations, every digest above recomputed) that
    names another kernel: the file taken out of the head does not match, and the run stops there."""
    guest = ensure_testguest()
    layout = build_lazy(tmp_path, "--kernel", f"/boot/vmlinuz={guest / 'vmlinuz'}")
    doc = manifest(layout, "base")
    data, at, size, toc = layer_toc(layout, doc["layers"][0])
    toc["files"]["boot/vmlinuz"] = hashlib.sha256(b"another kernel").hexdigest()
    rewrite_toc(layout, doc, data, at, size, json.dumps(toc, separators=(",", ":"), sort_keys=True).encode())
    ref = push(layout, "base", f"{registry.host}/layers/forged:v1")
    vmi = kernel_boot_vmi(tmp_path / "vmi.json", "forged", ref)
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        out = run_launcher("domain", "--accel", "qemu", "--cache-dir", cache, NOREG, "--lazy", vmi)
    assert out.code != 0
    assert out.err.strip().splitlines()[-1] == f"launcher: spec.domain.firmware.kernelBoot.container.image: docker://{ref}: layer 0: /boot/vmlinuz does not match its digest in the lazy TOC", out.err
    assert not installed_at(cache, doc["layers"][0]["digest"], "boot/vmlinuz").exists()  # nothing installed


def test_a_kernel_no_toc_digest_pins_is_pulled_whole(tmp_path, registry, fault_proxy):
    """A TOC without `files` (as written before it existed): the kernel in the members around the
    disk has nothing but the whole blob's digest to vouch for it, so the image is pulled whole."""
    guest = ensure_testguest()
    layout = build_lazy(tmp_path, "--kernel", f"/boot/vmlinuz={guest / 'vmlinuz'}")
    doc = manifest(layout, "base")
    data, at, size, toc = layer_toc(layout, doc["layers"][0])
    del toc["files"]
    rewrite_toc(layout, doc, data, at, size, json.dumps(toc, separators=(",", ":"), sort_keys=True).encode())
    proxy = fault_proxy(registry)
    ref = push(layout, "base", f"{registry.host}/layers/oldtoc:v1").replace(registry.host, proxy.host)
    vmi = kernel_boot_vmi(tmp_path / "vmi.json", "oldtoc", ref)
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache, "--prefetch-rate", "1K"):  # the disk is not prefetched: what arrives whole is the pull
        out = run_launcher("domain", "--accel", "qemu", "--cache-dir", cache, NOREG, "--lazy", vmi)
    assert out.code == 0, out.err
    layer = doc["layers"][0]
    assert proxy.sent[f"/v2/layers/oldtoc/blobs/{layer['digest']}"] > layer["size"]  # the whole blob, besides the server's reads
    pulled = installed_at(cache, layer["digest"], "boot/vmlinuz") / "disk.img"
    assert pulled.read_bytes() == (guest / "vmlinuz").read_bytes()


def test_small_blobs_keep_the_latest_within_their_bound():
    from launcher.diskserver.blobranges import SmallBlobs

    small = SmallBlobs(limit=10)
    small.put("sha256:a", b"aaaa")
    small.put("sha256:b", b"bbbb")
    small.put("sha256:c", b"cccc")  # 12 bytes held: the oldest goes
    assert (small.get("sha256:a"), small.get("sha256:b"), small.get("sha256:c")) == (None, b"bbbb", b"cccc")
    small.put("sha256:big", b"x" * 11)  # larger than the bound: never kept, nothing evicted for it
    assert small.get("sha256:big") is None and small.get("sha256:b") == b"bbbb"

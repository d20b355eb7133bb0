"""launcher pull: the node cache against a real registry, local transports and hostile images."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tarfile
import time
from pathlib import Path

import pytest

from tests.conftest import launcher_command, make_qcow2, run, run_diskkit, run_launcher
from tests.refusals import assert_refused, cache_entries
from tests.faultproxy import Fault
from tests.imagecraft import Member, dir_, layer_blob_paths, write_layout

NOREG = "--tls-verify=false"


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "cache"


def pull(cache: Path, ref: str, *extra: str):
    return run_launcher("pull", "--cache-dir", cache, *extra, ref)


@pytest.fixture(scope="module")
def source_disk(tmp_path_factory) -> Path:
    return make_qcow2(tmp_path_factory.mktemp("src") / "guest.qcow2", size="32M", pattern=0x5A)


@pytest.fixture(scope="module")
def pushed(registry, source_disk) -> str:
    ref = f"{registry.host}/launcher/pull:v1"
    result = run_diskkit("build", NOREG, source_disk, "-t", ref)
    assert result.code == 0, result.err
    return ref


def test_pull_from_registry_gives_the_disk_bit_for_bit(cache, pushed, source_disk):
    result = pull(cache, pushed, NOREG, "--json")
    assert result.code == 0, result.err
    info = json.loads(result.out)
    disk = Path(info["path"])
    assert disk.is_relative_to(cache / "disks")
    assert info["format"] == "qcow2" and info["virtual_size"] == 32 << 20
    run("qemu-img", "compare", "-f", "qcow2", "-F", "qcow2", source_disk, disk)
    assert disk.read_bytes() == source_disk.read_bytes()
    assert disk.stat().st_mode & 0o777 == 0o444  # shared base: VMs get overlays
    # Plain output is the path alone, for scripts.
    again = pull(cache, pushed, NOREG)
    assert again.out.strip() == str(disk)


def test_every_local_transport_lands_on_the_same_cache_entry(cache, tmp_path, source_disk):
    layout = tmp_path / "layout"
    assert run_diskkit("build", source_disk, "-t", f"oci:{layout}:v1").code == 0
    refs = [f"oci:{layout}:v1"]
    for dest in (f"oci-archive:{tmp_path / 'a.tar'}:v1", f"docker-archive:{tmp_path / 'd.tar'}:local/disk:v1"):
        assert run_diskkit("push", f"oci:{layout}:v1", dest).code == 0
        refs.append(dest)
    paths = set()
    for ref in refs:
        result = pull(cache, ref)
        assert result.code == 0, result.err
        paths.add(result.out.strip())
    # The docker archive holds the uncompressed layer: another blob, the same disk bytes.
    assert len(paths) <= 2
    for path in paths:
        assert Path(path).read_bytes() == source_disk.read_bytes()


def test_if_not_present_uses_the_cache_without_the_registry(cache, registry, pushed, fault_proxy):
    proxy = fault_proxy(registry)
    ref = pushed.replace(registry.host, proxy.host)
    assert pull(cache, ref, NOREG).code == 0
    # Whole blobs (200); the lazy layer's TOC is read first, with a range (206).
    blob_gets = [entry for entry in proxy.log if entry[0] == "GET" and "/blobs/" in entry[1] and entry[2] == 200]
    assert len(blob_gets) == 2  # config and the one layer
    before = len(proxy.log)
    assert pull(cache, ref, NOREG).code == 0
    assert len(proxy.log) == before  # IfNotPresent: nothing asked
    always = pull(cache, ref, NOREG, "--pull-policy", "Always")
    assert always.code == 0
    asked = proxy.log[before:]
    assert any("/manifests/" in entry[1] for entry in asked)
    layer_gets = [e for e in proxy.log if e[0] == "GET" and "/blobs/" in e[1] and e[2] == 200]
    assert len(layer_gets) == 3  # Always re-reads manifest and config, never the layer again
    other = cache.parent / "other-cache"
    never = pull(other, ref, NOREG, "--pull-policy", "Never")
    assert_refused(never, "container image is not present with pull policy of Never", cache=other)


def test_concurrent_pulls_download_once(cache, registry, pushed, fault_proxy):
    proxy = fault_proxy(registry)
    ref = pushed.replace(registry.host, proxy.host)
    # Slow the layer down so both pulls are surely in flight together.
    proxy.add(Fault("GET", r"/blobs/sha256:", "stall", times=4, arg=1.0))
    procs = [subprocess.Popen(launcher_command("pull", "--cache-dir", cache, NOREG, ref), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [proc.communicate(timeout=120) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outs
    assert len({out.strip() for out, _ in outs}) == 1
    manifest = json.loads(subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{pushed}"], capture_output=True, text=True, check=True).stdout)
    layer = manifest["layers"][0]["digest"]
    layer_gets = [e for e in proxy.log if e[0] == "GET" and e[1].endswith(layer) and e[2] == 200]
    assert len(layer_gets) == 1, proxy.log  # one download (its lazy TOC's range read aside)


def test_custom_path_symlink_root_file_and_base_layers(cache, tmp_path, source_disk):
    data = source_disk.read_bytes()
    custom = tmp_path / "custom"
    assert run_diskkit("build", source_disk, "--path", "/images/vm/root.qcow2", "-t", f"oci:{custom}:v1").code == 0
    result = pull(cache, f"oci:{custom}:v1", "--path", "/images/vm/root.qcow2")
    assert result.code == 0, result.err
    assert Path(result.out.strip()).read_bytes() == data
    # Without --path the image has no /disk: KubeVirt's own message.
    assert_refused(pull(cache.parent / "c2", f"oci:{custom}:v1"), "failed to check /disk for disks", cache=cache.parent / "c2")

    linked = write_layout(tmp_path / "sym", [[dir_("images"), Member("images/real.qcow2", data), dir_("disk"), Member("disk/root.qcow2", kind=tarfile.SYMTYPE, link="/images/real.qcow2")]])
    result = pull(cache, f"oci:{linked}:t")
    assert result.code == 0, result.err
    assert Path(result.out.strip()).read_bytes() == data

    # ORAS / ImageVolume style: one file at the image root.
    lone = write_layout(tmp_path / "lone", [[Member("fedora.qcow2", data, mode=0o644, uid=0, gid=0)]])
    result = pull(cache, f"oci:{lone}:t")
    assert result.code == 0, result.err
    assert Path(result.out.strip()).read_bytes() == data

    # Built FROM a base (old kubevirt/container-disk-v1alpha style): files below, the disk above.
    base = [dir_("etc"), Member("etc/os-release", b"ID=base\n", mode=0o644), dir_("disk")]
    upper = [Member("disk/disk.qcow2", data)]
    based = write_layout(tmp_path / "based", [base, upper], docker_types=True)
    result = pull(cache, f"oci:{based}:t", "--json")
    assert result.code == 0, result.err
    info = json.loads(result.out)
    assert info["member"] == "disk/disk.qcow2"
    index = json.loads((based / "index.json").read_text())
    manifest = json.loads((based / "blobs/sha256" / index["manifests"][0]["digest"][7:]).read_text())
    assert info["layer"] == manifest["layers"][1]["digest"]


def test_raw_disk_is_written_sparse(cache, tmp_path):
    raw = tmp_path / "disk.img"
    with open(raw, "wb") as f:
        f.write(b"\xee" * (1 << 20))
        f.seek(63 << 20)
        f.write(b"\xdd" * 4096)
        f.truncate(64 << 20)
    layout = tmp_path / "raw"
    assert run_diskkit("build", raw, "-t", f"oci:{layout}:v1").code == 0
    result = pull(cache, f"oci:{layout}:v1", "--json")
    assert result.code == 0, result.err
    info = json.loads(result.out)
    disk = Path(info["path"])
    assert info["format"] == "raw" and disk.stat().st_size == 64 << 20
    assert disk.stat().st_blocks * 512 < 4 << 20  # zero runs became holes
    assert disk.read_bytes() == raw.read_bytes()


@pytest.mark.parametrize("tar_format", ["gnu", "posix"])
def test_gnu_tar_sparse_members_and_long_names(cache, tmp_path, tar_format):
    """Layers from GNU tar: old GNU sparse maps or pax sparse 1.0, and a path past ustar's 100 bytes."""
    root = tmp_path / "root"
    deep = root / "images" / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    disk = deep / "disk.img"
    with open(disk, "wb") as f:
        f.write(b"\x11" * 5000)
        f.seek(40 << 20)
        f.write(b"\x22" * 70000)
        f.truncate(48 << 20)
    raw = subprocess.run(["tar", "-C", root, f"--format={tar_format}", "--sparse", "--owner=107", "--group=107", "-cf", "-", "images"],
                         check=True, capture_output=True).stdout
    assert len(raw) < 1 << 20  # stored sparse, so the reader has to rebuild the holes
    layout = write_layout(tmp_path / "layout", [raw])
    path = "/" + str(disk.relative_to(root))
    result = pull(cache, f"oci:{layout}:t", "--path", path, "--json")
    assert result.code == 0, result.err
    pulled = Path(json.loads(result.out)["path"])
    assert pulled.read_bytes() == disk.read_bytes()


def _backed_qcow2(tmp_path: Path) -> bytes:
    backed = tmp_path / "backed.qcow2"
    run("qemu-img", "create", "-q", "-f", "qcow2", "-b", "/etc/passwd", "-F", "raw", backed)
    return backed.read_bytes()


HOSTILE = {
    "two-files": (lambda d, t: [[dir_("disk"), Member("disk/a.qcow2", d), Member("disk/b.qcow2", d)]], "more than one file found in folder /disk, only one disk is allowed"),
    "dotdot": (lambda d, t: [[Member("../escape.txt", b"x"), dir_("disk"), Member("disk/a.qcow2", d)]], "'../escape.txt' in layer 0 escapes the image root"),
    "absolute": (lambda d, t: [[Member("/abs/evil.txt", b"x"), dir_("disk"), Member("disk/a.qcow2", d)]], "'/abs/evil.txt' in layer 0 escapes the image root"),
    "symlink-out": (lambda d, t: [[dir_("disk"), Member("disk/a.qcow2", kind=tarfile.SYMTYPE, link="../../../../etc/passwd")]], "a symlink points outside the image root"),
    "hardlink-out": (lambda d, t: [[dir_("disk"), Member("disk/a.qcow2", kind=tarfile.LNKTYPE, link="/etc/shadow")]], "hardlink 'disk/a.qcow2' in layer 0 points outside the image"),
    "device": (lambda d, t: [[dir_("disk"), Member("disk/sda", kind=tarfile.BLKTYPE)]], "/disk/sda is a device, not a regular file"),
    "backing-file": (lambda d, t: [[dir_("disk"), Member("disk/d.qcow2", _backed_qcow2(t))]], "/disk/d.qcow2: expected no backing file, but found /etc/passwd"),
    "empty-disk-dir": (lambda d, t: [[dir_("disk")]], "no file found in folder /disk, no disk present"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_images_are_refused_and_leave_nothing(cache, tmp_path, source_disk, case):
    make, expected = HOSTILE[case]
    layout = write_layout(tmp_path / case, make(source_disk.read_bytes(), tmp_path))
    before = set(os.listdir(tmp_path))
    result = pull(cache, f"oci:{layout}:t")
    assert_refused(result, f"oci:{layout}:t", expected, cache=cache)
    assert set(os.listdir(tmp_path)) == before | {"cache"}  # nothing written beside the cache
    assert not Path("/abs").exists() and not (cache.parent.parent / "escape.txt").exists()


def test_wrong_path_and_bad_path(cache, tmp_path, source_disk):
    layout = tmp_path / "l"
    assert run_diskkit("build", source_disk, "-t", f"oci:{layout}:v1").code == 0
    assert_refused(pull(cache, f"oci:{layout}:v1", "--path", "/disk/missing.qcow2"), "no image on path /disk/missing.qcow2", cache=cache)
    assert_refused(pull(cache, f"oci:{layout}:v1", "--path", "/disk/../etc/passwd"), "must be an absolute path to a file without relative components", cache=cache)
    assert_refused(pull(cache, f"oci:{layout}:v1", "--path", "/"), "must not point to root", cache=cache)


def test_layer_that_does_not_match_its_digest(cache, tmp_path, source_disk):
    layout = write_layout(tmp_path / "c", [[dir_("disk"), Member("disk/d.qcow2", source_disk.read_bytes())]])
    blob = layer_blob_paths(layout)[0]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    assert_refused(pull(cache, f"oci:{layout}:t"), "does not match its digest", cache=cache)


def test_missing_image_in_registry(cache, registry):
    result = pull(cache, f"{registry.host}/launcher/nothing:v1", NOREG, "--retry-times", "0")
    assert_refused(result, "manifest v1 not found", cache=cache)


def test_corrupt_byte_from_the_registry_is_never_kept(cache, registry, pushed, fault_proxy):
    proxy = fault_proxy(registry)
    manifest = json.loads(subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{pushed}"], capture_output=True, text=True, check=True).stdout)
    layer = manifest["layers"][0]["digest"]
    proxy.add(Fault("GET", layer, "flip", times=10, arg=1000))
    result = pull(cache, pushed.replace(registry.host, proxy.host), NOREG, "--retry-times", "1")
    assert_refused(result, "does not match its digest", cache=cache)


def test_kill_mid_pull_leaves_nothing_that_looks_complete(cache, registry, pushed, fault_proxy):
    proxy = fault_proxy(registry)
    ref = pushed.replace(registry.host, proxy.host)
    manifest = json.loads(subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{pushed}"], capture_output=True, text=True, check=True).stdout)
    layer = manifest["layers"][0]["digest"]
    proxy.add(Fault("GET", layer, "stall", times=1, arg=30))
    proc = subprocess.Popen(launcher_command("pull", "--cache-dir", cache, NOREG, ref), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not (cache / "tmp").is_dir() or not list((cache / "tmp").iterdir()):
        assert time.monotonic() < deadline and proc.poll() is None, proxy.log
        time.sleep(0.05)
    time.sleep(0.5)  # inside the stalled layer download
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    held = cache_entries(cache)
    assert held["disks"] == [] and held["refs"] == []
    # The next pull does the work, and removes the dead pull's staging area first.
    proxy.clear()
    assert pull(cache, ref, NOREG).code == 0
    assert list((cache / "tmp").iterdir()) == []
    gc = run_launcher("gc", "--cache-dir", cache, "--max-size", "1T")
    assert gc.code == 0, gc.err
    assert cache_entries(cache)["disks"]  # under --max-size: the disk itself is kept


# ---------------------------------------------------------------- which reference, and from where

def test_a_pull_names_the_reference_asked_for_not_the_tag_that_brought_the_disk(cache, registry, tmp_path):
    # One digest pushed under two tags: each pull reports its own tag, though the second fetches nothing.
    disk = make_qcow2(tmp_path / "same.qcow2", size="8M", pattern=0x21)
    first, second = f"{registry.host}/launcher/named:v2r", f"{registry.host}/launcher/named:v2b"
    built = run_diskkit("build", NOREG, disk, "-t", first, "-t", second)
    assert built.code == 0, built.err
    by_first = json.loads(pull(cache, first, NOREG, "--json").out)
    done = pull(cache, second, NOREG, "--json")
    assert done.code == 0, done.err
    by_second = json.loads(done.out)
    assert by_first["image"] == f"docker://{first}" and by_first["fetched"] > 0
    assert by_second["image"] == f"docker://{second}", by_second
    assert (by_second["digest"], by_second["path"], by_second["fetched"]) == (by_first["digest"], by_first["path"], 0)
    # Its cached answer names it too, and the node knows the disk by both tags.
    again = json.loads(pull(cache, second, NOREG, "--json").out)
    assert again["image"] == f"docker://{second}"
    listed = json.loads(run_launcher("ls", "--cache-dir", cache, "--json").out)
    (entry,) = [d for d in listed["disks"] if d["path"] == by_first["path"]]
    assert sorted(entry["images"]) == sorted([f"docker://{first}", f"docker://{second}"])


def _domain_backing(cache: Path, vmi: Path, *extra: str):
    done = run_launcher("domain", "--cache-dir", cache, NOREG, "--no-lazy", *extra, vmi)
    assert done.code == 0, done.err
    return done, done.out.split('<backingStore type="file">')[1].split('<source file="')[1].split('"')[0]


def test_a_repushed_tag_from_the_cache_is_said_and_always_resolves_it_again(cache, registry, tmp_path):
    # KubeVirt hands containerDisk.imagePullPolicy to the kubelet as the policy of the pod's image
    # (pkg/container-disk/container-disk.go, the container's ImagePullPolicy; image volumes in
    # pkg/virt-controller/services/rendervolumes.go), defaulted from the tag (pkg/defaults/defaults.go
    # setDefaultPullPoliciesOnContainerDisks): IfNotPresent boots what the node holds, Always asks the
    # registry where the tag is now.
    ref = f"{registry.host}/launcher/rolling:stable"
    shown, repo = f"docker://{ref}", ref.rsplit(":", 1)[0]
    versions = [make_qcow2(tmp_path / f"v{n}.qcow2", size="8M", pattern=pattern) for n, pattern in enumerate((0x31, 0x32, 0x33), 1)]

    def push(disk: Path) -> str:
        built = run_diskkit("build", NOREG, "--no-lazy", disk, "-t", ref)
        assert built.code == 0, built.err
        return built.last_line

    v1 = push(versions[0])
    first = json.loads(pull(cache, ref, NOREG, "--json").out)
    assert first["digest"] == v1
    v2 = push(versions[1])
    stale = pull(cache, ref, NOREG, "--json")
    assert stale.code == 0, stale.err
    assert json.loads(stale.out)["digest"] == v1  # IfNotPresent, as the kubelet: the node's copy
    assert f"{shown}: cached {v1} (imagePullPolicy IfNotPresent); imagePullPolicy: Always or --pull-policy Always asks the registry where the tag is now" in stale.err, stale.err
    fresh = pull(cache, ref, NOREG, "--json", "--pull-policy", "Always")
    assert fresh.code == 0, fresh.err
    assert json.loads(fresh.out)["digest"] == v2 and "cached" not in fresh.err
    by_digest = pull(cache, f"{repo}@{v2}", NOREG)
    assert by_digest.code == 0 and "cached" not in by_digest.err  # a digest cannot move: nothing to say

    # A VMI: the cached tag is said on `launcher domain` (and run) too; Always, from the flag or the
    # spec, boots where the tag is now.
    v3 = push(versions[2])
    vmi = tmp_path / "vmi.yaml"
    body = ("apiVersion: kubevirt.io/v1\nkind: VirtualMachineInstance\nmetadata: {name: rolling}\nspec:\n"
            "  domain:\n    resources: {requests: {memory: 64Mi}}\n    devices: {disks: [{name: root, disk: {bus: virtio}}]}\n"
            "  volumes: [{name: root, containerDisk: {image: \"%s\"%s}}]\n")
    vmi.write_text(body % (ref, ""))
    said, backing = _domain_backing(cache, vmi)
    assert f"launcher: note: {shown}: cached {v2} (imagePullPolicy IfNotPresent)" in said.err, said.err
    cached_path = json.loads(pull(cache, f"{repo}@{v2}", NOREG, "--json").out)["path"]
    assert backing == cached_path
    flagged, _ = _domain_backing(tmp_path / "c-flag", vmi, "--pull-policy", "IfNotPresent")
    assert "cached" not in flagged.err  # a node that never had it pulls it
    _, first_backing = _domain_backing(cache, vmi, "--pull-policy", "Always")
    always_path = json.loads(pull(cache, f"{repo}@{v3}", NOREG, "--json").out)["path"]
    assert first_backing == always_path != cached_path
    push(versions[0])  # the tag moves again: the spec's own Always follows it
    vmi.write_text(body % (ref, ", imagePullPolicy: Always"))
    spec_always, backing = _domain_backing(cache, vmi)
    assert backing == json.loads(pull(cache, f"{repo}@{v1}", NOREG, "--json").out)["path"]
    assert "cached" not in spec_always.err

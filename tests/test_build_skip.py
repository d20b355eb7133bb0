"""Skip what is there: an unchanged rebuild sends no layer, and `--skip-if-label` does nothing at all.

The registry is real; the fault proxy only counts requests (no fault is injected).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path

import pytest
import requests

from diskkit.ops import buildrecord
from tests.conftest import make_qcow2

FAST = ["--tls-verify=false", "--retry-delay", "0.05"]


@pytest.fixture
def cache_env(tmp_path):
    return {"XDG_CACHE_HOME": str(tmp_path / "cache")}


class Settled:
    """Input disks changed more than buildrecord.SETTLE_NS ago (a file changed more recently is built but
    not recorded), each test's own: made a batch at a time, the batch waiting out the second once."""

    BATCH = 12

    def __init__(self, root: Path):
        self.root, self.ready, self.made = root, [], 0

    def take(self) -> Path:
        if not self.ready:
            for _ in range(self.BATCH):
                slot = self.root / str(self.made)
                slot.mkdir()
                self.made += 1
                make_qcow2(slot / "guest.qcow2", size="32M", pattern=0x5A)
                with open(slot / "disk.img", "wb") as f:  # as conftest's raw_disk
                    f.write(b"\xcd" * (1 << 20))
                    f.truncate(32 << 20)
                self.ready.append(slot)
            time.sleep(1.1)  # past buildrecord.SETTLE_NS
        return self.ready.pop(0)


@pytest.fixture(scope="module")
def settled(tmp_path_factory) -> Settled:
    return Settled(tmp_path_factory.mktemp("settled"))


@pytest.fixture
def disk(settled):
    return settled.take() / "guest.qcow2"


@pytest.fixture
def raw_disk(settled):
    return settled.take() / "disk.img"


def _build(diskkit, disk, target, env, *extra):
    result = diskkit("build", disk, "-t", target, "--json", *FAST, *extra, env=env)
    assert result.code == 0, result.err
    out = json.loads(result.out)
    blobs = [json.loads(line) for line in result.err.splitlines() if line.startswith("{") and '"event": "blob"' in line]
    return out, blobs


def _uploads(proxy):
    return [(method, path) for method, path, _ in proxy.log if "/blobs/uploads/" in path and method in ("POST", "PATCH", "PUT")]


def _target(proxy):
    return f"{proxy.host}/skip-{uuid.uuid4().hex[:8]}:v1"


def test_unchanged_rebuild_sends_no_layer(diskkit, registry, fault_proxy, disk, cache_env):
    proxy = fault_proxy(registry)
    target = _target(proxy)
    first, blobs = _build(diskkit, disk, target, cache_env)
    assert [b["status"] for b in blobs] == ["uploaded"]
    assert _uploads(proxy)  # the first build does stream the layer
    proxy.log.clear()
    second, blobs = _build(diskkit, disk, target, cache_env)
    layer = first["layers"][0]["digest"]
    assert [b["status"] for b in blobs] == ["exists"]
    assert _uploads(proxy) == []
    assert ("HEAD", f"/v2/{target.split('/', 1)[1].split(':')[0]}/blobs/{layer}") in [(m, p) for m, p, _ in proxy.log]
    assert second["digest"] == first["digest"]
    assert second["layers"] == first["layers"]
    assert diskkit("verify", *FAST, target).code == 0


def test_touched_source_builds_normally(diskkit, registry, fault_proxy, disk, cache_env):
    proxy = fault_proxy(registry)
    target = _target(proxy)
    first, _ = _build(diskkit, disk, target, cache_env)
    st = disk.stat()
    os.utime(disk, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    proxy.log.clear()
    second, blobs = _build(diskkit, disk, target, cache_env)
    assert [b["status"] for b in blobs] == ["uploaded"]
    assert any(method == "PUT" for method, _ in _uploads(proxy))
    assert second["digest"] == first["digest"]  # same bytes, same image: only the shortcut was refused


def test_stale_record_uploads_again(diskkit, registry, fault_proxy, disk, cache_env):
    proxy = fault_proxy(registry)
    target = _target(proxy)
    first, _ = _build(diskkit, disk, target, cache_env)
    repo = target.split("/", 1)[1].split(":")[0]
    layer = first["layers"][0]["digest"]
    gone = requests.delete(registry.url(f"/v2/{repo}/blobs/{layer}"), timeout=30)
    assert gone.status_code == 202, gone.text
    assert requests.head(registry.url(f"/v2/{repo}/blobs/{layer}"), timeout=30).status_code == 404
    proxy.log.clear()
    second, blobs = _build(diskkit, disk, target, cache_env)
    assert [b["status"] for b in blobs] == ["uploaded"]
    assert any(method == "PUT" for method, _ in _uploads(proxy))
    assert second["digest"] == first["digest"]
    assert requests.head(registry.url(f"/v2/{repo}/blobs/{layer}"), timeout=30).status_code == 200
    assert diskkit("verify", *FAST, target).code == 0


def test_corrupt_record_is_ignored(diskkit, registry, fault_proxy, disk, cache_env, tmp_path):
    proxy = fault_proxy(registry)
    target = _target(proxy)
    first, _ = _build(diskkit, disk, target, cache_env)
    records = list((tmp_path / "cache/diskkit/builds").glob("*.json"))
    assert len(records) == 1
    records[0].write_text("{not json")
    second, blobs = _build(diskkit, disk, target, cache_env)
    assert [b["status"] for b in blobs] == ["uploaded"]
    assert second["digest"] == first["digest"]


def test_a_file_changed_just_now_is_not_recorded(tmp_path):
    # Another write in the same timestamp tick would keep the pin with other bytes: no record for it.
    path = tmp_path / "fresh.img"
    path.write_bytes(b"x" * 4096)
    name, settled = buildrecord.key([("/disk/fresh.img", path)], {"compression": "gzip"})
    assert not settled
    old = time.time_ns() - 2 * buildrecord.SETTLE_NS
    os.utime(path, ns=(old, old))  # moves mtime; ctime stays now: still not settled
    again, settled = buildrecord.key([("/disk/fresh.img", path)], {"compression": "gzip"})
    assert not settled and again != name  # and the pin moved with mtime


def test_every_setting_is_in_the_key(tmp_path):
    path = tmp_path / "disk.img"
    path.write_bytes(b"x" * 4096)
    files = [("/disk/disk.img", path)]
    base = {"compression": "gzip", "level": None, "lazy": True, "created": 0}
    names = {buildrecord.key(files, base)[0]}
    for change in ({"level": 1}, {"lazy": False}, {"created": 1}, {"compression": "zstd"}):
        names.add(buildrecord.key(files, {**base, **change})[0])
    names.add(buildrecord.key([("/images/disk.img", path)], base)[0])
    assert len(names) == 6
    assert buildrecord.key(files, dict(base))[0] in names


def test_skip_if_label_both_ways(diskkit, registry, fault_proxy, disk, cache_env):
    proxy = fault_proxy(registry)
    target = _target(proxy)
    # The tag does not exist yet: the check says build.
    first, _ = _build(diskkit, disk, target, cache_env, "--label", "shasum=aaa", "--skip-if-label", "shasum=aaa")
    proxy.log.clear()
    same = diskkit("build", disk, "-t", target, *FAST, "--label", "shasum=aaa", "--skip-if-label", "shasum=aaa", env=cache_env)
    assert same.code == 0, same.err
    assert "nothing done" in same.out and "shasum=aaa" in same.out
    assert len(same.out.strip().splitlines()) == 1
    assert not [m for m, p, _ in proxy.log if m in ("PUT", "POST", "PATCH")]  # nothing written at all
    changed, _ = _build(diskkit, disk, target, cache_env, "--label", "shasum=bbb", "--skip-if-label", "shasum=bbb")
    assert changed["digest"] != first["digest"]
    as_json = diskkit("build", disk, "-t", target, *FAST, "--json", "--label", "shasum=bbb", "--skip-if-label", "shasum=bbb", env=cache_env)
    assert as_json.code == 0, as_json.err
    assert json.loads(as_json.out)["skipped"] is True


def test_skip_if_label_refusals(diskkit, tmp_path, disk):
    bad = diskkit("build", disk, "-t", f"oci:{tmp_path / 'l'}:x", "--skip-if-label", "k=v")
    assert bad.code != 0 and len(bad.err.strip().splitlines()) == 1
    assert "--skip-if-label" in bad.err and "registry" in bad.err
    bad = diskkit("build", disk, "-t", "127.0.0.1:1/x:y", "--skip-if-label", "novalue")
    assert bad.code != 0 and "must be KEY=VALUE" in bad.err


def _logging_qemu_img(tmp_path):
    """PATH with a qemu-img that notes its subcommand and runs the real one."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    real = shutil.which("qemu-img")
    assert real, "qemu-img is needed"
    (bin_dir / "qemu-img").write_text(f'#!/bin/sh\necho "$1" >> {tmp_path / "qemu-img.log"}\nexec {real} "$@"\n')
    (bin_dir / "qemu-img").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}, tmp_path / "qemu-img.log"


def test_unchanged_rebuild_of_a_converted_disk(diskkit, registry, fault_proxy, raw_disk, cache_env, tmp_path):
    # raw in, qcow2 in the image: the rebuild neither converts nor sends, and names the disk the same.
    path_env, calls = _logging_qemu_img(tmp_path)
    cache_env = {**cache_env, **path_env}
    proxy = fault_proxy(registry)
    target = _target(proxy)
    first, _ = _build(diskkit, raw_disk, target, cache_env, "--format", "qcow2")
    assert first["disk"] == {"path": "/disk/disk.qcow2", "format": "qcow2", "virtualSize": 32 << 20}
    assert "convert" in calls.read_text().split()
    calls.unlink()
    proxy.log.clear()
    second = diskkit("build", raw_disk, "-t", target, "--json", *FAST, "--format", "qcow2", env=cache_env)
    assert second.code == 0, second.err
    assert '"status": "exists"' in second.err
    assert "convert" not in calls.read_text().split()  # info ran (the disk is still examined), convert did not
    assert _uploads(proxy) == []
    assert json.loads(second.out) == first


def test_a_new_repository_mounts_the_recorded_layer(diskkit, registry, fault_proxy, disk, cache_env):
    # Built to A, then to B on the same registry: B's HEAD misses, the record names A, the registry
    # links the blob from A (a cross-repository mount), nothing is streamed.
    proxy = fault_proxy(registry)
    first, _ = _build(diskkit, disk, _target(proxy), cache_env)
    proxy.log.clear()
    other = _target(proxy)
    second, blobs = _build(diskkit, disk, other, cache_env)
    assert [b["status"] for b in blobs] == ["mounted"]
    layer = first["layers"][0]["digest"]
    assert not [m for m, p, _ in proxy.log if m == "PATCH" or (m == "PUT" and layer in p)]  # the new config alone is PUT
    assert [s for m, p, s in proxy.log if m == "POST" and "mount=" in p] == [201]
    assert second["digest"] == first["digest"]
    assert diskkit("verify", *FAST, other).code == 0


def test_a_record_others_can_write_is_not_used(diskkit, registry, fault_proxy, disk, cache_env, tmp_path):
    # A record in a directory another user could write might name their blob for our input.
    proxy = fault_proxy(registry)
    target = _target(proxy)
    first, _ = _build(diskkit, disk, target, cache_env)
    builds = tmp_path / "cache/diskkit/builds"
    assert builds.stat().st_mode & 0o777 == 0o700
    builds.chmod(0o777)
    second, blobs = _build(diskkit, disk, target, cache_env)
    assert [b["status"] for b in blobs] == ["uploaded"]
    builds.chmod(0o700)
    record = next(builds.glob("*.json"))
    record.chmod(0o666)
    third, blobs = _build(diskkit, disk, target, cache_env)
    assert [b["status"] for b in blobs] == ["uploaded"]
    record.chmod(0o600)
    fourth, blobs = _build(diskkit, disk, target, cache_env)
    assert [b["status"] for b in blobs] == ["exists"]
    assert first["digest"] == second["digest"] == third["digest"] == fourth["digest"]


def test_skip_if_label_needs_every_platform(diskkit, registry, fault_proxy, disk, tmp_path, cache_env):
    # medius compares each architecture it would build: one missing from the index means build.
    arm = make_qcow2(tmp_path / "arm.qcow2", size="32M", pattern=0x22)
    proxy = fault_proxy(registry)
    target = _target(proxy)
    amd_only = diskkit("build", disk, "--platform", "linux/amd64", "-t", target, *FAST, "--label", "v=1", env=cache_env)
    assert amd_only.code == 0, amd_only.err
    both = ["--platform", f"linux/amd64={disk}", "--platform", f"linux/arm64={arm}", "-t", target, *FAST, "--label", "v=1", "--skip-if-label", "v=1"]
    built = diskkit("build", *both, env=cache_env)
    assert built.code == 0, built.err
    assert "nothing done" not in built.out and built.last_line.startswith("sha256:")
    again = diskkit("build", *both, env=cache_env)
    assert again.code == 0, again.err
    assert "nothing done" in again.out

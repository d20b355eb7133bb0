"""A fault-injecting proxy in front of the real registry: transfers recover or fail cleanly.

The registry is real; only the faults a real server cannot be made to produce on demand (a
dropped connection, a flipped byte, a short body, a stall, a burst of 503/429) come from the proxy.
"""

from __future__ import annotations

import json
import os
import uuid

import pytest

from tests.conftest import run
from diskkit.transports.remote import RETAIN, SEGMENT
from tests.faultproxy import Fault

FAST = ["--tls-verify=false", "--retry-delay", "0.05"]


@pytest.fixture
def noisy_disk(tmp_path):
    # Incompressible, so the layer blob is big enough to cut in the middle.
    path = tmp_path / "noisy.img"
    path.write_bytes(os.urandom(8 << 20))
    return path


@pytest.fixture
def pushed(diskkit, registry, noisy_disk):
    target = f"{registry.host}/faults-{uuid.uuid4().hex[:8]}:v1"
    result = diskkit("build", noisy_disk, "-t", target, "--json", *FAST)
    assert result.code == 0, result.err
    return target, json.loads(result.out)


@pytest.fixture
def out_dir(tmp_path):
    """An empty directory for pull destinations, to show that failures leave nothing in it."""
    path = tmp_path / "out"
    path.mkdir()
    return path


def via(proxy, registry, target: str) -> str:
    return target.replace(registry.host, proxy.host)


def layer_path(out: dict) -> str:
    return f"/blobs/{out['layers'][0]['digest']}"


def pull(diskkit, ref, dest):
    return diskkit("push", *FAST, ref, dest)


def test_dropped_download_resumes_with_range(diskkit, registry, fault_proxy, pushed, tmp_path):
    target, out = pushed
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", layer_path(out), "drop", arg=(4 << 20) + 12345))
    result = pull(diskkit, via(proxy, registry, target), f"oci:{tmp_path / 'l'}:x")
    assert result.code == 0, result.err
    statuses = [status for method, path, status in proxy.log if method == "GET" and path.endswith(out["layers"][0]["digest"])]
    assert 206 in statuses  # the second request asked for the rest with Range
    assert diskkit("verify", f"oci:{tmp_path / 'l'}:x").code == 0


def test_truncated_body_resumes(diskkit, registry, fault_proxy, pushed, tmp_path):
    target, out = pushed
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", layer_path(out), "truncate", arg=12345))
    result = pull(diskkit, via(proxy, registry, target), f"oci:{tmp_path / 'l'}:x")
    assert result.code == 0, result.err
    assert diskkit("verify", f"oci:{tmp_path / 'l'}:x").code == 0


def test_503_and_429_with_retry_after_are_retried(diskkit, registry, fault_proxy, pushed, tmp_path):
    target, out = pushed
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", "/manifests/", "status", arg=503, times=2))
    proxy.add(Fault("GET", layer_path(out), "retry_after", arg=1))
    result = pull(diskkit, via(proxy, registry, target), f"oci:{tmp_path / 'l'}:x")
    assert result.code == 0, result.err
    sent = [status for _, _, status in proxy.log]
    assert sent.count(503) == 2 and sent.count(429) == 1


def test_flipped_byte_is_refused_and_nothing_is_kept(diskkit, registry, fault_proxy, pushed, tmp_path, out_dir):
    target, out = pushed
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", layer_path(out), "flip", arg=100000, times=50))
    for dest in (f"oci:{out_dir / 'l'}:x", f"oci-archive:{out_dir / 'a.tar'}:x"):
        result = pull(diskkit, via(proxy, registry, target), dest)
        assert result.code == 1
        assert "does not match its digest" in result.err
    assert os.listdir(out_dir) == []
    # Into an existing layout: the bad blob never lands under its digest.
    layout = tmp_path / "existing"
    assert diskkit("push", *FAST, target, f"oci:{layout}:good").code == 0
    (layout / "blobs/sha256" / out["layers"][0]["digest"][7:]).unlink()
    assert pull(diskkit, via(proxy, registry, target), f"oci:{layout}:bad").code == 1
    assert not (layout / "blobs/sha256" / out["layers"][0]["digest"][7:]).exists()
    assert [p for p in os.listdir(layout / "blobs/sha256") if p.startswith(".")] == []
    index = json.loads((layout / "index.json").read_text())
    assert [m["annotations"]["org.opencontainers.image.ref.name"] for m in index["manifests"]] == ["good"]


def test_persistent_failure_gives_a_clear_error(diskkit, registry, fault_proxy, pushed, out_dir):
    target, out = pushed
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", layer_path(out), "truncate", arg=1000, times=100))
    result = diskkit("push", "--tls-verify=false", "--retry-delay", "0.01", "--retry-times", "3", via(proxy, registry, target), f"oci:{out_dir / 'l'}:x")
    assert result.code == 1
    assert len(result.err.strip().splitlines()) == 1
    assert proxy.host in result.err and "kept failing" in result.err
    assert os.listdir(out_dir) == []


def test_stall_is_waited_out(diskkit, registry, fault_proxy, pushed, tmp_path):
    target, out = pushed
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", layer_path(out), "stall", arg=1.5))
    assert pull(diskkit, via(proxy, registry, target), f"oci:{tmp_path / 'l'}:x").code == 0


def _upload_through(diskkit, registry, proxy, disk, tmp_path):
    name = f"faults-{uuid.uuid4().hex[:8]}"
    result = diskkit("build", disk, "-t", f"{proxy.host}/{name}:v1", "--json", *FAST)
    assert result.code == 0, result.err
    target = f"{registry.host}/{name}:v1"
    run("skopeo", "copy", "--src-tls-verify=false", f"docker://{target}", f"oci:{tmp_path / name}:x")
    assert diskkit("verify", *FAST, target).code == 0
    return result


def test_upload_dropped_before_data_continues_from_the_reported_range(diskkit, registry, fault_proxy, noisy_disk, tmp_path):
    proxy = fault_proxy(registry)
    proxy.add(Fault("PATCH", "/blobs/uploads/", "drop", arg=0))
    proxy.add(Fault("PUT", "/manifests/", "status", arg=503))
    _upload_through(diskkit, registry, proxy, noisy_disk, tmp_path)
    log = [(m, s) for m, _, s in proxy.log]
    assert ("GET", 204) in log  # the upload status said where to continue
    patches = [s for m, s in log if m == "PATCH"]
    # The dropped chunk, then the same chunk in the same session, then the rest of the layer (how
    # many chunks that takes depends on the layer's size, not on the fault).
    assert patches[:2] == [0, 202] and set(patches[2:]) <= {202}, patches
    assert [m for m, _ in log].count("POST") == 2  # the layer's session and the config's, no restart


def test_upload_session_lost_mid_chunk_is_sent_again(diskkit, registry, fault_proxy, noisy_disk, tmp_path):
    # distribution drops a session whose chunk arrived in part (its upload state no longer
    # matches); the layer is then produced and sent again from its first byte.
    proxy = fault_proxy(registry)
    proxy.add(Fault("PATCH", "/blobs/uploads/", "drop", arg=1 << 20))
    result = _upload_through(diskkit, registry, proxy, noisy_disk, tmp_path)
    assert "sending it again from the start" in result.err
    log = [(m, s) for m, _, s in proxy.log]
    patches = [s for m, s in log if m == "PATCH"]
    assert patches[:2] == [0, 202] and set(patches[2:]) <= {202}, patches
    assert [m for m, _ in log].count("POST") == 3  # the lost session, its replacement, the config


def _segments_plus(tmp_path, extra: int):
    path = tmp_path / "segments.img"
    with open(path, "wb") as f:
        for _ in range((SEGMENT + extra) >> 20):
            f.write(os.urandom(1 << 20))
    return path


def test_a_large_layer_streams_in_segments_and_a_refused_one_goes_again_in_the_same_session(diskkit, registry, fault_proxy, tmp_path):
    # Two PATCHes, the second refused once: the registry acknowledged the first segment, and the
    # bytes sent since are still held, so they go again in the same session.
    disk = _segments_plus(tmp_path, 8 << 20)
    proxy = fault_proxy(registry)
    proxy.add(Fault("PATCH", "/blobs/uploads/", "status", arg=500, skip=1))
    _upload_through(diskkit, registry, proxy, disk, tmp_path)
    log = [(m, s) for m, _, s in proxy.log]
    assert [s for m, s in log if m == "PATCH"] == [202, 500, 202]
    assert ("GET", 204) in log
    assert [m for m, _ in log].count("POST") == 2  # the layer's session and the config's, no restart


def test_a_segment_refused_after_more_than_is_held_sends_the_layer_again(diskkit, registry, fault_proxy, tmp_path):
    # The second segment is longer than what is kept for resending: after the refusal the registry
    # has only the first segment, whose last bytes are gone from memory, so the layer is produced again.
    disk = _segments_plus(tmp_path, RETAIN + (8 << 20))
    proxy = fault_proxy(registry)
    proxy.add(Fault("PATCH", "/blobs/uploads/", "status", arg=500, skip=1))
    result = _upload_through(diskkit, registry, proxy, disk, tmp_path)
    assert "resending from there needs more than the 16 MiB kept; sending it again from the start" in result.err
    log = [(m, s) for m, _, s in proxy.log]
    assert [s for m, s in log if m == "PATCH"] == [202, 500, 202, 202]
    assert [m for m, _ in log].count("POST") == 3  # the lost session, its replacement, the config


def test_failed_pushes_lose_nothing_already_in_the_registry(diskkit, registry, fault_proxy, pushed, noisy_disk, tmp_path):
    target, out = pushed
    proxy = fault_proxy(registry)
    proxy.add(Fault("PATCH", "/blobs/uploads/", "status", arg=500, times=100))
    proxy.add(Fault("PUT", "/blobs/uploads/", "status", arg=500, times=100))
    noisy_disk.write_bytes(os.urandom(1 << 20))
    result = diskkit("build", noisy_disk, "-t", via(proxy, registry, target), "--tls-verify=false", "--retry-delay", "0.01", "--retry-times", "2")
    assert result.code == 7 and "HTTP 500" in result.err  # Exit.UNAVAILABLE
    info = json.loads(run("skopeo", "inspect", "--tls-verify=false", f"docker://{target}").stdout)
    assert info["Digest"] == out["digest"]
    assert diskkit("verify", *FAST, target).code == 0


def test_copy_upload_dropped_mid_stream_is_sent_again(diskkit, registry, fault_proxy, noisy_disk, tmp_path):
    layout = f"oci:{tmp_path / 'layout'}:v1"
    assert diskkit("build", noisy_disk, "-t", layout).code == 0
    proxy = fault_proxy(registry)
    proxy.add(Fault("PUT", "/blobs/uploads/", "drop", arg=1 << 20))
    name = f"faults-{uuid.uuid4().hex[:8]}"
    result = diskkit("push", *FAST, layout, f"{proxy.host}/{name}:v1")
    assert result.code == 0, result.err
    assert "sending it again from the start" in result.err
    assert diskkit("verify", *FAST, f"{registry.host}/{name}:v1").code == 0

"""The disk server's lifetime, without a VM: it ends promptly on SIGTERM even while reads wait on an
unreachable registry, by itself when its cache directory is deleted, and (started to exit when idle)
once its last NBD client is gone with nothing left to fetch, but never before an announced client
has connected."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import run, run_diskkit
from tests.distribution import start_registry
from tests.faultproxy import Fault
from launcher.diskserver.lazydisk import BOOT_HOLD
from tests.lazyhost import QEMU_UID, control, disk_server, export_status, open_export, random_disk, wait_for

NOREG = "--tls-verify=false"
MIB = 1 << 20


@pytest.fixture(scope="module")
def guest_raw(tmp_path_factory) -> Path:
    return random_disk(tmp_path_factory.mktemp("lifetime") / "guest-8m.img", 8 * MIB)


@pytest.fixture(scope="module")
def lazy_image(registry, guest_raw) -> str:
    ref = f"{registry.host}/lifetime/guest:toc"
    # TOC v1 (uncompressed): a test below stalls the read of the blob's first 1024 bytes, the bytes before its disk.
    result = run_diskkit("build", NOREG, "--lazy", "--compression", "none", guest_raw, "-t", ref)
    assert result.code == 0, result.err
    return ref


def server_log(cache: Path) -> str:
    return (cache.parent / f"serve-{cache.name}.log").read_text(errors="replace")


def test_sigterm_ends_a_server_whose_reads_wait_on_the_registry(tmp_path, registry, fault_proxy, lazy_image):
    proxy = fault_proxy(registry)
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache, "--prefetch-rate", "1K") as server:
        answer = open_export(cache, lazy_image.replace(registry.host, proxy.host))
        # Every range request from now on hangs in the registry: the reader below waits in the server.
        proxy.add(Fault("GET", r"/blobs/sha256:", "stall", times=100, arg=100))
        reader = subprocess.Popen(["qemu-io", "-r", "-f", "raw", "-c", "read 0 1M", answer["url"]],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for(lambda: export_status(cache, answer["export"])["stats"]["demand_fetches"] >= 1, 60, "the read to reach the registry")
            started = time.monotonic()
            server.send_signal(signal.SIGTERM)
            # Before: 21-40 s (fetch threads joined one after another, read workers joined at exit).
            code = server.wait(timeout=15)
            took = time.monotonic() - started
        finally:
            reader.kill()
            reader.wait()
        print(f"SIGTERM to exit: {took:.2f} s")
        assert code == 0, server_log(cache)
        assert "stopping (signal)" in server_log(cache) and "stopped" in server_log(cache)
        assert not (cache / "serve" / "control.sock").exists()


def test_a_server_whose_cache_directory_is_deleted_exits(tmp_path, lazy_image):
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache, "--prefetch-rate", "1K") as server:
        open_export(cache, lazy_image)
        shutil.rmtree(cache)
        code = server.wait(timeout=30)
    assert f"cache directory {cache} is gone: exiting" in server_log(cache), server_log(cache)
    assert code == 0


def opened_by_a_run_that_ends(cache: Path, image: str) -> dict:
    """The server's answer to an open announcing one VM, asked by a process that exits after it, as
    a run that failed before its VM started does."""
    opener = subprocess.run([sys.executable, "-c", "import sys, json; from launcher.diskserver.control import request; "
                             "print(json.dumps(request(__import__('pathlib').Path(sys.argv[1]), json.loads(sys.argv[2]))))",
                             cache / "serve" / "control.sock",
                             json.dumps({"op": "open", "image": image, "registry": {"tls_verify": False}, "clients": 1})],
                            capture_output=True, text=True)
    assert opener.returncode == 0, opener.stderr
    return json.loads(opener.stdout)


def test_an_idle_exiting_server_waits_for_its_announced_client_then_leaves_with_it(tmp_path, lazy_image, guest_raw):
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache, "--exit-when-idle", "1") as server:
        answer = control(cache, {"op": "open", "image": lazy_image, "registry": {"tls_verify": False}, "clients": 1})
        assert answer["ok"], answer
        wait_for(lambda: export_status(cache, answer["export"])["installed"], 60, "the disk to be fetched")
        # Nothing left to fetch and idle far longer than 1 s, but the announced client (a VM whose
        # qemu libvirt is still starting) has not connected: the server stays.
        time.sleep(4)
        assert server.poll() is None, server_log(cache)
        assert run("qemu-img", "compare", "-f", "raw", "-F", "raw", answer["url"], guest_raw).stdout.strip() == "Images are identical."
        code = server.wait(timeout=60)
    assert code == 0
    assert "its last VM is gone and nothing is left to fetch: exiting" in server_log(cache), server_log(cache)


def test_a_server_started_to_exit_when_idle_keeps_fetching_after_its_last_client(tmp_path, registry):
    """Its last VM gone, the rest of the disk still arrives (and is installed) before the server leaves."""
    guest_raw = random_disk(tmp_path / "guest-16m.img", 16 * MIB, seed=7)
    lazy_image = f"{registry.host}/lifetime/guest:big"
    assert run_diskkit("build", NOREG, "--lazy", guest_raw, "-t", lazy_image).code == 0
    cache = tmp_path / "cache"
    cache.mkdir()
    # 4 MiB/s after a first 8 MiB span: two seconds of fetching left when the reader below is done.
    with disk_server(cache, "--exit-when-idle", "0", "--prefetch-rate", "4M") as server:
        answer = open_export(cache, lazy_image)
        run("qemu-io", "-r", "-f", "raw", "-c", "read 0 1M", answer["url"])
        assert not export_status(cache, answer["export"])["installed"]
        code = server.wait(timeout=120)
    assert code == 0
    installed = cache / "disks" / "sha256" / answer["layer"].removeprefix("sha256:")
    assert [p.read_bytes() == guest_raw.read_bytes() for p in installed.glob("*/disk.img")] == [True]


def test_run_says_in_one_line_that_its_cache_directory_vanished(tmp_path, registry, fault_proxy, lazy_image, qemu_user):
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", r"/manifests/", "stall", times=1, arg=8))  # the run waits here while the cache goes
    cache = qemu_user.root / "vanishing"
    cache.mkdir()
    os.chown(cache, QEMU_UID, QEMU_UID)
    vmi = qemu_user.write_vmi("vanishing", lazy_image.replace(registry.host, proxy.host))
    proc = qemu_user.popen("run", NOREG, "--no-lazy", "--cache-dir", cache, "--timeout", "120", vmi)
    try:
        wait_for(lambda: not proxy.pending, 60, "the run to ask for the manifest")
        shutil.rmtree(cache)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert err.strip() == f"launcher: {cache}: the cache directory disappeared while the VM was being prepared", err


def test_run_timeout_counts_the_preparation_too(registry, fault_proxy, guest_image, qemu_user):
    """A registry that keeps the run waiting 14 s leaves 2 s of a 16 s --timeout for the guest: not
    enough for the test guest to finish under TCG, which it does when the clock starts at boot."""
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", r"/manifests/", "stall", times=1, arg=14))
    vmi = qemu_user.write_vmi("slow-prep", guest_image.replace(registry.host, proxy.host))
    result = qemu_user.launcher("run", NOREG, "--no-lazy", "--console", "--timeout", "16", vmi)
    assert result.code != 0 and not proxy.pending
    # Out of time while following the guest, or already while pulling and starting it.
    assert result.err.strip().splitlines()[-1] in (
        "launcher: default_slow-prep: the VM was still running after 16 s; the domain was destroyed",
        "launcher: default_slow-prep: not started within --timeout 16 s (pulling, serving or starting it); nothing was left"), result.err
    assert not (qemu_user.cache / "run" / "default_slow-prep").exists()


def test_a_server_killed_while_opening_an_export_leaves_nothing_to_the_next(tmp_path, registry, fault_proxy, lazy_image):
    proxy = fault_proxy(registry)
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache, "--prefetch-rate", "1K"):
        answer = open_export(cache, lazy_image.replace(registry.host, proxy.host))
    # A VM reconnecting after a restart has the export made again (here its disk file was lost):
    # the setup reads the blob's bytes before the disk (0-1023) into a staging directory: hold it there.
    (cache / "lazy" / answer["export"] / "disk.img").unlink()
    proxy.add(Fault("GET", r"/blobs/sha256:", "stall", times=1, arg=60, header=("Range", r"^bytes=0-1023$")))
    with disk_server(cache) as server:
        prober = subprocess.Popen(["qemu-img", "info", answer["url"]], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            staging = wait_for(lambda: list((cache / "lazy").glob(".*")), 60, "the export's staging directory")
            server.send_signal(signal.SIGKILL)
            server.wait()
        finally:
            prober.kill()
            prober.wait()
    assert all(p.exists() for p in staging)
    with disk_server(cache):
        assert list((cache / "lazy").glob(".*")) == []
        assert "left by a server that was killed" in server_log(cache)


def test_an_announced_client_is_not_waited_for_once_the_run_that_announced_it_is_gone(tmp_path, lazy_image):
    """A run that failed before its VM started (it exits) does not keep an idle-exiting server for 10 min."""
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache, "--exit-when-idle", "1") as server:
        assert opened_by_a_run_that_ends(cache, lazy_image)["ok"]
        code = server.wait(timeout=120)  # once the disk is fetched: nothing holds it
    assert code == 0
    assert "idle for 1 s and nothing is left to fetch: exiting" in server_log(cache), server_log(cache)


def test_the_rest_of_a_disk_whose_run_died_before_its_vm_is_not_held_for_a_boot(tmp_path, registry):
    """An open holds all but the disk's head and read-ahead for BOOT_HOLD seconds, so that the VM it
    announces boots first; once the run that asked is gone and no VM is connected, no boot is coming."""
    guest_raw = random_disk(tmp_path / "guest-64m.img", 64 * MIB, seed=11)
    lazy_image = f"{registry.host}/lifetime/guest:deserted"
    assert run_diskkit("build", NOREG, "--lazy", guest_raw, "-t", lazy_image).code == 0
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache):
        opened = time.monotonic()
        export = opened_by_a_run_that_ends(cache, lazy_image)["export"]
        # Not a timing claim: the hold's own length is the bound, and the rest is 30 MiB from loopback.
        wait_for(lambda: export_status(cache, export)["installed"] or time.monotonic() - opened > BOOT_HOLD, BOOT_HOLD + 60, "the disk or the hold's end")
        assert export_status(cache, export)["installed"] and time.monotonic() - opened < BOOT_HOLD, (export_status(cache, export), server_log(cache))


def test_run_timeout_holds_while_the_registry_keeps_it_preparing(registry, fault_proxy, guest_image, qemu_user):
    proxy = fault_proxy(registry)
    proxy.add(Fault("GET", r"/manifests/", "stall", times=1, arg=45))
    vmi = qemu_user.write_vmi("stuck-prep", guest_image.replace(registry.host, proxy.host))
    result = qemu_user.launcher("run", NOREG, "--no-lazy", "--timeout", "8", vmi)
    assert result.code == 4  # Exit.TIMEOUT
    assert result.err.strip() == ("launcher: default_stuck-prep: not started within --timeout 8 s (pulling, serving or starting it); "
                                  "nothing was left"), result.err
    assert not (qemu_user.cache / "run" / "default_stuck-prep").exists()


@pytest.mark.parametrize("gone", ["stopped", "503"])
def test_an_idle_server_gives_up_a_fill_whose_registry_is_gone_and_exits(tmp_path, fault_proxy, gone):
    """The registry goes away while the background fill is half done and no VM reads: the server
    records why in the export's state.json and exits within its fetch timeout (plus one fetch's
    retries) and its idle time. Before, it retried forever (found alive 15 minutes later,
    `lastFailure: null` in its state)."""
    own = start_registry(tmp_path / "registry")  # this test stops it
    try:
        guest_raw = random_disk(tmp_path / "guest-32m.img", 32 * MIB, seed=11)
        image = f"{own.host}/lifetime/guest:gone"
        assert run_diskkit("build", NOREG, "--lazy", guest_raw, "-t", image).code == 0
        proxy = fault_proxy(own)
        cache = tmp_path / "cache"
        cache.mkdir()
        with disk_server(cache, "--exit-when-idle", "1", "--prefetch-rate", "1M", "--fetch-timeout", "3") as server:
            answer = open_export(cache, image.replace(own.host, proxy.host))
            run("qemu-io", "-r", "-f", "raw", "-c", "read 0 1M", answer["url"])  # the VM that came and went
            wait_for(lambda: export_status(cache, answer["export"])["present"] >= 2, 60, "the fill to start")
            if gone == "stopped":
                own.stop()
            else:
                proxy.add(Fault("GET", r"/blobs/sha256:", "status", times=100000, arg=503))
            code = server.wait(timeout=120)
    finally:
        own.stop()
    assert code == 0, server_log(cache)
    state = json.loads((cache / "lazy" / answer["export"] / "state.json").read_text())
    assert not state["installed"] and state["present"] < state["chunks"]
    assert "giving up the rest" in state["abandoned"], state
    assert "no VM is reading and the fill has not moved for" in server_log(cache)
    assert "its last VM is gone and the rest of a disk was given up: exiting" in server_log(cache), server_log(cache)

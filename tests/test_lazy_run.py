"""Booting before the image has arrived: `launcher run --lazy` as the qemu user (UID 107), through
libvirt's session daemon, the disk served by `launcher serve` over NBD from a real registry.

The guest is the test guest padded with random data to 256 MiB, and the server prefetches slowly,
so the console's first line appears while most of the blob is still in the registry; a corrupt
range response, a registry restart mid-boot and a server started by `run` itself are survived."""

from __future__ import annotations

import json
import random
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import run, run_diskkit, run_launcher
from tests.distribution import start_registry
from tests.faultproxy import Fault
from tests.lazyhost import (
    QEMU_UID,
    build_lazy_image,
    control,
    disk_server,
    first_chunk_at,
    image_toc,
    padded_guest,
    stop_spawned_server,
    wait_for,
)
from tests.testguest import ensure_testguest, parse_console
from tests.vmhost import DONE, NOREG, assert_clean

READY = "DISKKIT-TESTGUEST v1 READY"
PADDED = 256 << 20
OLD_DISK = 8 << 20


@pytest.fixture(scope="module")
def lazy_registry(tmp_path_factory):
    """A registry of this module's own: one test stops and restarts it."""
    registry = start_registry(tmp_path_factory.mktemp("lazy-registry"))
    yield registry
    registry.stop()


def push_padded(registry, root: Path, tag: str, seed: int, size: int = PADDED) -> tuple[str, Path]:
    disk = padded_guest(ensure_testguest() / "testguest-poweroff.qcow2", root / f"padded-{tag}.img", size, seed)
    return build_lazy_image(disk, f"{registry.host}/lazy/guest:{tag}"), disk


@pytest.fixture(scope="module")
def padded_image(lazy_registry, qemu_user) -> tuple[str, Path]:
    return push_padded(lazy_registry, qemu_user.root, "padded", 1)


def header_read(cache: Path) -> bool:
    """The export is open and its first chunk is here: the server read the disk's header before
    answering the run. An export is listed before that read, and a registry stopped in between
    (with a fetch timeout of a second or two) would fail the open, not the guest's reads."""
    exports = control(cache, {"op": "status"})["exports"]
    return bool(exports) and exports[0]["present"] >= 1


def only_export(cache: Path) -> dict:
    exports = control(cache, {"op": "status"})["exports"]
    assert len(exports) == 1, exports
    return exports[0]


def follow(proc, until: str, timeout: float = 300) -> str:
    seen = ""
    deadline = time.monotonic() + timeout
    while until not in seen:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, seen + proc.stderr.read()
        seen += line
        assert time.monotonic() < deadline, seen
    return seen


def finish(proc, seen: str) -> dict:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    console = parse_console(seen + out)
    assert console["ready"] and console["done"], seen + out
    assert console["disks"]["vda"]["size"] == PADDED
    assert console["disks"]["vda"]["head"].startswith("33c0")  # the guest's own MBR, read through NBD
    assert console["stamps"]["vda"] == (0, 1)  # written to the VM's overlay, not to the shared export
    return console


def test_boots_before_the_blob_has_arrived_and_a_corrupt_chunk_is_fetched_again(qemu_user, lazy_registry, padded_image, fault_proxy):
    """The node's server runs as the cache's owner, KubeVirt's 107, as its launchers do (a root server
    refuses a cache another user owns: test_a_root_server_refuses_a_cache_another_user_owns)."""
    ref, _ = padded_image
    proxy = fault_proxy(lazy_registry)
    # One bit flipped in the first range response that carries disk data: the first chunk's gzip member (TOC v3).
    proxy.add(Fault("GET", r"/blobs/sha256:", "flip", times=1, byte=first_chunk_at(lazy_registry, ref) + 300))
    cache = qemu_user.cache
    assert qemu_user.launcher("ls").code == 0
    with disk_server(cache, "--prefetch-rate", "4M", user=QEMU_UID, env=qemu_user.env):
        vmi = qemu_user.write_vmi("lazy-early", ref.replace(lazy_registry.host, proxy.host))
        proc = qemu_user.popen("run", NOREG, "--lazy", "--console", "--timeout", "300", vmi)
        seen = follow(proc, READY)
        export = only_export(cache)
        assert export["present"] < export["chunks"] // 2, export  # booted with most of the blob still away
        assert (cache / "lazy" / export["export"] / "bitmap").is_file()
        finish(proc, seen)
        export = only_export(cache)
        assert export["stats"]["corrupt_chunks"] == 1 and not proxy.pending, export
        assert not export["verified"]  # still prefetching: the VM never waited for the whole blob
    assert_clean(qemu_user, "default_lazy-early")


def test_a_root_server_refuses_a_cache_another_user_owns(qemu_user):
    """The attack: the cache's owner swaps serve/ or lazy/ for a link while a root server works there,
    and root chmods, binds or writes where the link points. Refused before anything is made."""
    cache = qemu_user.cache
    assert qemu_user.launcher("ls").code == 0
    before = sorted(p.name for p in cache.iterdir())
    result = run_launcher("serve", "--cache-dir", cache, "--exit-when-idle", "1")
    assert result.code == 1
    assert result.err.strip() == (f"launcher: {cache}: belongs to uid {QEMU_UID}; root uses only a cache of root's that no other user"
                                  f" can write (use this one as its owner, or give root its own)"), result.err
    assert sorted(p.name for p in cache.iterdir()) == before


def test_registry_restart_during_the_boot(qemu_user, lazy_registry):
    ref, _ = push_padded(lazy_registry, qemu_user.root, "restart", 3)  # nothing of it fetched yet
    cache = qemu_user.cache
    with disk_server(cache, "--prefetch-rate", "4M", user=QEMU_UID, env=qemu_user.env):
        vmi = qemu_user.write_vmi("lazy-restart", ref)
        # Few, quick retries per request: the outage must outlast the registry client's own patience.
        proc = qemu_user.popen("run", NOREG, "--retry-times", "1", "--retry-delay", "0.2", "--lazy", "--console", "--timeout", "300", vmi)
        wait_for(lambda: control(cache, {"op": "status"})["exports"], 120, "the export to open")
        lazy_registry.stop()
        try:
            # Until a fetch failed for good (its retries spent): the outage outlasted the client's patience.
            wait_for(lambda: only_export(cache)["stats"]["failed_fetches"] >= 1 or proc.poll() is not None, 120, "a fetch to fail")
            assert proc.poll() is None
        finally:
            lazy_registry.start()
        finish(proc, follow(proc, DONE))
        export = only_export(cache)
        assert export["stats"]["failed_fetches"] >= 1, export  # the outage was felt, and survived
    assert_clean(qemu_user, "default_lazy-restart")


def test_run_starts_a_server_for_an_image_marked_lazy_and_pull_then_finds_the_disk(qemu_user, lazy_registry, padded_image):
    """Beside the root disk (TOC v3, content-defined chunks), a second containerDisk whose TOC is as
    diskkit wrote them before v3 (`--lazy-chunks fixed`: v2, 1 MiB chunks) boots lazily in the same VM,
    and `launcher pull` finds both disks once their exports are verified and installed."""
    ref, disk = padded_image
    old_disk = qemu_user.root / "old-toc.img"
    old_disk.write_bytes(b"OLD-TOC-V2 DISK." + random.Random(8).randbytes(OLD_DISK - 16))
    old_ref = f"{lazy_registry.host}/lazy/old-toc:v2"
    built = run_diskkit("build", NOREG, "--lazy-chunks", "fixed", old_disk, "-t", old_ref)
    assert built.code == 0, built.err
    assert (image_toc(lazy_registry, ref)["version"], image_toc(lazy_registry, old_ref)["version"]) == (3, 2)
    cache = qemu_user.cache
    vmi = qemu_user.write_vmi("lazy-auto", ref, extra=[({"name": "old", "disk": {"bus": "virtio"}}, {"name": "old", "containerDisk": {"image": old_ref}})])
    try:
        result = qemu_user.launcher("run", NOREG, "--console", "--timeout", "300", vmi)  # no --lazy: the images say so
        assert result.code == 0, result.err
        console = parse_console(result.out)
        assert console["done"] and console["disks"]["vda"]["size"] == PADDED
        assert console["disks"]["vdb"] == {"size": OLD_DISK, "ro": False, "serial": None, "head": b"OLD-TOC-V2 DISK.".hex()}, console["disks"]
        exports = wait_for(lambda: len(es := control(cache, {"op": "status"})["exports"]) == 2 and all(e["installed"] for e in es) and es,
                           180, "both disks to be verified and installed")
        installed = {e["layer"]: e["installed"] for e in exports if e["verified"]}
        for image, raw in ((ref, disk), (old_ref, old_disk)):
            pulled = json.loads(qemu_user.launcher("pull", NOREG, "--json", image).out)
            assert pulled["path"] == installed[pulled["layer"]]
            assert Path(pulled["path"]).read_bytes() == raw.read_bytes()
    finally:
        stop_spawned_server(cache)
    assert_clean(qemu_user, "default_lazy-auto")


def domstate(user, domain: str) -> str:
    try:
        return user.virsh("domstate", "--reason", domain)
    except subprocess.CalledProcessError:
        return ""  # not defined yet


def test_registry_away_longer_than_the_fetch_timeout_pauses_the_vm_until_it_is_back(qemu_user, lazy_registry):
    """Reads fail after the server's fetch timeout: qemu pauses the VM (errorPolicy stop), the launcher
    resumes it, qemu retries the read, and once the registry is back the boot goes on."""
    ref, _ = push_padded(lazy_registry, qemu_user.root, "pause", 4)
    cache = qemu_user.cache
    with disk_server(cache, "--prefetch-rate", "1M", "--fetch-timeout", "2", user=QEMU_UID, env=qemu_user.env):
        vmi = qemu_user.write_vmi("lazy-pause", ref)
        proc = qemu_user.popen("run", NOREG, "--retry-times", "1", "--retry-delay", "0.2", "--lazy", "--console", "--timeout", "400", vmi)
        wait_for(lambda: header_read(cache), 120, "the export to open")
        lazy_registry.stop()
        try:
            wait_for(lambda: "I/O error" in domstate(qemu_user, "default_lazy-pause"), 120, "the VM to pause")
            assert proc.poll() is None
        finally:
            lazy_registry.start()
        seen = follow(proc, DONE)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        assert "note: the VM paused on an I/O error of vda" in err and "note: resuming the VM" in err, err
        console = parse_console(seen + out)
        assert console["done"] and console["disks"]["vda"]["size"] == PADDED
    assert_clean(qemu_user, "default_lazy-pause")


def test_registry_gone_for_good_ends_the_run_with_the_reason(qemu_user, lazy_registry):
    # Padding of its own (its seed: no other image's chunks stand in for it), out of reach once the registry
    # is gone; 32 MiB of it are as far out of reach as 192, and quicker to build.
    ref, _ = push_padded(lazy_registry, qemu_user.root, "gone", 8, 96 << 20)
    cache = qemu_user.cache
    with disk_server(cache, "--prefetch-rate", "1M", "--fetch-timeout", "1", user=QEMU_UID, env=qemu_user.env):
        vmi = qemu_user.write_vmi("lazy-gone", ref)
        # The six resumes over 4.5 s instead of 45: what is given up on, and with which reason, is the same.
        proc = qemu_user.popen("run", NOREG, "--retry-times", "1", "--retry-delay", "0.2", "--lazy", "--console", "--timeout", "600",
                               "--io-error-patience", "4.5", vmi)
        wait_for(lambda: header_read(cache), 120, "the export to open")
        lazy_registry.stop()
        try:
            out, err = proc.communicate(timeout=400)  # bounded: six resumes, each a 1 s fetch timeout
        finally:
            lazy_registry.start()
    assert proc.returncode != 0
    last = err.strip().splitlines()[-1]
    assert last.startswith("launcher: default_lazy-gone: the VM kept pausing on I/O errors of vda (") and "after 6 resumes; the domain was destroyed" in last, err
    assert lazy_registry.host in last  # the disk server's reason names the registry it cannot reach
    assert "Traceback" not in err
    assert_clean(qemu_user, "default_lazy-gone")


@pytest.mark.parametrize("value, said", [("nan", "nan is not a number of seconds"), ("inf", "inf is not in the range 0<=x<=86400"),
                                         ("-1", "-1.0 is not in the range 0<=x<=86400")])
def test_the_io_error_patience_is_a_number_of_seconds(tmp_path, value, said):
    # nan compares false to any bound: a VM it let through would never be resumed, nor given up on.
    result = run_launcher("run", "--io-error-patience", value, tmp_path / "vmi.yaml")
    assert result.code == 2 and f"Invalid value for '--io-error-patience': {said}" in result.err, result.err


def test_two_vms_on_one_export_fetch_each_chunk_once(qemu_user, lazy_registry, fault_proxy):
    ref, _ = push_padded(lazy_registry, qemu_user.root, "twice", 6)
    proxy = fault_proxy(lazy_registry)
    # A slow registry (a second per range request): both guests wait on the same chunks at once.
    proxy.add(Fault("GET", r"/blobs/sha256:", "stall", times=100000, arg=1, header=("Range", r"^bytes=")))
    ref = ref.replace(lazy_registry.host, proxy.host)
    cache = qemu_user.cache
    with disk_server(cache, "--prefetch-rate", "2M", user=QEMU_UID, env=qemu_user.env):
        procs = [qemu_user.popen("run", NOREG, "--lazy", "--console", "--timeout", "400", qemu_user.write_vmi(name, ref))
                 for name in ("lazy-one", "lazy-two")]
        for proc in procs:
            finish(proc, follow(proc, DONE, timeout=400))
        export = only_export(cache)  # both VMs read the one export
        stats = export["stats"]
        # Every chunk came once, from the registry or the node's own chunks (the test guest's other
        # padded images in this cache share some), whichever VM (or prefetcher) asked first.
        assert stats["fetched_chunks"] + stats["reused_chunks"] == export["present"] and stats["corrupt_chunks"] == 0, export
        assert stats["fetched_bytes"] <= export["present"] * export["chunkSize"], export
    for name in ("lazy-one", "lazy-two"):
        assert_clean(qemu_user, f"default_{name}")


def test_a_short_name_boots_lazily_through_the_runs_registries_conf(qemu_user, lazy_registry):
    """The node's server (a process of its own, with its own files) knows no alias; the run's registries.conf maps the
    short name to the loopback registry, as for `launcher pull`, and the VM boots from the export."""
    ref, _ = push_padded(lazy_registry, qemu_user.root, "short", 5)
    layer = json.loads(run_diskkit("inspect", NOREG, "--json", ref).out)["layers"][0]["digest"]
    confs = qemu_user.root / "confs"
    confs.mkdir(mode=0o755)
    (confs / "client.conf").write_text(f'[aliases]\n"shortguest" = "{lazy_registry.host}/lazy/guest"\n')
    (confs / "server.conf").write_text("")
    cache = qemu_user.cache
    assert qemu_user.launcher("ls").code == 0
    with disk_server(cache, "--prefetch-rate", "8M", user=QEMU_UID,
                     env={**qemu_user.env, "CONTAINERS_REGISTRIES_CONF": str(confs / "server.conf"), "HOME": str(confs)}):
        vmi = qemu_user.write_vmi("lazy-short", "shortguest:short")
        result = run_launcher("run", NOREG, "--lazy", "--console", "--timeout", "300", vmi, user=str(QEMU_UID),
                              env={**qemu_user.env, "CONTAINERS_REGISTRIES_CONF": str(confs / "client.conf")})
        assert result.code == 0, result.err
        console = parse_console(result.out)
        assert console["done"] and console["disks"]["vda"]["size"] == PADDED, result.out
        assert layer in [e["layer"] for e in control(cache, {"op": "status"})["exports"] if "layer" in e]
    assert_clean(qemu_user, "default_lazy-short")

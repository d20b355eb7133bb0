"""`launcher domain`, the dry run, for lazy containerDisks: the overlay's backing store is the NBD
export and socket `launcher run` would really use, and nothing is made in the run directory."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

from tests.conftest import run_diskkit, run_launcher
from tests.lazyhost import disk_server, random_disk, stop_spawned_server

NOREG = "--tls-verify=false"
MIB = 1 << 20


def write_vmi(path, image: str):
    vmi = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "metadata": {"name": "dry"},
           "spec": {"domain": {"resources": {"requests": {"memory": "128Mi"}}, "devices": {"disks": [{"name": "root", "disk": {"bus": "virtio"}}]}},
                    "volumes": [{"name": "root", "containerDisk": {"image": image}}]}}
    path.write_text(json.dumps(vmi))
    return path


def backing(xml: str) -> ET.Element:
    (store,) = ET.fromstring(xml).findall("./devices/disk/backingStore")
    return store


def test_domain_shows_the_nbd_export_run_would_boot_from(tmp_path, registry):
    disk = random_disk(tmp_path / "plain.img", 4 * MIB)
    plain = f"{registry.host}/dryrun/plain:v1"  # seekable, not marked: lazy only when asked
    marked = f"{registry.host}/dryrun/marked:v1"
    assert run_diskkit("build", NOREG, "--compression", "none", disk, "-t", plain).code == 0
    assert run_diskkit("build", NOREG, "--lazy", disk, "-t", marked).code == 0
    cache = tmp_path / "cache"
    try:
        for image, flags in ((plain, ["--lazy"]), (marked, [])):
            out = run_launcher("domain", "--accel", "qemu", "--cache-dir", cache, NOREG, *flags, write_vmi(tmp_path / "vmi.json", image))
            assert out.code == 0, out.err
            store = backing(out.out)
            assert store.get("type") == "network", out.out
            source = store.find("source")
            host = source.find("host")
            assert source.get("protocol") == "nbd" and host.get("transport") == "unix"
            assert host.get("socket") == str(cache / "serve" / "nbd.sock")
            status = run_launcher("serve", "--status", "--json", "--cache-dir", cache)
            assert source.get("name") in [e["export"] for e in json.loads(status.out)["exports"]]
            assert not (cache / "run" / "default_dry").exists()  # planned, not made
        # --no-lazy: the pulled file, as before.
        out = run_launcher("domain", "--accel", "qemu", "--cache-dir", cache, NOREG, "--no-lazy", tmp_path / "vmi.json")
        assert out.code == 0, out.err
        assert backing(out.out).get("type") == "file"
    finally:
        stop_spawned_server(cache)


def test_a_short_name_is_resolved_by_the_run_through_its_registries_conf(tmp_path, registry, tls_registry):
    """The node's server knows no alias (its own registries.conf is empty); the run's alias names the
    loopback registry, as for `launcher pull`: the export is the image the alias means."""
    disk = random_disk(tmp_path / "short.img", 4 * MIB)
    full = f"{registry.host}/dryrun/short:v1"
    assert run_diskkit("build", NOREG, "--lazy", disk, "-t", full).code == 0
    (tmp_path / "home").mkdir()
    client_conf, server_conf = tmp_path / "client.conf", tmp_path / "server.conf"
    client_conf.write_text(f'[aliases]\n"shortguest" = "{registry.host}/dryrun/short"\n')
    server_conf.write_text("")
    home = {"HOME": str(tmp_path / "home")}
    cache = tmp_path / "cache"
    cache.mkdir()
    with disk_server(cache, env={**home, "CONTAINERS_REGISTRIES_CONF": str(server_conf)}):
        env = {**home, "CONTAINERS_REGISTRIES_CONF": str(client_conf)}
        pulled = run_launcher("pull", "--json", "--cache-dir", tmp_path / "pulled", NOREG, "shortguest:v1", env=env)
        assert pulled.code == 0, pulled.err
        out = run_launcher("domain", "--accel", "qemu", "--cache-dir", cache, NOREG, write_vmi(tmp_path / "vmi.json", "shortguest:v1"), env=env)
        assert out.code == 0, out.err
        store = backing(out.out)
        assert store.get("type") == "network" and store.find("source").get("protocol") == "nbd", out.out
        (export,) = json.loads(run_launcher("serve", "--status", "--json", "--cache-dir", cache).out)["exports"]
        assert export["export"] == store.find("source").get("name")
        assert export["layer"] == json.loads(pulled.out)["layer"], export
        # Search registries: the first that has the image wins (here the second; the first answers 404).
        client_conf.write_text(f'unqualified-search-registries = ["{tls_registry.host}", "{registry.host}"]\n')
        out = run_launcher("domain", "--accel", "qemu", "--cache-dir", cache, NOREG, write_vmi(tmp_path / "vmi.json", "dryrun/short:v1"), env=env)
        assert out.code == 0, out.err
        assert backing(out.out).find("source").get("name") == export["export"], out.out

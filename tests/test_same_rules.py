"""`launcher pull` refuses what `diskkit verify` rejects, with the same words (KubeVirt never chowns a
containerDisk's file: a disk UID 107 cannot read fails in virt-launcher with Permission denied)."""

from __future__ import annotations

import subprocess

from tests.conftest import make_qcow2, run_diskkit, run_launcher


def test_root_owned_0600_disk_is_refused_by_both(tmp_path):
    layout, staging = tmp_path / "layout", tmp_path / "staging" / "disk"
    staging.mkdir(parents=True)
    make_qcow2(staging / "vm.qcow2", "16M").chmod(0o600)
    for args in (["init", "--layout", layout], ["new", "--image", f"{layout}:t"], ["insert", "--image", f"{layout}:t", staging, "/disk"]):
        subprocess.run(["umoci", *map(str, args)], check=True, capture_output=True)
    rule = "/disk/vm.qcow2 is not readable by UID 107 (owner 0:0, mode 0600)"
    verified = run_diskkit("verify", f"oci:{layout}:t")
    assert verified.code == 8 and rule in verified.err
    pulled = run_launcher("pull", "--cache-dir", tmp_path / "cache", f"oci:{layout}:t")
    assert pulled.code == 1 and rule in pulled.err, pulled.out + pulled.err
    assert not list((tmp_path / "cache").glob("disks/*/*"))

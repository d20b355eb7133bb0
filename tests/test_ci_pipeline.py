"""examples/ci/pipeline.sh, the medius-style pipeline, run as shipped (as the qemu user, UID 107) against
the real registry and an upstream served on loopback (tests/upstream.py): it publishes the test guest,
skips an unchanged upstream, refuses a corrupt download and a panicking disk (nothing promoted), and
prunes old dated tags without touching the live ones. Three boots in all."""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_diskkit
from tests.testguest import ensure_testguest
from tests.upstream import Upstream
from tests.vmhost import NOREG, QEMU_UID

PIPELINE = Path(__file__).resolve().parent.parent / "examples" / "ci" / "pipeline.sh"
T1, T2, T3 = 1767225600, 1767229200, 1767232800  # 2026-01-01 00:00, 01:00, 02:00 UTC


def stamp(t: int) -> str:
    return subprocess.run(["date", "-u", "-d", f"@{t}", "+%y%m%d%H%M"], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def site(qemu_user):
    root = qemu_user.root / "site"
    root.mkdir()
    with Upstream(root) as upstream:
        yield upstream, root


def publish(root: Path, version: str, disk: Path, sums_of: Path | None = None, bsd: bool = False) -> None:
    """Release `version` as upstreams do: the disk, a GNU (or BSD) checksum file (of `sums_of`: a
    corrupt mirror serves other bytes than the release's checksum names), and the version file last."""
    name = f"guest-{version}.qcow2"
    shutil.copyfile(disk, root / name)
    digest = hashlib.sha256((sums_of or disk).read_bytes()).hexdigest()
    entry = f"SHA256 ({name}) = {digest}" if bsd else f"{digest} *{name}"
    (root / "SHA256SUMS").write_text(f"{'0' * 64}  other.qcow2\n{entry}\n")
    (root / "VERSION").write_text(f"{version}\n")


def panicking_disk(work: Path) -> Path:
    """The test guest with its initramfs replaced by junk: the kernel boots and panics (no root fs)."""
    for tool in ("mcopy", "sfdisk", "qemu-img"):
        assert shutil.which(tool), f"{tool} is needed by this test"
    raw = work / "panic.raw"
    subprocess.run(["qemu-img", "convert", "-f", "qcow2", "-O", "raw", ensure_testguest() / "testguest-poweroff.qcow2", raw], check=True)
    table = json.loads(subprocess.run(["sfdisk", "-J", raw], capture_output=True, text=True, check=True).stdout)
    offset = table["partitiontable"]["partitions"][0]["start"] * 512
    junk = work / "initrd.img"
    junk.write_bytes(b"not an initramfs\n" * 4096)
    subprocess.run(["mcopy", "-o", "-i", f"{raw}@@{offset}", junk, "::/initrd.img"], check=True)
    out = work / "panic.qcow2"
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, out], check=True)
    return out


def run_pipeline(qemu_user, upstream: Upstream, registry, build_time: int, keep: int = 3):
    env = {**os.environ, **qemu_user.env, "CI": "true",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "REGISTRY": registry.host, "NAME": "ci/guest", "UPSTREAM": upstream.url(""), "ARTIFACT": "guest-{VERSION}.qcow2",
           "TLS_VERIFY": "false", "BUILD_TIME": str(build_time), "KEEP": str(keep), "TEST_TIMEOUT": "300",
           "TEST_ARGS": "--memory 128Mi", "WORKDIR": str(qemu_user.root / "out"), "TMPDIR": str(qemu_user.root / "tmp")}
    cmd = ["setpriv", f"--reuid={QEMU_UID}", f"--regid={QEMU_UID}", "--clear-groups", "bash", str(PIPELINE)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=qemu_user.root, timeout=900)


def tags(registry, repo: str) -> dict[str, str]:
    """tag -> digest"""
    listed = run_diskkit("tags", NOREG, "--json", f"{registry.host}/{repo}")
    if listed.code == 5:
        return {}
    assert listed.code == 0, listed.err
    out = {}
    for tag in json.loads(listed.out)["Tags"]:
        found = subprocess.run(["skopeo", "inspect", "--tls-verify=false", "--raw", f"docker://{registry.host}/{repo}:{tag}"],
                               capture_output=True, check=True)
        out[tag] = "sha256:" + hashlib.sha256(found.stdout).hexdigest()
    return out


def test_pipeline_publishes_skips_refuses_and_prunes(qemu_user, registry, site):
    upstream, root = site
    work = qemu_user.root / "work"
    work.mkdir()
    for d in ("out", "tmp"):
        (qemu_user.root / d).mkdir()
        os.chown(qemu_user.root / d, QEMU_UID, pwd.getpwuid(QEMU_UID).pw_gid)
    guest = ensure_testguest() / "testguest-poweroff.qcow2"

    # 1. a release is published: dated tag, version and latest, all on the tested digest
    publish(root, "1", guest)
    first = run_pipeline(qemu_user, upstream, registry, T1)
    assert first.returncode == 0, first.stderr
    live = tags(registry, "ci/guest")
    assert set(live) == {f"1-{stamp(T1)}", "1", "latest"}, live
    assert len(set(live.values())) == 1 and first.stdout.strip() == f"{registry.host}/ci/guest:1@{live['1']}"
    tested = json.loads((qemu_user.root / "out" / "test.json").read_text())
    assert tested["result"] == "pass" and tested["failOn"] == {"Kernel panic": None, "Call Trace": None}, tested

    # 2. an unchanged upstream is skipped: exit 0, nothing new
    again = run_pipeline(qemu_user, upstream, registry, T2)
    assert again.returncode == 0, again.stderr
    assert "upstream unchanged" in again.stderr and again.stdout == "", again.stderr
    assert tags(registry, "ci/guest") == live

    # 3. a corrupt download (bytes other than the checksum file names) is refused before anything is pushed
    changed = work / "changed.qcow2"
    subprocess.run(["qemu-img", "convert", "-f", "qcow2", "-O", "qcow2", guest, changed], check=True)  # same guest, other bytes
    corrupt = work / "corrupt.qcow2"
    data = bytearray(changed.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt.write_bytes(data)
    publish(root, "2", corrupt, sums_of=changed)
    refused = run_pipeline(qemu_user, upstream, registry, T2)
    assert refused.returncode == 1, refused.stderr
    assert "Digest did not match" in refused.stderr and "nothing was built" in refused.stderr, refused.stderr
    assert tags(registry, "ci/guest") == live
    assert "2" not in tags(registry, "ci/guest-candidates")

    # 4. a disk that panics is not promoted (launcher test's --fail-on, exit 3); its candidate is deleted
    publish(root, "3", panicking_disk(work))
    panicked = run_pipeline(qemu_user, upstream, registry, T2)
    assert panicked.returncode == 3, panicked.stderr
    assert "boot test failed (exit 3" in panicked.stderr and "not promoted" in panicked.stderr, panicked.stderr
    tested = json.loads((qemu_user.root / "out" / "test.json").read_text())
    assert "Kernel panic" in tested["failOn"]["Kernel panic"] and tested["exitStatus"] is None, tested
    assert tags(registry, "ci/guest") == live
    assert "3" not in tags(registry, "ci/guest-candidates")

    # 5. version 1 rebuilt upstream, and a run stopped after its build (the candidate is in staging,
    # labelled, never promoted): the next run tests and promotes that candidate instead of skipping;
    # prune (keep 0) removes the old dated tag and never a live one
    publish(root, "1", changed, bsd=True)
    staged = run_diskkit("build", NOREG, changed, "-t", f"{registry.host}/ci/guest-candidates:1",
                         "--label", f"shasum=sha256:{hashlib.sha256(changed.read_bytes()).hexdigest()}", env={"SOURCE_DATE_EPOCH": str(T3)})
    assert staged.code == 0, staged.err
    rebuilt = run_pipeline(qemu_user, upstream, registry, T3, keep=0)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "was never promoted: testing it" in rebuilt.stderr, rebuilt.stderr
    assert rebuilt.stdout.strip() == f"{registry.host}/ci/guest:1@{staged.out.strip().splitlines()[-1]}"
    now = tags(registry, "ci/guest")
    assert set(now) == {f"1-{stamp(T3)}", "1", "latest"}, now
    assert now["1"] == now["latest"] == now[f"1-{stamp(T3)}"] != live["1"]

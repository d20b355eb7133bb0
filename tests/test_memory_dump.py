"""`launcher memory-dump get|download|remove` as `virtctl memory-dump get|download|remove`
(pkg/virtctl/memorydump/memorydump.go), with virt-api's refusals (pkg/virt-api/rest/memorydump.go),
virt-handler's file name (pkg/virt-handler/vm.go dumpTargetFile) and KubeVirt's claim size
(pkg/util/util.go CalcExpectedMemoryDumpSize). A download is what virtctl fetches from the claim's
VirtualMachineExport: the archive of the claim's directory, gzipped unless `--format raw`
(pkg/virtctl/vmexport/vmexport.go GetUrlFromVirtualMachineExport picks ArchiveGz;
pkg/storage/export/virt-exportserver/exportserver.go archiveHandler tars the directory).

A dump of a booted guest is tests/test_trust_vmview.py's (it joins that file's root-started VMs); here
what needs no guest: the rules, the move of a finished dump into a claim whose owner planted links, and
the download of a dump kept after its VM stopped, answered by libvirt's test driver (`test:///default`,
as tests/test_bookkeeping.py's are) and run in this process while a connection to it is held.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import stat
import tarfile
import tempfile
from datetime import datetime
from pathlib import Path

import pytest

from diskkit.cli.shell import run_command
from diskkit.errors import DiskkitError, Exit
from launcher.cli.commands import cli
from launcher.hostfs.dirfd import NOFOLLOW, Dir
from launcher.node.cache import Cache
from launcher.runtime import memorydump
from launcher.runtime.memorydump import move_into_claim, needed_bytes, target_file_name
from launcher.runtime.runner import Libvirt
from tests.conftest import Result
from tests.testdriver import TEST_URI, close_node

NOBODY = 65534


def test_the_file_is_named_as_virt_handler_names_it():
    assert target_file_name("myvm", "memoryvolume", datetime(2026, 11, 29, 1, 2, 3)) == "myvm-memoryvolume-20261129-010203.memory.dump"


def test_the_claim_must_hold_the_memory_and_100_mib_with_cdis_filesystem_overhead():
    # 64Mi of memory: (64Mi + 100Mi) / (1 - 0.055)
    assert needed_bytes(64 << 20) == int((164 << 20) / 0.945)


@pytest.fixture(params=["same filesystem", "another filesystem"])
def places(request, tmp_path):
    """A staging directory with a finished dump in it, and a claim directory: on one filesystem (the
    dump is renamed) or two (/dev/shm: copied)."""
    staging = tmp_path / "staging"
    staging.mkdir()
    if request.param == "same filesystem":
        claim = tmp_path / "claim"
        claim.mkdir()
        yield staging, claim
    else:
        with tempfile.TemporaryDirectory(dir="/dev/shm") as other:
            assert os.stat(other).st_dev != os.stat(tmp_path).st_dev
            yield staging, Path(other)


NAME = "a-dumps-20261129-010203.memory.dump"


def test_a_dump_is_moved_into_the_claim_as_its_owners_file(places):
    staging, claim = places
    (staging / NAME).write_bytes(b"\x7fELF" + b"x" * 100)
    os.chown(claim, 107, 107)
    with Dir.open(staging) as s, Dir.open(claim) as c:
        assert move_into_claim(s, c, NAME).st_size == 104
    st = os.lstat(claim / NAME)
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and (st.st_uid, st.st_gid) == (107, 107)
    assert (claim / NAME).read_bytes().startswith(b"\x7fELF")


def test_a_link_planted_at_the_dumps_name_is_replaced_not_followed(places, tmp_path):
    """The attacker owns the claim (or a guest it was shared with writes in it): a link under the name
    the dump gets, to a file of root's. Root moving the dump in must replace the link, never write
    through it."""
    staging, claim = places
    victim = tmp_path / "victim"
    victim.write_text("root's own\n")
    (staging / NAME).write_bytes(b"\x7fELF dump")
    (claim / NAME).symlink_to(victim)
    with Dir.open(staging) as s, Dir.open(claim) as c:
        move_into_claim(s, c, NAME)
    assert victim.read_text() == "root's own\n"
    assert stat.S_ISREG(os.lstat(claim / NAME).st_mode) and (claim / NAME).read_bytes() == b"\x7fELF dump"


def test_a_directory_planted_at_the_dumps_name_is_left_and_refused(places):
    staging, claim = places
    (staging / NAME).write_bytes(b"\x7fELF")
    (claim / NAME).mkdir()
    (claim / NAME / "keep").write_text("the owner's\n")
    with Dir.open(staging) as s, Dir.open(claim) as c, pytest.raises(DiskkitError, match="is a directory"):
        move_into_claim(s, c, NAME)
    assert (claim / NAME / "keep").read_text() == "the owner's\n"


def test_a_dump_libvirt_left_as_a_link_is_not_taken():
    with tempfile.TemporaryDirectory() as top:
        staging, claim = Path(top, "staging"), Path(top, "claim")
        staging.mkdir(), claim.mkdir()
        (staging / NAME).symlink_to("/etc/shadow")
        with Dir.open(staging) as s, Dir.open(claim) as c, pytest.raises(DiskkitError, match="symbolic link"):
            move_into_claim(s, c, NAME)
        assert not (claim / NAME).exists()


# --- download, and the association kept after the VM stops -------------------------------------------------

DUMP = "vm-dumps-20261129-010203.memory.dump"
CORE = b"\x7fELF\x02\x01\x01" + bytes(range(256)) * 64


@pytest.fixture
def dumped(tmp_path, capsys):
    """A running VM (the test driver's domain) whose memory `memory-dump get` put in a claim of uid
    65534's, its association kept as `get` keeps it; `launcher(*args)` runs in this process."""
    lv = Libvirt(TEST_URI)
    cache = Cache(tmp_path / "cache")
    domain = lv.conn.defineXML("<domain type='test'><name>default_vm</name><memory unit='KiB'>65536</memory>"
                               "<os><type>hvm</type></os></domain>")
    domain.create()
    run_dir = cache.run_dir("default_vm")
    run_dir.mkdir()
    record = {"domain": "default_vm", "vmi": "vm", "namespace": "default", "uri": TEST_URI, "run_dir": str(run_dir), "gracePeriod": 30}
    cache.write_json(cache.vm_record_path("default_vm"), record)
    claim = tmp_path / "claim"
    claim.mkdir()
    (claim / DUMP).write_bytes(CORE)
    os.chown(claim / DUMP, NOBODY, NOBODY)
    os.chmod(claim / DUMP, 0o600)
    os.chown(claim, NOBODY, NOBODY)
    memorydump.associate(cache, record, claim, os.stat(claim / DUMP), claimName="dumps", phase="Completed", fileName=DUMP,
                         startTimestamp="2026-11-29T01:02:03Z", endTimestamp="2026-11-29T01:02:04Z")
    capsys.readouterr()

    def launcher(*args) -> Result:
        try:
            run_command(cli, "launcher", [*map(str, args), "--cache-dir", str(cache.root)])
            code = 0
        except SystemExit as exc:
            code = int(exc.code or 0)
        out, err = capsys.readouterr()
        return Result(code, out, err)

    yield launcher, cache, claim
    close_node(lv)


def _members(path: Path, compressed: bool) -> dict[str, bytes]:
    data = path.read_bytes()
    assert data[:2] == b"\x1f\x8b" if compressed else data[:2] != b"\x1f\x8b"
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(data) if compressed else data)) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


@pytest.mark.parametrize("fmt", [None, "gzip", "raw"])
def test_download_is_virtctls_archive_of_the_dump_gzipped_unless_raw(dumped, tmp_path, fmt):
    launcher, _, _ = dumped
    out = tmp_path / "memoryDump.dump.gz"
    result = launcher("memory-dump", "download", "vm", "--output", out, *(["--format", fmt] if fmt else []), "--json")
    assert result.code == 0, result.err
    assert "Memory dump completed successfully" in result.err and "Download finished successfully" in result.err, result.err
    assert _members(out, fmt != "raw") == {f"./{DUMP}": CORE}
    answer = json.loads(result.out)
    assert (answer["claimName"], answer["fileName"], answer["output"], answer["size"]) == ("dumps", DUMP, str(out), out.stat().st_size)
    assert stat.S_IMODE(out.stat().st_mode) == 0o600  # a guest's memory
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_the_association_and_the_download_outlive_the_vm(dumped, tmp_path):
    """KubeVirt keeps status.memoryDumpRequest on the VirtualMachine: after `launcher stop` (its record
    and run directory gone) status still shows it, the dump still downloads, and `remove` still ends it."""
    launcher, cache, _ = dumped
    before = json.loads(launcher("status", "--json", "vm").out)["memoryDumpRequest"]
    assert (before["claimName"], before["phase"], before["fileName"]) == ("dumps", "Completed", DUMP), before
    assert launcher("stop", "vm").code == 0
    assert not cache.vm_record_path("default_vm").exists() and not cache.run_dir("default_vm").exists()
    status = launcher("status", "--json", "vm")
    assert status.code == 1 and json.loads(status.out)["state"] == "stopped" and json.loads(status.out)["memoryDumpRequest"] == before, status
    assert launcher("status", "vm").out.strip() == "stopped"
    out = tmp_path / "after-stop.tar.gz"
    assert launcher("memory-dump", "download", "default/vm", "--output", out).code == 0
    assert _members(out, True) == {f"./{DUMP}": CORE}
    removed = launcher("memory-dump", "remove", "vm")
    assert (removed.code, removed.out.strip()) == (0, "Successfully submitted remove memory dump association of VM vm"), removed
    gone = launcher("status", "vm")
    assert (gone.code, gone.err.strip()) == (Exit.NOT_FOUND, "launcher: vm: no VM of this name was started from this cache (yet)")


def test_download_refusals_write_nothing(dumped, tmp_path):
    launcher, cache, claim = dumped
    out = tmp_path / "out.gz"
    missing = launcher("memory-dump", "download", "vm")
    assert missing.code == 1 and missing.err.strip() == "launcher: --output: missing outputFile to download the memory dump", missing
    record = cache.read_json(cache.vm_record_path("default_vm"))
    memorydump.associate(cache, record, claim, None, claimName="dumps", phase="Failed", fileName=DUMP, message="Domain memory dump failed: disk full")
    failed = launcher("memory-dump", "download", "vm", "--output", out)
    assert failed.err.strip() == ("launcher: vm: the memory dump into claim dumps is Failed: Domain memory dump failed: disk full;"
                                  " there is nothing to download"), failed
    assert launcher("memory-dump", "remove", "vm").code == 0
    none = launcher("memory-dump", "download", "vm", "--output", out)
    assert none.err.strip() == "launcher: vm: no memory dump is associated with this VM: `launcher memory-dump get` takes one", none
    assert launcher("memory-dump", "download", "other", "--output", out).code == Exit.NOT_FOUND
    assert not out.exists() and [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_a_dump_the_claims_owner_replaced_is_not_downloaded(dumped, tmp_path):
    """The claim is its owner's (or a guest's it is shared with): the dump's name may have become a
    link to a file of root's, a hard link to one, or another file; root reads none of them into the output."""
    launcher, _, claim = dumped
    secret = tmp_path / "root-only"
    secret.write_bytes(b"root's secret\n")
    secret.chmod(0o600)
    out = tmp_path / "out.gz"
    for plant, why in [(lambda p: p.symlink_to(secret), NOFOLLOW), (lambda p: os.link(secret, p), "has other hard links"),
                       (lambda p: p.write_bytes(CORE), "is no longer the dump")]:
        (claim / DUMP).unlink()
        plant(claim / DUMP)
        refused = launcher("memory-dump", "download", "vm", "--output", out)
        assert refused.code == 1 and why in refused.err, refused
        assert not out.exists()


def test_a_link_planted_at_the_output_is_replaced_not_followed(dumped, tmp_path):
    """Root downloads into a directory of uid 65534's, who planted a link under the output's name to a
    file of root's: root's file is untouched, the download is a file of its own, 65534's, 0600."""
    launcher, _, _ = dumped
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY, NOBODY)
    victim = tmp_path / "victim"
    victim.write_text("root's own\n")
    (theirs / "dump.gz").symlink_to(victim)
    os.lchown(theirs / "dump.gz", NOBODY, NOBODY)
    assert launcher("memory-dump", "download", "vm", "--output", theirs / "dump.gz").code == 0
    assert victim.read_text() == "root's own\n"
    st = os.lstat(theirs / "dump.gz")
    assert stat.S_ISREG(st.st_mode) and (st.st_uid, stat.S_IMODE(st.st_mode)) == (NOBODY, 0o600)
    assert _members(theirs / "dump.gz", True) == {f"./{DUMP}": CORE}


def test_a_link_on_the_way_to_the_output_is_followed_only_where_root_alone_could_put_it(dumped, tmp_path):
    """A sticky directory anyone can write (as /tmp): uid 65534 plants `out` there, a link to a directory
    of root's, hoping root's download lands in it. Refused naming the link, nothing written; the same
    link made by root is followed."""
    launcher, _, _ = dumped
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    roots = tmp_path / "roots"
    roots.mkdir(mode=0o700)
    (shared / "out").symlink_to(roots)
    os.lchown(shared / "out", NOBODY, NOBODY)
    refused = launcher("memory-dump", "download", "vm", "--output", shared / "out" / "dump.gz")
    assert refused.code == 1 and refused.err.strip().splitlines()[-1] == f"launcher: {shared / 'out'}: out {NOFOLLOW}", refused
    assert list(roots.iterdir()) == []
    os.lchown(shared / "out", 0, 0)
    assert launcher("memory-dump", "download", "vm", "--output", shared / "out" / "dump.gz").code == 0
    assert _members(roots / "dump.gz", True) == {f"./{DUMP}": CORE}

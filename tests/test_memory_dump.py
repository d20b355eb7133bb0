"""`launcher memory-dump get|remove` as `virtctl memory-dump get|remove` (pkg/virtctl/memorydump/memorydump.go),
with virt-api's refusals (pkg/virt-api/rest/memorydump.go), virt-handler's file name (pkg/virt-handler/vm.go
dumpTargetFile) and KubeVirt's claim size (pkg/util/util.go CalcExpectedMemoryDumpSize).

A dump of a booted guest is tests/test_trust_vmview.py's (it joins that file's root-started VMs); here
what needs no guest: the rules, and the move of a finished dump into a claim whose owner planted links.
"""

from __future__ import annotations

import os
import stat
import tempfile
from datetime import datetime
from pathlib import Path

import pytest

from diskkit.errors import DiskkitError
from launcher.hostfs.dirfd import Dir
from launcher.runtime.memorydump import move_into_claim, needed_bytes, target_file_name


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
        assert move_into_claim(s, c, NAME) == 104
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

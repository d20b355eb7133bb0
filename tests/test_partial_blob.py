"""The partial copy of a blob download (diskkit.registry.partial), written by a thread of its own:
what was appended is on disk and is the resume point once synced or kept, nothing of a dropped
one stays, and a disk that refuses the writes ends the copy, never the download."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from diskkit.registry.partial import PartialBlob

ROOT = Path(__file__).resolve().parent.parent

MIB = 1 << 20
DIGEST = "sha256:" + "ab" * 32
SOURCE = f"registry.example/repo@{DIGEST} {64 * MIB}"


def pieces(count: int) -> list[bytes]:
    return [os.urandom(MIB) for _ in range(count)]


def kept_at_once(directory: Path, source: str = SOURCE) -> PartialBlob:
    """A copy that keeps every byte from the first (as a download does once it failed or ran long)."""
    return PartialBlob(directory, DIGEST, source, keep_after=0)


@contextlib.contextmanager
def next_download(directory: Path):
    """The next download of the same blob from the same source, as it finds what was kept; dropped after."""
    again = PartialBlob(directory, DIGEST, SOURCE)
    try:
        yield again
    finally:
        again.drop()


def append_all(blob: PartialBlob, data: list[bytes], at: int | None = None) -> None:
    """`data` as it arrives, from blob offset `at` (default: where the kept bytes end)."""
    at = blob.length if at is None else at
    for piece in data:
        blob.append(at, piece)
        at += len(piece)


def test_kept_bytes_are_all_written_and_are_the_next_ones_head_start(tmp_path):
    data = pieces(24)
    first = kept_at_once(tmp_path)
    assert first.length == 0
    append_all(first, data)
    first.keep()  # returns once the writer has written and synced everything queued

    again = kept_at_once(tmp_path)
    try:
        assert again.length == len(data) * MIB
        assert (tmp_path / f"{DIGEST.replace(':', '-')}.synced").read_text() == f"0 {again.length}"
        assert again.read(0, again.length) == b"".join(data)
    finally:
        again.drop()


def test_sync_moves_the_resume_point_to_everything_appended(tmp_path):
    blob = kept_at_once(tmp_path)
    mark = tmp_path / f"{DIGEST.replace(':', '-')}.synced"
    try:
        append_all(blob, pieces(5))
        blob.sync()
        assert mark.read_text() == f"0 {5 * MIB}"
        assert (tmp_path / f"{DIGEST.replace(':', '-')}.part").stat().st_size == 5 * MIB
    finally:
        blob.drop()


def unlinked() -> None:
    """A dropped copy's bytes are unlinked by a thread beside what follows: wait for it."""
    for thread in threading.enumerate():
        if thread.name == "partial-unlink":
            thread.join()


def test_a_dropped_copy_leaves_nothing(tmp_path):
    blob = kept_at_once(tmp_path)
    append_all(blob, pieces(8))
    blob.sync()
    blob.append(blob.length, os.urandom(MIB))
    blob.drop()
    # No resume point survives the drop itself: a download started now begins afresh.
    assert not (tmp_path / f"{DIGEST.replace(':', '-')}.synced").exists()
    assert not (tmp_path / f"{DIGEST.replace(':', '-')}.part").exists()
    unlinked()
    assert list(tmp_path.iterdir()) == []


def test_a_download_started_while_a_dropped_copy_is_unlinked_keeps_its_own(tmp_path):
    """The dropped bytes leave under a name of their own before they are unlinked, so the next
    download of the blob (a retry in the same process) is not the one they take with them."""
    old = kept_at_once(tmp_path)
    append_all(old, pieces(64))
    old.sync()
    old.drop()
    data = pieces(3)
    new = kept_at_once(tmp_path)
    assert new.length == 0
    append_all(new, data)
    new.keep()
    unlinked()
    again = kept_at_once(tmp_path)
    try:
        assert again.read(0, again.length) == b"".join(data)
    finally:
        again.drop()
        unlinked()


def test_a_disk_that_refuses_writes_ends_the_copy_not_the_download(tmp_path):
    # RLIMIT_FSIZE makes writes past 3 MiB fail with EFBIG (Python ignores SIGXFSZ), as a full disk would.
    script = textwrap.dedent(f"""
        import os, resource, sys
        from pathlib import Path
        from diskkit.registry.partial import PartialBlob
        resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 20, 3 << 20))
        blob = PartialBlob(Path(sys.argv[1]), {DIGEST!r}, {SOURCE!r}, keep_after=0)
        for _ in range(3):
            blob.append(blob.length, os.urandom(1 << 20))
        blob.sync()
        for _ in range(6):
            blob.append(blob.length, os.urandom(1 << 20))  # the writer fails on the first of these
        blob.sync()
        blob.keep()
        print(blob.length, blob.synced)
    """)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr
    appended, synced = map(int, done.stdout.split())
    assert appended == 9 * MIB and synced == 3 * MIB
    assert (tmp_path / f"{DIGEST.replace(':', '-')}.synced").read_text() == f"0 {3 * MIB}"


def test_kept_bytes_are_resumed_only_from_their_own_source(tmp_path):
    """Attack: a liar's kept bytes, under the digest of a genuine blob, offered to the genuine pull."""
    first = kept_at_once(tmp_path)
    append_all(first, pieces(3))
    first.keep()
    other = kept_at_once(tmp_path, SOURCE.replace("registry.example", "liar.example"))
    try:
        assert other.length == 0 and (tmp_path / f"{DIGEST.replace(':', '-')}.part").stat().st_size == 0
    finally:
        other.keep()
    again = kept_at_once(tmp_path)  # the liar's source is recorded now: nothing for this one
    try:
        assert again.length == 0
    finally:
        again.drop()
    unlinked()
    assert list(tmp_path.iterdir()) == []


def test_a_download_that_ends_within_keep_after_writes_nothing(tmp_path):
    """A fast download is cheaper to fetch again than to copy: nothing is written, nothing resumed."""
    blob = PartialBlob(tmp_path, DIGEST, SOURCE, keep_after=60)
    append_all(blob, pieces(8))
    blob.keep()
    part = tmp_path / f"{DIGEST.replace(':', '-')}.part"
    assert part.stat().st_blocks == 0 and not (tmp_path / f"{DIGEST.replace(':', '-')}.synced").exists()
    with next_download(tmp_path) as again:
        assert again.kept == 0 and again.length == 0


def test_keeping_begins_keep_after_into_the_download_and_is_resumed_from_there(tmp_path):
    data = pieces(8)
    blob = PartialBlob(tmp_path, DIGEST, SOURCE, keep_after=0.2)
    append_all(blob, data[:3])
    time.sleep(0.25)
    append_all(blob, data[3:])
    blob.keep()
    # The bytes before the first kept one take no space: a hole, fetched again by the next download.
    part = tmp_path / f"{DIGEST.replace(':', '-')}.part"
    assert part.stat().st_blocks * 512 <= 5 * MIB + 64 << 10
    with next_download(tmp_path) as again:
        assert (again.start, again.length, again.kept) == (3 * MIB, 8 * MIB, 5 * MIB)
        assert again.read(3 * MIB, 5 * MIB) == b"".join(data[3:])
        append_all(again, data[:3], at=0)  # the head, fetched again before the kept bytes: not kept twice
        assert again.length == 8 * MIB


def test_a_failure_before_keep_after_keeps_what_follows(tmp_path):
    """A download that failed once is worth keeping: from its next byte on, whatever the time."""
    data = pieces(6)
    blob = PartialBlob(tmp_path, DIGEST, SOURCE, keep_after=60)
    append_all(blob, data[:2])
    blob.sync()
    append_all(blob, data[2:])
    blob.keep()
    with next_download(tmp_path) as again:
        assert (again.start, again.kept) == (2 * MIB, 4 * MIB)
        assert again.read(2 * MIB, 4 * MIB) == b"".join(data[2:])


def test_an_older_launchers_resume_point_is_read_as_from_byte_0(tmp_path):
    data = pieces(2)
    blob = kept_at_once(tmp_path)
    append_all(blob, data)
    blob.keep()
    (tmp_path / f"{DIGEST.replace(':', '-')}.synced").write_text(str(2 * MIB))  # "END", as before START was kept
    with next_download(tmp_path) as again:
        assert (again.start, again.kept) == (0, 2 * MIB) and again.read(0, 2 * MIB) == b"".join(data)


@pytest.mark.parametrize("mark", ["9 3", "-1 4", "0 99999999999", "x y", "1 2 3"])
def test_a_resume_point_is_bounded_by_the_bytes_on_disk(tmp_path, mark):
    """A mark that names bytes the file does not hold, or a start past its end, resumes none of them."""
    data = pieces(4)
    blob = kept_at_once(tmp_path)
    append_all(blob, data)
    blob.keep()
    (tmp_path / f"{DIGEST.replace(':', '-')}.synced").write_text(mark)
    with next_download(tmp_path) as again:
        assert again.length <= 4 * MIB and again.start <= again.length
        assert again.read(again.start, again.kept) == b"".join(data)[again.start:again.length]

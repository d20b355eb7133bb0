"""The partial copy of a blob download (diskkit.registry.partial), written by a thread of its own:
what was appended is on disk and is the resume point once synced or kept, nothing of a dropped
one stays, and a disk that refuses the writes ends the copy, never the download."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from diskkit.registry.partial import PartialBlob

ROOT = Path(__file__).resolve().parent.parent

MIB = 1 << 20
DIGEST = "sha256:" + "ab" * 32
SOURCE = f"registry.example/repo@{DIGEST} {64 * MIB}"


def pieces(count: int) -> list[bytes]:
    return [os.urandom(MIB) for _ in range(count)]


def test_kept_bytes_are_all_written_and_are_the_next_ones_head_start(tmp_path):
    data = pieces(24)
    first = PartialBlob(tmp_path, DIGEST, SOURCE)
    assert first.length == 0
    for piece in data:
        first.append(piece)
    first.keep()  # returns once the writer has written and synced everything queued

    again = PartialBlob(tmp_path, DIGEST, SOURCE)
    try:
        assert again.length == len(data) * MIB
        assert int((tmp_path / f"{DIGEST.replace(':', '-')}.synced").read_text()) == again.length
        assert again.read(0, again.length) == b"".join(data)
    finally:
        again.drop()


def test_sync_moves_the_resume_point_to_everything_appended(tmp_path):
    blob = PartialBlob(tmp_path, DIGEST, SOURCE)
    mark = tmp_path / f"{DIGEST.replace(':', '-')}.synced"
    try:
        for piece in pieces(5):
            blob.append(piece)
        blob.sync()
        assert int(mark.read_text()) == 5 * MIB
        assert (tmp_path / f"{DIGEST.replace(':', '-')}.part").stat().st_size == 5 * MIB
    finally:
        blob.drop()


def unlinked() -> None:
    """A dropped copy's bytes are unlinked by a thread beside what follows: wait for it."""
    for thread in threading.enumerate():
        if thread.name == "partial-unlink":
            thread.join()


def test_a_dropped_copy_leaves_nothing(tmp_path):
    blob = PartialBlob(tmp_path, DIGEST, SOURCE)
    for piece in pieces(8):
        blob.append(piece)
    blob.sync()
    blob.append(os.urandom(MIB))
    blob.drop()
    # No resume point survives the drop itself: a download started now begins afresh.
    assert not (tmp_path / f"{DIGEST.replace(':', '-')}.synced").exists()
    assert not (tmp_path / f"{DIGEST.replace(':', '-')}.part").exists()
    unlinked()
    assert list(tmp_path.iterdir()) == []


def test_a_download_started_while_a_dropped_copy_is_unlinked_keeps_its_own(tmp_path):
    """The dropped bytes leave under a name of their own before they are unlinked, so the next
    download of the blob (a retry in the same process) is not the one they take with them."""
    old = PartialBlob(tmp_path, DIGEST, SOURCE)
    for piece in pieces(64):
        old.append(piece)
    old.sync()
    old.drop()
    data = pieces(3)
    new = PartialBlob(tmp_path, DIGEST, SOURCE)
    assert new.length == 0
    for piece in data:
        new.append(piece)
    new.keep()
    unlinked()
    again = PartialBlob(tmp_path, DIGEST, SOURCE)
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
        blob = PartialBlob(Path(sys.argv[1]), {DIGEST!r}, {SOURCE!r})
        for _ in range(3):
            blob.append(os.urandom(1 << 20))
        blob.sync()
        for _ in range(6):
            blob.append(os.urandom(1 << 20))  # the writer fails on the first of these
        blob.sync()
        blob.keep()
        print(blob.length, blob.synced)
    """)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert done.returncode == 0, done.stderr
    appended, synced = map(int, done.stdout.split())
    assert appended == 9 * MIB and synced == 3 * MIB
    assert int((tmp_path / f"{DIGEST.replace(':', '-')}.synced").read_text()) == 3 * MIB


def test_kept_bytes_are_resumed_only_from_their_own_source(tmp_path):
    """Attack: a liar's kept bytes, under the digest of a genuine blob, offered to the genuine pull."""
    first = PartialBlob(tmp_path, DIGEST, SOURCE)
    for piece in pieces(3):
        first.append(piece)
    first.keep()
    other = PartialBlob(tmp_path, DIGEST, SOURCE.replace("registry.example", "liar.example"))
    try:
        assert other.length == 0 and (tmp_path / f"{DIGEST.replace(':', '-')}.part").stat().st_size == 0
    finally:
        other.keep()
    again = PartialBlob(tmp_path, DIGEST, SOURCE)  # the liar's source is recorded now: nothing for this one
    try:
        assert again.length == 0
    finally:
        again.drop()
    unlinked()
    assert list(tmp_path.iterdir()) == []

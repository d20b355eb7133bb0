"""contentType: archive — a tar whose files fill the claim's filesystem instead of a disk image, as CDI's
importer does for http and upload sources (pkg/importer/format-readers.go: "cannot process a non tar file
as an archive").

Only regular files and directories are unpacked, every name stays inside the claim, and nothing appears
in the claim until the whole archive has been unpacked beside it and synced: a bad or cut archive leaves
the claim as it was.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tarfile
from pathlib import Path

from diskkit.errors import DiskkitError
from launcher.hostfs.dirfd import Dir, give

CHUNK = 1 << 20
TREE = "tree"  # the unpacked files, in the work directory, until all are there


def _clean(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return posixpath.normpath(name) if name else "."


def _member_problem(member: tarfile.TarInfo) -> str | None:
    name = member.name
    clean = _clean(name)
    if name.startswith("/") or clean == ".." or clean.startswith("../"):
        return "its name leaves the claim"
    if "\0" in name:
        return "its name holds a NUL byte"
    if member.issym() or member.islnk():
        return "links are not unpacked (they could point outside the claim)"
    if not (member.isfile() or member.isdir()):
        return "only regular files and directories are unpacked"
    return None


def unpack(staged: Path, into: Dir, work: Dir, limit: int | None, shown: str, owner: tuple[int, int]) -> list[str]:
    """Unpack the tar at `staged` into the claim directory `into`, through a fresh directory in `work`
    (root's, where the claim's owner cannot plant links); each new file and directory is given to
    `owner`, the VM's user, through its fd. Returns the top-level names placed."""
    with open(staged, "rb") as f:
        header = f.read(512)
    # CDI knows a tar by the ustar magic of its first header (pkg/image/filefmt.go); so does this check:
    # tarfile alone would take zeros followed by anything for an empty archive.
    if header[257:262] != b"ustar":
        raise DiskkitError(shown, "cannot process a non tar file as an archive")
    total = 0
    with work.mkdir(TREE, 0o755) as staging, tarfile.open(staged, "r:") as tar:
        for member in tar:
            problem = _member_problem(member)
            if problem:
                raise DiskkitError(f"{shown}: {member.name}", problem)
            name = _clean(member.name)
            if name == ".":
                continue
            if member.isdir():
                staging.makedirs(name, 0o755).close()
                continue
            total += member.size
            if limit is not None and total > limit:
                raise DiskkitError(shown, f"unpacks to more than the claim's {limit} bytes. A larger PVC is required")
            parent, _, base = name.rpartition("/")
            with staging.makedirs(parent, 0o755) as where:
                fd = where.create(base, 0o600)
                try:
                    with os.fdopen(fd, "wb", closefd=False) as out:
                        shutil.copyfileobj(tar.extractfile(member), out, CHUNK)
                        out.flush()
                        os.fsync(fd)
                    give(fd, owner, member.mode & 0o755)  # never setuid, setgid or world-writable
                finally:
                    os.close(fd)
        placed = staging.names()
        clashes = [name for name in placed if into.lstat(name) is not None]
        if clashes:
            raise DiskkitError(f"{shown}: {clashes[0]}", f"already exists in the claim {into.path}")
        for fd in staging.walk_dirs():
            give(fd, owner)
            os.fsync(fd)
        for name in placed:
            staging.rename(name, into, name)
    into.fsync()
    return placed

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
from diskkit.streams.fsutil import fsync_dir

CHUNK = 1 << 20


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


def unpack(staged: Path, into: Path, staging: Path, limit: int | None, shown: str, finish) -> list[str]:
    """Unpack the tar at `staged` into the directory `into` (through `staging`, a fresh directory beside
    it); `finish(path)` hands each new file to the VM's user. Returns the top-level names placed."""
    with open(staged, "rb") as f:
        header = f.read(512)
    # CDI knows a tar by the ustar magic of its first header (pkg/image/filefmt.go); so does this check:
    # tarfile alone would take zeros followed by anything for an empty archive.
    if header[257:262] != b"ustar":
        raise DiskkitError(shown, "cannot process a non tar file as an archive")
    total = 0
    with tarfile.open(staged, "r:") as tar:
        for member in tar:
            problem = _member_problem(member)
            if problem:
                raise DiskkitError(f"{shown}: {member.name}", problem)
            name = _clean(member.name)
            if name == ".":
                continue
            path = staging / name
            if member.isdir():
                path.mkdir(parents=True, exist_ok=True)
                continue
            total += member.size
            if limit is not None and total > limit:
                raise DiskkitError(shown, f"unpacks to more than the claim's {limit} bytes. A larger PVC is required")
            path.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            with open(path, "xb") as out:
                shutil.copyfileobj(source, out, CHUNK)
                os.fsync(out.fileno())
            os.chmod(path, member.mode & 0o755)  # never setuid, setgid or world-writable
            finish(path)
    placed = sorted(p.name for p in staging.iterdir())
    clashes = [name for name in placed if (into / name).exists()]
    if clashes:
        raise DiskkitError(f"{shown}: {clashes[0]}", f"already exists in the claim {into}")
    for root, dirs, _ in os.walk(staging):
        for d in dirs:
            finish(Path(root) / d)
        fsync_dir(Path(root))
    for name in placed:
        os.rename(staging / name, into / name)
    fsync_dir(into)
    return placed

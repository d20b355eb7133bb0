"""The node cache: where pulled disks, overlays and VM records live, and how writers take turns.

    <root>/blobs/sha256/<hex>                       manifests and configs, by digest
    <root>/disks/sha256/<layer hex>/<member key>/   one extracted disk: disk.img (read-only) + meta.json
    <root>/refs/<key>.json                          image (+platform, path) -> the disk it resolved to
    <root>/tags/<key>.json                          reference -> manifest digest, for IfNotPresent
    <root>/signatures/sha256-<hex>.json             the signatures a manifest was accepted with
                                                    (launcher.node.admission)
    <root>/vms/<domain>.json, <root>/run/<domain>/  records and overlays of VMs started from here
                                                    (long domains: head + hash, see entry_name)
    <root>/pins/<domain>.json                       the digests a VirtualMachine's tags were pinned to
                                                    (launcher.node.pins); outlive its runs
    <root>/state/<domain>/                          a VirtualMachine's persistent EFI variables and TPM state
                                                    (launcher.volumes.vmstate): outlive its runs, as KubeVirt's
                                                    backend-storage claim; each run works on a copy
    <root>/dumps/<domain>.json                      a VM's memory dump claim and its last dump
                                                    (launcher.runtime.memorydump): outlive its runs, as a
                                                    VirtualMachine's status.memoryDumpRequest
    <root>/locks/, <root>/tmp/                      flock files; staging on the same filesystem
    <root>/partial/<digest>.part, .synced, .source  blobs being downloaded, kept for resuming after a kill
    <root>/lazy/, <root>/serve/                     the disk server's exports and sockets
    <root>/exports/<manifest hex>/                  KubeVirt VM exports made runnable (launcher.node.vmexport)
    <root>/chunks/index.sqlite                      which cached file holds which chunk (launcher.chunks.index)

What a cache holds is private: pulled disks are images other users may not be entitled to, and
what is being downloaded or served comes from private registries. So the directories carry it, not
every file's mode: a user's cache is 0700 throughout. A root cache is 0711 at the top (other users'
launchers reach the root disk server's sockets in serve/, which list nothing else) and in run/
(each VM's qemu passes through to its own run directory, which is open to that VM's uid alone,
launcher.runtime.rundir), and 0700 everywhere else: no qemu opens a pulled disk, a VM export's
claim or a kernel here by name, root hands each VM what it uses as an open file or a copy
(launcher.runtime.diskfds). Caches made before keep their modes; `too_open` names what is wider,
for a warning.

Disks are keyed by the layer that holds them and the member's path, so two images sharing a
layer share one file. Layer blobs themselves are not kept: the disk is what VMs use, and a second
copy of every image is the disk-space duplication users complain about (CDI #3778). Every entry
appears by rename after fsync, so a crash never leaves one that looks complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
from pathlib import Path
from typing import Iterator

from diskkit.errors import DiskkitError
from diskkit.streams.fsutil import fsync_dir, write_atomic
from launcher.hostfs.dirfd import DIR_NOFOLLOW, roots_alone, strict_parents


def default_root() -> Path:
    """$DISKKIT_CACHE, else /var/lib/diskkit as root, else ${XDG_CACHE_HOME:-~/.cache}/diskkit."""
    if os.environ.get("DISKKIT_CACHE"):
        return Path(os.environ["DISKKIT_CACHE"])
    if os.geteuid() == 0:
        return Path("/var/lib/diskkit")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "diskkit"


def key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


# A VM's entries are named after its domain, `<namespace>_<name>`: up to 317 bytes for valid names,
# more than a file name may hold (255) and than keeps the paths in the run directory short. Longer
# names keep a readable head and end in a hash of the whole.
ENTRY_NAME_MAX = 100


def entry_name(name: str) -> str:
    """A file name for `name`: itself when short and plain, else its head and a hash."""
    plain = name not in ("", ".", "..") and "/" not in name and "\0" not in name
    if plain and len(name.encode()) <= ENTRY_NAME_MAX:
        return name
    head = "".join(c for c in name[:ENTRY_NAME_MAX - 34] if c.isascii() and (c.isalnum() or c in "-_."))
    return f"{head.strip('.')}-{key(name)}"


def within(base: Path, *parts: str) -> Path:
    """`base`/parts, refused unless it stays under `base` (defence in depth: names are validated
    at parse time, and none may lead out of its directory, even through a symlink)."""
    path = base.joinpath(*parts)
    resolved, top = path.resolve(), base.resolve()
    if resolved != top and top not in resolved.parents:
        raise DiskkitError(path, f"leads out of {base}")
    return path


QEMU_ID = 107  # KubeVirt's qemu user and group


def private_dirs(top: Path, path: Path) -> Path:
    """Create `path` and every missing directory between `top` (which exists) and it, open to their
    owner only, 0700: they hold secrets (cloud-init passwords, Secret volumes, service account tokens).
    As root they stay root's while the VM is prepared, so no other user can put a name in them that
    root then writes through; launcher.runtime.rundir lets qemu in afterwards."""
    missing, at = [], path
    while at != top and not os.path.lexists(at):
        missing.append(at)
        at = at.parent
    for directory in reversed(missing):
        directory.mkdir(mode=0o700)
        os.chmod(directory, 0o700)  # whatever the umask; just made, in a directory only we write
    return path


SUBDIRS = ("blobs", "disks", "refs", "tags", "vms", "run", "locks", "tmp", "partial", "lazy", "pins", "exports", "chunks", "signatures", "state",
           "dumps")
PASSED_THROUGH = ("run",)  # each VM's qemu reaches its own run directory in it, and lists nothing


def layout_modes(privileged: bool) -> dict[str, int]:
    """The mode of the cache's top ("") and of each directory in it, for a cache root makes
    (`privileged`) or a user does."""
    if not privileged:
        return {"": 0o700, **{sub: 0o700 for sub in SUBDIRS}}
    return {"": 0o711, **{sub: 0o711 if sub in PASSED_THROUGH else 0o700 for sub in SUBDIRS}}


def too_open(modes: dict[str, int], want: dict[str, int]) -> list[str]:
    """The directories (keys of `modes`, their present modes) that grant more than `want` does."""
    return [name for name, mode in modes.items() if name in want and mode & 0o077 & ~want[name]]


# What root's cache must be made of before root uses it by path: its top and each directory in it.
ROOTS_ALONE = "root uses only a cache of root's that no other user can write (use this one as its owner, or give root its own)"


def refuse_unless_roots(root: Path) -> None:
    """Root works in the cache by path (locks, the chunk index, staging, records, overlays), so it uses
    only one no other user can have put a name in, or swap for a link between two of its steps: the
    top and each of its directories root's, writable by root alone, under directories only root can
    rename things in. Anything else is refused before anything is made, as the disk server's socket
    directory is (launcher.hostfs.dirfd.own_directory)."""
    strict_parents(root, str(root))
    if not roots_alone(root, ROOTS_ALONE):
        return  # made afresh by root, below directories only root can write
    for sub in (*SUBDIRS, "blobs/sha256", "disks/sha256"):
        roots_alone(root / sub, ROOTS_ALONE)


class Cache:
    def __init__(self, root: Path | str | None = None):
        self.root = Path(root) if root else default_root()
        self.privileged = os.geteuid() == 0
        self.modes = layout_modes(self.privileged)
        if self.privileged:
            refuse_unless_roots(self.root)
        try:
            self._make("")
            for sub in SUBDIRS:
                self._make(sub)
            for sub in ("blobs/sha256", "disks/sha256"):
                (self.root / sub).mkdir(exist_ok=True)
            if self.privileged:
                self._let_vms_through()
        except OSError as exc:
            raise DiskkitError(self.root, f"cache directory cannot be created ({exc.strerror})") from None
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise DiskkitError(self.root, "cache directory is not writable")

    def _make(self, sub: str) -> None:
        """Creates one of the cache's directories with its mode (an existing one is left alone)."""
        path = self.root / sub if sub else self.root
        try:
            path.mkdir(mode=0o700, parents=not sub)
        except FileExistsError:
            return
        fd = os.open(path, DIR_NOFOLLOW)
        try:
            os.fchmod(fd, self.modes[sub])  # whatever the umask
        finally:
            os.close(fd)

    def _let_vms_through(self) -> None:
        """run/ of a root cache made before each VM had a uid of its own (0750 to qemu's group, and 107
        by an ACL) becomes 0711, or no VM's qemu could reach its run directory; what the group and
        the ACL could list there goes with them. Only a directory root owns is touched."""
        for sub in PASSED_THROUGH:
            fd = os.open(self.root / sub, DIR_NOFOLLOW)
            try:
                st = os.fstat(fd)
                if st.st_uid == 0 and stat.S_IMODE(st.st_mode) != self.modes[sub]:
                    with contextlib.suppress(OSError):  # no ACL there, or a filesystem without them
                        os.removexattr(fd, "system.posix_acl_access")
                    os.fchmod(fd, self.modes[sub])
            finally:
                os.close(fd)

    def too_open(self) -> list[str]:
        """The cache's directories that other local users may read more of than a new cache allows."""
        present = {}
        for sub in ("", *SUBDIRS):
            with contextlib.suppress(OSError):
                present[sub] = stat.S_IMODE(os.lstat(self.root / sub if sub else self.root).st_mode)
        return [str(self.root / sub if sub else self.root) for sub in too_open(present, self.modes)]

    def vanished(self) -> bool:
        """The cache directory was deleted under us: what failed with it is told in one line, not a traceback."""
        return not (self.root / "locks").is_dir()

    @contextlib.contextmanager
    def lock(self, name: str, shared: bool = False) -> Iterator[None]:
        """A cross-process lock (flock): concurrent pulls of one image on a node download once."""
        path = within(self.root / "locks", f"{entry_name(name)}.lock")
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
            # gc removes lock files no one holds (remove_stale_locks): one removed while we waited for it
            # locks nothing any more, so take the file now under the name.
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        try:
            yield
        finally:
            os.close(fd)  # closing releases the lock

    @contextlib.contextmanager
    def lock_if_free(self, name: str) -> Iterator[bool]:
        """The lock `name` taken at once when no process holds it (True), else nothing taken (False):
        gc asks so, as it must not wait on a run that holds its VM's lock for a long pull."""
        path = within(self.root / "locks", f"{entry_name(name)}.lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield _same_file(path, fd)
        finally:
            os.close(fd)

    def remove_stale_locks(self, prefix: str) -> list[Path]:
        """Remove the lock files named `prefix`* that no process holds (a free non-blocking flock),
        each while holding it, so a waiter that gets it after sees it gone (see lock)."""
        removed = []
        for path in sorted((self.root / "locks").glob(f"{prefix}*.lock")):
            with _unheld(path, os.O_RDWR | os.O_NOFOLLOW) as fd:  # a held one: its VM is being started or stopped
                if fd is not None and _same_file(path, fd):
                    path.unlink()
                    removed.append(path)
        return removed

    @contextlib.contextmanager
    def staging(self) -> Iterator[Path]:
        """A private directory under tmp/, removed whatever happens; renames out of it are atomic."""
        path = self.root / "tmp" / secrets.token_hex(8)
        path.mkdir()
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX)  # tells gc this staging area is alive
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)
            os.close(fd)

    def stale_staging(self) -> list[Path]:
        """Staging directories whose pull died (their lock is free)."""
        stale = []
        for path in (self.root / "tmp").iterdir():
            with _unheld(path, os.O_RDONLY | os.O_DIRECTORY) as fd:
                if fd is not None:
                    stale.append(path)
        return stale

    def reclaim_staging(self) -> list[Path]:
        """Remove the staging directories of dead processes; returns them."""
        stale = self.stale_staging()
        for path in stale:
            shutil.rmtree(path, ignore_errors=True)
        return stale

    @property
    def partial_dir(self) -> Path:
        """Blob downloads in progress (diskkit.registry.partial): where a killed pull resumes from."""
        return self.root / "partial"

    # --- small JSON records ------------------------------------------------------------------

    def read_json(self, path: Path) -> dict | None:
        try:
            return json.loads(path.read_bytes())
        except (OSError, ValueError):
            return None  # missing or unreadable: treated as absent, the entry is rebuilt

    def write_json(self, path: Path, obj: dict) -> None:
        write_atomic(path, json.dumps(obj, indent=2, sort_keys=True).encode() + b"\n")

    def ref_path(self, ref_key: str) -> Path:
        return self.root / "refs" / f"{ref_key}.json"

    def tag_path(self, tag_key: str) -> Path:
        return self.root / "tags" / f"{tag_key}.json"

    def blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / "sha256" / digest.removeprefix("sha256:")

    def put_blob(self, digest: str, data: bytes) -> None:
        path = self.blob_path(digest)
        if not path.exists():
            write_atomic(path, data)

    def read_blob(self, digest: str, limit: int = 4 << 20) -> bytes | None:
        """A manifest or config kept by put_blob (at most `limit` bytes, as every manifest is read);
        None when it is missing or larger. Its digest is the caller's to check."""
        try:
            with open(self.blob_path(digest), "rb") as f:
                data = f.read(limit + 1)
        except OSError:
            return None
        return data if len(data) <= limit else None

    @property
    def signatures_dir(self) -> Path:
        return self.root / "signatures"

    # --- extracted disks ---------------------------------------------------------------------

    def disk_dir(self, layer_digest: str, member: str) -> Path:
        return self.root / "disks" / "sha256" / layer_digest.removeprefix("sha256:") / key(member)

    def install_disk(self, staged_file: Path, layer_digest: str, member: str, meta: dict, extra: dict[str, bytes] | None = None) -> Path:
        """Move a verified, spooled disk into place, with `extra` files beside it (name -> bytes, such
        as its chunks' hashes); returns the final disk.img path."""
        final = self.disk_dir(layer_digest, member)
        if (final / "disk.img").exists():
            return final / "disk.img"  # another image with this layer got here first
        entry = staged_file.parent / f"entry-{secrets.token_hex(4)}"
        entry.mkdir()
        disk = entry / "disk.img"
        staged_file.replace(disk)
        with open(disk, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(disk, 0o444)  # the shared base: VMs write to their own overlays only
        write_atomic(entry / "meta.json", json.dumps(meta, indent=2, sort_keys=True).encode() + b"\n")
        for name, data in (extra or {}).items():
            write_atomic(entry / name, data)
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            entry.replace(final)
        except OSError:
            if not (final / "disk.img").exists():
                raise
        fsync_dir(final.parent)
        return final / "disk.img"

    def disks(self) -> list[Path]:
        """Every complete disk entry directory."""
        return sorted(p.parent for p in (self.root / "disks" / "sha256").glob("*/*/disk.img"))

    def exports(self) -> list[Path]:
        """Every complete VM export directory (launcher.node.vmexport), named by its manifest's hex."""
        return sorted(p.parent for p in (self.root / "exports").glob("*/vm.json") if _HEX64.match(p.parent.name))

    def export_of(self, path: Path) -> Path | None:
        """The VM export directory a claim `path` lies in, or None for a claim of the user's own."""
        top = self.root / "exports"
        parent = Path(path).parent.parent
        return parent if parent.parent == top and _HEX64.match(parent.name) else None

    # --- VMs started from this cache ---------------------------------------------------------

    def vm_record_path(self, domain: str) -> Path:
        return within(self.root / "vms", f"{entry_name(domain)}.json")

    def run_dir(self, domain: str) -> Path:
        return within(self.root / "run", entry_name(domain))

    def run_dirs(self) -> list[Path]:
        # not the short links to their console directories (launcher.runtime.rundir)
        return sorted(p for p in (self.root / "run").glob("*") if p.is_dir() and not p.is_symlink())

    def pin_path(self, domain: str) -> Path:
        return within(self.root / "pins", f"{entry_name(domain)}.json")

    def memory_dump_path(self, domain: str) -> Path:
        return within(self.root / "dumps", f"{entry_name(domain)}.json")

    def memory_dump_records(self) -> list[dict]:
        found = (self.read_json(path) for path in sorted((self.root / "dumps").glob("*.json")))
        return [record for record in found if record]

    def images_by_disk(self) -> dict[str, list[str]]:
        """Each disk entry's directory -> the image references pulls resolved to it (for `launcher ls`):
        the one whose pull installed it, and every tag the node last saw naming the same manifest."""
        tags: dict[str, set[str]] = {}
        for path in sorted((self.root / "tags").glob("*.json")):
            record = self.read_json(path)
            if record and record.get("digest") and record.get("image"):
                tags.setdefault(record["digest"], set()).add(record["image"])
        found: dict[str, set[str]] = {}
        for path in sorted((self.root / "refs").glob("*.json")):
            record = self.read_json(path)
            if record and record.get("path") and record.get("image"):
                found.setdefault(str(Path(record["path"]).parent), set()).update({record["image"], *tags.get(record.get("digest"), ())})
        return {entry: sorted(images) for entry, images in found.items()}

    def vm_records(self) -> list[dict]:
        records = []
        for path in sorted((self.root / "vms").glob("*.json")):
            record = self.read_json(path)
            if record:
                records.append(record)
        return records


_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def tree_size(path: Path) -> int:
    """Bytes actually allocated (sparse files count what they hold, not their length)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


@contextlib.contextmanager
def _unheld(path: Path, flags: int) -> Iterator[int | None]:
    """`path` opened and locked when no process holds its lock (its owner died or let go), else None."""
    try:
        fd = os.open(path, flags)
    except OSError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield None
            return
        yield fd
    finally:
        os.close(fd)


def _same_file(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False

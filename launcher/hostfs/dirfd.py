"""A directory held open by fd, and the files in it, handled so that root never follows a path it did
not make.

Python 3.11 has no openat2 (RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS); opening each component with
O_NOFOLLOW relative to the fd of the one before gives the same guarantee for the paths walked here, on
every kernel. Existing files are first opened O_PATH (which opens nothing: no FIFO blocks, no device
driver runs), checked with fstat, and only a regular file with one link is reopened for reading or
writing through /proc/self/fd, which names that inode and no other.

Code that needs a path (qemu-img, tarfile, the registry client) is given `Dir.proc`: the held
directory as /proc/PID/fd/N, which a rename or a planted link of the directory's name cannot redirect.
In a process working as a directory's owner (`launcher.hostfs.asowner`) it is the directory's name:
such a process is not dumpable, so the tools it starts could not open its /proc/PID/fd, and whatever
the name leads to, the owner could reach anyway.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from diskkit.errors import DiskkitError

NOFOLLOW = "is a symbolic link; root never follows a link in a directory others can write"
NOT_REGULAR = "is not a regular file (a FIFO, device, socket or directory); only regular files are used here"
LINKED = "has other hard links; a file linked from elsewhere is never written or chowned"
_CLOEXEC = os.O_CLOEXEC
DIR_NOFOLLOW = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC  # a directory itself, never a link to one
_by_name = False  # set for good in a process that works as the directories' owner


def name_paths() -> None:
    """From now on (in this process, which works as the owner of the directories it holds), tools are
    given names, not /proc/PID/fd paths."""
    global _by_name
    _by_name = True


class Dir:
    """An open directory. Names given to its methods are single components unless a method says so."""

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, Path(path)

    # --- opening directories -----------------------------------------------------------------

    @classmethod
    def open(cls, path: Path | str) -> Dir:
        """A directory named by the node's own configuration (a claim given with --pvc, a PV's path): its
        path is trusted as given; what is inside it is not."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        except OSError as exc:
            raise DiskkitError(path, f"cannot be opened as a directory ({exc.strerror})") from None
        return cls(fd, Path(path))

    @classmethod
    def open_named(cls, path: Path | str) -> Dir:
        """A directory someone named on a command line (where a command's output goes). As root it is
        walked from / one component at a time, and a symbolic link is followed only where no other
        user could have put it: in a directory of root's that no one else can write, or a root-owned
        link in a sticky one (/tmp); a link in anyone else's directory is refused. Another user's
        directory can still be the end of the walk: what is written there goes through its fd."""
        path = Path(os.path.abspath(path))
        if os.geteuid() != 0:
            return cls.open(path)  # our own rights bound whatever a link leads to
        fd = os.open("/", DIR_NOFOLLOW)
        todo, hops = list(path.parts[1:]), 0
        try:
            while todo:
                part = todo.pop(0)
                if part in ("", "."):
                    continue
                try:
                    nxt = os.open(part, DIR_NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    st = _lstat_at(fd, part)
                    if st is None or not stat.S_ISLNK(st.st_mode):
                        raise DiskkitError(path, f"cannot be opened as a directory ({exc.strerror})") from None
                    hops += 1
                    if hops > _MAX_LINKS or not _roots_link(os.fstat(fd), st):
                        raise DiskkitError(path, f"{part} {NOFOLLOW}") from None
                    target = os.readlink(part, dir_fd=fd)
                    if target.startswith("/"):
                        os.close(fd)
                        fd = os.open("/", DIR_NOFOLLOW)
                    todo[:0] = Path(target).parts[1:] if target.startswith("/") else Path(target).parts
                    continue
                os.close(fd)
                fd = nxt
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, path)

    def subdir(self, name: str) -> Dir:
        try:
            fd = os.open(name, DIR_NOFOLLOW, dir_fd=self.fd)
        except OSError as exc:
            raise self._refusal(name, exc) from None
        return Dir(fd, self.path / name)

    def mkdir(self, name: str, mode: int = 0o700) -> Dir:
        """A new directory of ours (an existing one, or a link, under that name is refused)."""
        try:
            os.mkdir(name, mode, dir_fd=self.fd)
        except OSError as exc:
            raise self._refusal(name, exc) from None
        return self.subdir(name)

    def makedirs(self, relative: str, mode: int = 0o700) -> Dir:
        """`relative` (a/b/c, no `..`), each missing component made, none followed if it is a link."""
        here = Dir(os.dup(self.fd), self.path)
        for part in [p for p in relative.split("/") if p not in ("", ".")]:
            if part == "..":
                here.close()
                raise DiskkitError(self.path / relative, "leaves its directory")
            try:
                os.mkdir(part, mode, dir_fd=here.fd)
            except FileExistsError:
                pass
            except OSError as exc:
                here.close()
                raise here._refusal(part, exc) from None
            try:
                nxt = here.subdir(part)
            finally:
                here.close()
            here = nxt
        return here

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Dir:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def proc(self) -> Path:
        """This directory as a path that stays this directory whatever happens to its name (see the module
        doc for a process that works as the directory's owner)."""
        return self.path if _by_name else Path(f"/proc/{os.getpid()}/fd/{self.fd}")

    def file_path(self, name: str, fd: int) -> Path:
        """The open file `fd`, named `name` here, as a path for a tool: /proc/PID/fd/FD, or its name (as
        `proc`)."""
        return self.path / name if _by_name else Path(f"/proc/{os.getpid()}/fd/{fd}")

    # --- looking ---------------------------------------------------------------------------------

    def lstat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise self._refusal(name, exc) from None

    def regular(self, name: str) -> os.stat_result | None:
        """The file's stat when it is a regular file, None when absent; anything else is refused."""
        st = self.lstat(name)
        if st is not None:
            self._check(name, st)
        return st

    def names(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    # --- files -----------------------------------------------------------------------------------

    def open_file(self, name: str, flags: int = os.O_RDONLY, create: int | None = None) -> int:
        """An fd of the regular file `name`. With `create` (a mode) a missing file is made; an existing
        one is used only when it is a regular file with one link."""
        access = flags & ~(os.O_CREAT | os.O_EXCL)
        if create is not None:
            try:
                return os.open(name, access | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, create, dir_fd=self.fd)
            except FileExistsError:
                if flags & os.O_EXCL:
                    raise DiskkitError(self.path / name, "already exists") from None
            except OSError as exc:
                raise self._refusal(name, exc) from None
        try:
            handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | _CLOEXEC, dir_fd=self.fd)
        except OSError as exc:
            raise self._refusal(name, exc) from None
        try:
            st = os.fstat(handle)
            if stat.S_ISLNK(st.st_mode):
                raise DiskkitError(self.path / name, NOFOLLOW)
            self._check(name, st)
            return os.open(f"/proc/self/fd/{handle}", access | _CLOEXEC)
        except OSError as exc:
            raise self._refusal(name, exc) from None
        finally:
            os.close(handle)

    def create(self, name: str, mode: int = 0o600) -> int:
        """A new file of ours, open for writing; whatever is under that name already is refused."""
        return self.open_file(name, os.O_RDWR | os.O_EXCL, create=mode)

    def read_bytes(self, name: str, limit: int) -> bytes | None:
        """A small file's bytes (None when absent); more than `limit` bytes is refused."""
        if self.lstat(name) is None:
            return None
        fd = self.open_file(name)
        try:
            data = os.read(fd, limit + 1)
        finally:
            os.close(fd)
        if len(data) > limit:
            raise DiskkitError(self.path / name, f"is larger than {limit} bytes")
        return data

    def replace(self, name: str, data: bytes, mode: int = 0o644, owner: tuple[int, int] | None = None) -> None:
        """Write `name` whole or not at all: a new file under a random name, synced, renamed over it."""
        self.replace_with(name, lambda f: f.write(data), mode, owner)

    def replace_with(self, name: str, write: Callable[[BinaryIO], object], mode: int = 0o600,
                     owner: tuple[int, int] | None = None) -> int:
        """`replace`, the bytes written by `write(file)`: a new file under a random name (O_EXCL, no
        link followed), synced, renamed over `name` (a rename replaces a link there, never follows it);
        nothing under `name` until it is whole. Its size."""
        tmp = f".{name}.tmp-{os.urandom(4).hex()}"
        fd = self.create(tmp, mode)
        try:
            with os.fdopen(fd, "wb", closefd=False) as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            give(fd, owner)
            size = os.fstat(fd).st_size
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except OSError as exc:
            self.unlink(tmp)
            raise DiskkitError(self.path / name, f"cannot be written ({exc.strerror})") from None
        except BaseException:
            self.unlink(tmp)
            raise
        finally:
            os.close(fd)
        self.fsync()
        return size

    def rename(self, name: str, to: Dir, new: str) -> None:
        """Move the entry itself (a rename never follows a link at either end)."""
        try:
            os.rename(name, new, src_dir_fd=self.fd, dst_dir_fd=to.fd)
        except OSError as exc:
            raise DiskkitError(to.path / new, f"cannot be put in place ({exc.strerror})") from None

    def unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass

    def remove(self, name: str) -> None:
        """A file, link or whole tree, removed without following any link in it."""
        st = self.lstat(name)
        if st is None:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(name, dir_fd=self.fd, ignore_errors=True)  # fd-based: links inside are unlinked, not followed
        else:
            self.unlink(name)

    def discard(self, child: Dir, name: str) -> None:
        """Empty `child` (through its fd, wherever its name went) and remove it, or whatever now has its
        name: a directory of ours the claim's owner renamed away is left empty, not full."""
        for entry in child.names():
            child.remove(entry)
        st, mine = self.lstat(name), os.fstat(child.fd)
        child.close()
        if st is not None and (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=self.fd)
        else:
            self.remove(name)  # a link or anything else put under the name: the name goes, nothing it names

    def fsync(self) -> None:
        os.fsync(self.fd)

    def walk_dirs(self) -> Iterator[int]:
        """An fd of every directory below this one (links not followed)."""
        for top, _, _, fd in os.fwalk(".", dir_fd=self.fd, follow_symlinks=False):
            if top != ".":
                yield fd

    # --- refusals --------------------------------------------------------------------------------

    def _check(self, name: str, st: os.stat_result) -> None:
        if stat.S_ISLNK(st.st_mode):
            raise DiskkitError(self.path / name, NOFOLLOW)
        if not stat.S_ISREG(st.st_mode):
            raise DiskkitError(self.path / name, NOT_REGULAR)
        if st.st_nlink > 1:
            raise DiskkitError(self.path / name, LINKED)

    def _refusal(self, name: str, exc: OSError) -> DiskkitError:
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and os.path.islink(self.proc / name)):
            return DiskkitError(self.path / name, NOFOLLOW)
        return DiskkitError(self.path / name, f"cannot be used ({exc.strerror})")


_MAX_LINKS = 40  # as the kernel's MAXSYMLINKS


def _lstat_at(fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return None


def _roots_link(directory: os.stat_result, link: os.stat_result) -> bool:
    """A link only root could have put in `directory`: root's directory, writable by no one else, or
    sticky (where only the link's owner may replace it) and the link root's."""
    if directory.st_uid != 0:
        return False
    if not directory.st_mode & 0o022:
        return True
    return bool(directory.st_mode & stat.S_ISVTX) and link.st_uid == 0


def give(fd: int, owner: tuple[int, int] | None, mode: int | None = None) -> None:
    """chown (as root) and chmod an open file or directory: the inode we hold, never a name."""
    if mode is not None:
        os.fchmod(fd, mode)
    if owner is not None and os.geteuid() == 0:
        os.fchown(fd, *owner)


def own_directory(path: Path, what: str, root_mode: int) -> None:
    """Check the directory `path` that root puts sockets in and give it `root_mode` (when root): the
    directory itself (a link to one is refused, its target is never chmodded) and, as root, root's own,
    under directories only root can rename things in (as sshd's StrictModes): otherwise another user
    could swap it, or a parent, for a link under root's feet."""
    try:
        fd = os.open(path, DIR_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise DiskkitError(f"{what} {path}", NOFOLLOW) from None
        raise DiskkitError(f"{what} {path}", f"cannot be opened as a directory ({exc.strerror})") from None
    try:
        if os.geteuid() == 0:
            owner = os.fstat(fd).st_uid
            if owner != 0:
                raise DiskkitError(f"{what} {path}", f"belongs to uid {owner}; a root disk server puts its sockets only in root's directories")
            strict_parents(path, f"{what} {path}")
            os.fchmod(fd, root_mode)
    finally:
        os.close(fd)


def strict_parents(path: Path, what: str) -> None:
    """Every directory above `path` is root's and only root can rename things in it (sshd's StrictModes;
    a sticky one, as /tmp, lets no one rename another's entry): otherwise another user could swap
    `path`, or a directory above it, for one of their own or a link. Directories not made yet are
    root's to make."""
    for parent in Path(os.path.abspath(path)).parents:
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            continue
        if st.st_uid != 0 or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
            raise DiskkitError(what, f"is inside {parent}, which another user can write (uid {st.st_uid},"
                                     f" mode {stat.S_IMODE(st.st_mode):o}); it could be swapped for a link")


def roots_alone(path: Path, what: str) -> bool:
    """`path` is a directory (never a link to one) root owns and no one else can write, so no other user
    can have put a name in it; False when there is nothing there yet. Anything else is refused, naming
    `what`: the owner (who should use it as themselves), a link, or the mode that lets others in."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(st.st_mode):
        raise DiskkitError(path, NOFOLLOW)
    if not stat.S_ISDIR(st.st_mode):
        raise DiskkitError(path, f"is not a directory; {what}")
    if st.st_uid != 0:
        raise DiskkitError(path, f"belongs to uid {st.st_uid}; {what}")
    if st.st_mode & 0o022:
        raise DiskkitError(path, f"can be written by other users (mode {stat.S_IMODE(st.st_mode):o}); {what}")
    return True

"""Follow a guest's serial console through the log file libvirt writes for it.

Reading the log rather than attaching to the pty means nothing printed before we look is lost,
and the same file stays behind for `launcher ls`/debugging after the guest is gone.

The log's directory belongs to qemu's user (its log daemon, virtlogd, rotates the log there: renames
it away and starts a new one past its max_size), so for a root launcher every name in it is one
another process of that user could have replaced: the log is opened through the directory's fd,
never through a link, and only as a regular file (launcher.hostfs.dirfd). A rotation shows as a new
file under the log's name; what is left of the old one is read first, from the fd held open.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable

from diskkit.errors import DiskkitError
from launcher.hostfs.dirfd import DIR_NOFOLLOW, Dir

POLL = 0.1
READ = 1 << 16
MAX_BACKUPS = 64  # rotated files looked through for the one after ours (virtlogd keeps 3 by default)


class ConsoleLog:
    """The console log, read from where the last read stopped, across rotations."""

    def __init__(self, log: Path):
        self.log = log
        self._dir: Dir | None = None
        self._fd = -1
        self._ident: tuple[int, int] | None = None
        self._offset = 0

    def read(self) -> bytes:
        """What was logged since the last read (at most READ bytes); b"" when nothing new is there yet."""
        if self._fd < 0 and not self._open():
            return b""  # qemu has not started logging yet
        data = os.pread(self._fd, READ, self._offset)
        if not data:
            current = self._dir.lstat(self.log.name)
            if current is None or (current.st_dev, current.st_ino) == self._ident:
                return b""
            # Rotated: the old file takes no more writes once renamed, so what it holds now is the rest.
            data = os.pread(self._fd, READ, self._offset)
            if not data:
                return self._next_file()
        self._offset += len(data)
        return data

    def _next_file(self) -> bytes:
        """Go on with the file logged after the drained one. A chatty guest may fill more than one
        file between two reads: the one after ours is then a backup itself (virtlogd renames LOG to
        LOG.0, LOG.0 to LOG.1 and so on), found by where ours went; reopening LOG would skip it."""
        after = None
        for index in range(MAX_BACKUPS):
            st = self._dir.lstat(f"{self.log.name}.{index}")
            if st is None:
                break
            if (st.st_dev, st.st_ino) == self._ident:
                after = f"{self.log.name}.{index - 1}" if index else self.log.name
                break
        self._close_file()
        if after is None or after == self.log.name or self._dir.lstat(after) is None:
            return self.read()  # ours is gone past the backups, or LOG comes next: the newest file
        self._fd = self._dir.open_file(after)  # a link, FIFO or device under the name is refused
        st = os.fstat(self._fd)
        self._ident, self._offset = (st.st_dev, st.st_ino), 0
        return self.read()

    def _open(self) -> bool:
        if self._dir is None:
            try:
                self._dir = Dir(os.open(self.log.parent, DIR_NOFOLLOW), self.log.parent)
            except FileNotFoundError:
                return False
            except OSError as exc:
                raise DiskkitError(self.log.parent, f"cannot be opened as a directory ({exc.strerror}; a symbolic link is not followed)") from None
        if self._dir.lstat(self.log.name) is None:
            return False
        self._fd = self._dir.open_file(self.log.name)  # a link, FIFO or device under the name is refused
        st = os.fstat(self._fd)
        self._ident, self._offset = (st.st_dev, st.st_ino), 0
        return True

    def _close_file(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        self._close_file()
        if self._dir is not None:
            self._dir.close()
            self._dir = None


def follow(
    log: ConsoleLog,
    running: Callable[[], bool],
    wait_for: str | None = None,
    timeout: float | None = None,
    echo: Callable[[bytes], None] | None = None,
    interrupted: threading.Event | None = None,
) -> str:
    """Stream the log from where it was last read until `wait_for` appears ("found"), the guest stops
    ("stopped"), time runs out ("timeout") or `interrupted` is set ("interrupted")."""
    interrupted = interrupted or threading.Event()
    deadline = None if timeout is None else time.monotonic() + timeout
    needle = wait_for.encode() if wait_for else None
    seen = b""  # the tail kept for matching text split across reads
    while not interrupted.is_set():
        alive = running()
        data = log.read()
        if data:
            if echo:
                echo(data)
            if needle:
                seen = (seen + data)[-(len(needle) + len(data)) :]
                if needle in seen:
                    return "found"
        elif not alive:
            return "stopped"
        if deadline is not None and time.monotonic() > deadline:
            return "timeout"
        if not data:
            interrupted.wait(POLL)
    return "interrupted"

"""Follow a guest's serial console through the log file libvirt writes for it.

Reading the log rather than attaching to the pty means nothing printed before we look is lost,
and the same file stays behind for `launcher ls`/debugging after the guest is gone.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable

POLL = 0.1


def follow(
    log: Path,
    running: Callable[[], bool],
    wait_for: str | None = None,
    timeout: float | None = None,
    echo: Callable[[bytes], None] | None = None,
    interrupted: threading.Event | None = None,
    offset: int = 0,
) -> str:
    """Stream the log from `offset` until `wait_for` appears ("found"), the guest stops ("stopped"),
    time runs out ("timeout") or `interrupted` is set ("interrupted")."""
    interrupted = interrupted or threading.Event()
    deadline = None if timeout is None else time.monotonic() + timeout
    needle = wait_for.encode() if wait_for else None
    seen = b""  # the tail kept for matching text split across reads
    while not interrupted.is_set():
        alive = running()
        data = _read_from(log, offset)
        if data:
            offset += len(data)
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


def _read_from(log: Path, offset: int) -> bytes:
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            return f.read(1 << 16)
    except FileNotFoundError:
        return b""  # qemu has not opened it yet

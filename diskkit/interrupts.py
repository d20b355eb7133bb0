"""Stop signals (SIGTERM, Ctrl-C, SIGHUP) held back while a step makes or changes something only its
own undo can take back.

The CLIs turn SIGTERM and Ctrl-C into KeyboardInterrupt (`unwind`), so every `finally` runs and
what was begun is undone. Raised at an arbitrary point, though, the exception can land after a
staging directory is made and before anything holds it to remove it, or inside a C library's
callback that swallows it. Inside `held()` the signal waits and is raised when the step is over.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator

HELD = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP}

_depth = 0
_pending = False


def unwind(signum, frame) -> None:
    """The CLIs' handler for SIGTERM and Ctrl-C: KeyboardInterrupt now, or when the held step ends.

    Blocking the signal for the main thread alone is not enough: the kernel may hand it to another
    thread (a progress bar's, an upload's), and Python then runs this handler in the main thread at
    its next instruction, inside the held step."""
    global _pending
    if _depth:
        _pending = True
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Run the block with stop signals held; one that arrived meanwhile is raised as it ends.

    In another thread only that thread's mask changes: the handler runs in the main thread, and
    its KeyboardInterrupt belongs there."""
    global _depth, _pending
    main = threading.current_thread() is threading.main_thread()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HELD)
    _depth += main
    try:
        yield
    finally:
        _depth -= main
        # A signal blocked meanwhile is handled inside this call, raising from here.
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        if main and not _depth and _pending:
            _pending = False
            raise KeyboardInterrupt

"""Recording the order of a boot's reads on the node's disk server, for `launcher test --record-trace`
and `launcher run --record-trace` (diskkit.oci.readtrace is the trace's format).

An `open` that asks for a trace (a token of its launcher's choosing) is answered with an export name
of its own, `<export>.trace-<token>`: the same export, under a name only that VM's qemu connects
with, so the reads of other VMs sharing the export are not in its trace. Reads are recorded in the
order they arrive, before they are answered, until the launcher takes the trace (`op: trace`), which
only the user that opened it may. Bounded: at most MAX_RECORDINGS at once (the oldest goes), each
at most diskkit.limits.MAX_TRACE_READS runs.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict

from diskkit.errors import DiskkitError
from diskkit.oci.readtrace import Recorder

MAX_RECORDINGS = 64
SUFFIX = ".trace-"
_TOKEN = re.compile(r"^[0-9a-f]{16,64}$")


class Traced:
    """An export as a traced VM's connections see it: each read recorded, then served by the export."""

    def __init__(self, export, name: str, recorder: Recorder, lock: threading.Lock):
        self.export, self.name, self.recorder, self.lock = export, name, recorder, lock
        self.description, self.size = export.description, export.size

    def read_ready(self, offset: int, length: int):
        # Every NBD read asks read_ready first, on its connection's thread, in the order the reads came.
        with self.lock:
            self.recorder.add(offset, length)
        return self.export.read_ready(offset, length)

    def read(self, offset: int, length: int) -> bytes:
        return self.export.read(offset, length)


class Recordings:
    def __init__(self):
        self.lock = threading.Lock()
        # alias -> (token, uid, export name, what the trace is of, recorder)
        self.active: OrderedDict[str, tuple[str, int | None, str, dict, Recorder]] = OrderedDict()

    def start(self, token, uid: int | None, export: str, size: int, about: dict) -> str:
        """The export name the traced VM connects with."""
        if not isinstance(token, str) or not _TOKEN.match(token):
            raise DiskkitError("open", "trace must be a token of 16 to 64 lowercase hex digits")
        alias = f"{export}{SUFFIX}{token}"
        with self.lock:
            if alias not in self.active:
                self.active[alias] = (token, uid, export, {**about, "size": size}, Recorder(size))
            while len(self.active) > MAX_RECORDINGS:
                self.active.popitem(last=False)
        return alias

    def lookup(self, alias: str, export) -> Traced | None:
        """`export` (the one the alias names, looked up by the caller) as the traced VM reads it."""
        with self.lock:
            found = self.active.get(alias)
        if found is None or export is None:
            return None
        return Traced(export, alias, found[4], self.lock)

    def take(self, token, uid: int | None) -> list[dict]:
        """The traces recorded under `token` for `uid`, ended: reads after this are not recorded."""
        if not isinstance(token, str) or not _TOKEN.match(token):
            raise DiskkitError("trace", "needs the token the open was given")
        out = []
        with self.lock:
            for alias, (got, owner, export, about, recorder) in list(self.active.items()):
                if got != token:
                    continue
                if owner != uid:
                    raise DiskkitError("trace", "only the user that opened a traced export may take its trace")
                del self.active[alias]
                out.append({**about, "export": export, "reads": recorder.reads(), "truncated": recorder.truncated})
        return out


def base_name(name: str) -> str | None:
    """The export an alias names, or None when `name` is no alias."""
    base, sep, token = name.partition(SUFFIX)
    return base if sep and _TOKEN.match(token) else None

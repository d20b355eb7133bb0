"""Work in a directory as the user who owns it: a forked child with that user's uid and gid, no
supplementary groups and no capabilities (as `setpriv --reuid --regid --clear-groups --inh-caps=-all`).

A claim directory belongs to its user, who can plant a link under any name in it at any moment. Root
working there must never follow one; the directory fds of `launcher.hostfs.dirfd` see to that, but a
tool given a path, or a step that forgets, would still act with root's rights. Work done as the
claim's owner needs no such care to be safe: whatever a link leads it to, the owner could reach itself.

The child is a fork, so it shares nothing with the parent after the fork but what it sends back: JSON
messages (never pickles: the child runs as a less trusted user) and open file descriptors over a
SOCK_SEQPACKET pair. The kernel marks it non-dumpable when its uids change, so its owner cannot ptrace
it or read its memory (a copy of root's: Secrets, the upload signing key). For the same reason tools
it starts cannot open its /proc/PID/fd either; `dirfd.name_paths()` has its directories give tools
their names instead, which as the owner is as safe as the fd.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import time
import traceback
from typing import Callable

from diskkit.errors import DiskkitError
from launcher.hostfs import dirfd
from launcher.hostfs.dirfd import Dir

Owner = tuple[int, int]
Send = Callable[[dict], None]
MESSAGE = 1 << 16
_PR_SET_NO_NEW_PRIVS = 38
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
_CAP_FIELDS = ("CapInh", "CapPrm", "CapEff", "CapAmb")
_GRACE = 30.0  # seconds an interrupted child has to put its work back before it is killed


def owner_of(directory: Dir) -> Owner | None:
    """Whom to work as in `directory`: its owner when root works there and it is not root's; None to
    work as we are (an unprivileged launcher works in its own claims as itself)."""
    if os.geteuid() != 0:
        return None
    st = os.fstat(directory.fd)
    return None if st.st_uid == 0 else (st.st_uid, st.st_gid)


def run_as(owner: Owner, job: Callable[[Send], dict], on_message: Callable[[dict], None] = lambda m: None) -> dict:
    """`job(send)` run by a child as `owner`; its result (a JSON object) returned here. Whatever it
    passes to `send` reaches `on_message` meanwhile. A DiskkitError or OSError it raises is raised here
    as the same one line."""
    result, _ = _fork(owner, lambda sock: {"result": job(lambda m: _send(sock, {"message": m}))}, on_message)
    return result["result"]


def open_as(owner: Owner, directory: Dir, name: str, flags: int, create: int | None = None) -> int:
    """An fd of `name` in `directory`, opened by its owner (`Dir.open_file`'s rules: no link followed,
    only a regular file with one link). Root may then read or write it: the file is one the owner chose
    with its own rights, and no name is looked up again."""
    def job(sock: socket.socket) -> dict:
        fd = directory.open_file(name, flags, create)
        _send(sock, {"result": None}, [fd])
        return {}

    _, fds = _fork(owner, job, lambda m: None)
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise DiskkitError(directory.path / name, f"was not opened as uid {owner[0]}")
    return fds[0]


# ---------------------------------------------------------------- the child

def drop_to(owner: Owner) -> None:
    """Become `owner` for good: no groups, no capabilities in any set, none to gain by exec."""
    uid, gid = owner
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)  # all uids non-zero: the kernel clears permitted, effective and ambient
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable: zero, twice (64 capability bits)
    if libc.capset(header, data) != 0 or libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "cannot drop capabilities")
    left = _capabilities()
    if os.getresuid() != (uid,) * 3 or os.getresgid() != (gid,) * 3 or os.getgroups() or any(left.values()):
        raise OSError(0, f"still privileged after dropping to uid {uid}: {left}")


def _capabilities() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {k: int(v, 16) for k, _, v in (line.partition(":\t") for line in f) if k in _CAP_FIELDS}


def _send(sock: socket.socket, obj: dict, fds: list[int] = ()) -> None:
    data = json.dumps(obj).encode()
    if len(data) > MESSAGE:
        raise ValueError("message too large")
    socket.send_fds(sock, [data], list(fds))


def _child(sock: socket.socket, owner: Owner, job: Callable[[socket.socket], dict]) -> int:
    try:
        drop_to(owner)
        dirfd.name_paths()
        reply = job(sock)
        if "result" in reply:
            _send(sock, reply)
        return 0
    except DiskkitError as exc:
        _send(sock, {"diskkit": [exc.subject, exc.rule]})
        return 1
    except OSError as exc:
        _send(sock, {"oserror": [exc.errno or 0, exc.strerror or str(exc), *([str(exc.filename)] if exc.filename else [])]})
        return 1
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:  # a bug: its one line, and the traceback on stderr for whoever debugs it
        traceback.print_exc()
        _send(sock, {"crash": f"{type(exc).__name__}: {exc}"})
        return 1


def _fork(owner: Owner, job: Callable[[socket.socket], dict], on_message: Callable[[dict], None]) -> tuple[dict, list[int]]:
    parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            parent_sock.close()
            code = _child(child_sock, owner, job)
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    child_sock.close()
    try:
        with parent_sock:
            while True:
                data, fds, _, _ = socket.recv_fds(parent_sock, MESSAGE, 4)
                if not data:
                    status, pid = _wait(pid), 0
                    raise DiskkitError(f"worker as uid {owner[0]}", f"ended without an answer ({_status(status)})")
                reply = json.loads(data)
                if "message" in reply:
                    for fd in fds:
                        os.close(fd)
                    on_message(reply["message"])
                    continue
                _wait(pid)
                pid = 0
                if "diskkit" in reply:
                    subject, rule = reply["diskkit"]
                    raise DiskkitError(subject, rule) if subject is not None else DiskkitError(rule)
                if "oserror" in reply:
                    raise OSError(*reply["oserror"])
                if "crash" in reply:
                    raise DiskkitError(f"worker as uid {owner[0]}", f"failed ({reply['crash']})")
                return reply, fds
    finally:
        if pid:
            _stop(pid)


def _wait(pid: int) -> int:
    return os.waitpid(pid, 0)[1]


def _status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.waitstatus_to_exitcode(status)}"


def _stop(pid: int) -> None:
    """The parent was interrupted or failed: the child is asked to stop (its clean-up runs), then made to."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + _GRACE
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)

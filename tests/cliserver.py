"""A fork server for the suite's CLI runs.

Each `diskkit ...` or `launcher ...` that run_diskkit/run_launcher run is a fresh process forked from
one that has already imported the CLIs and their libraries, instead of a new interpreter importing
them again: thousands of runs, each spending a tenth of a CPU-second or more on start-up, are most of
what the quick tier costs on two cores.

What the command sees is what a new process of `python -m MODULE ARGS` sees: its own pid, the test's
arguments, environment, working directory and standard streams; signal dispositions as a new
interpreter sets them; no descriptor of the server's; the interpreter's usual exit (atexit, threads
joined, streams flushed) with the command's status; as another user, the credentials `setpriv` would
give it. Runs whose environment would change how the interpreter starts (PYTHON*, the locale), and
users given by name, start a real interpreter instead. The entry points
themselves are still run as users run them by tests/test_startup.py and the examples' tests.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import importlib
import json
import locale
import os
import pkgutil
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PR_SET_DUMPABLE = 4

# Every module of both packages (a command loads its own when it is named: `launcher run` alone
# imported 0.34 CPU-s of them after the fork) and the libraries they use. None reads the
# environment or touches the system when imported, so importing them ahead changes nothing a
# command sees.
PACKAGES = ("diskkit", "launcher")
LIBRARIES = ("rich.console", "rich.progress", "yaml", "requests", "urllib3", "libvirt")


def preload() -> None:
    names = list(LIBRARIES)
    for package in map(importlib.import_module, PACKAGES):
        names += [m.name for m in pkgutil.walk_packages(package.__path__, f"{package.__name__}.") if not m.name.endswith(".__main__")]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def serve(path: str) -> None:
    """The server: import, then fork a command per connection until the socket is removed."""
    preload()
    gc.collect()
    gc.freeze()  # the forks then leave these objects' pages shared
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    # Waiters reaped by the kernel; each waiter puts SIGCHLD back before it forks its command.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _wait_for_command(conn, json.loads(message), fds)
        conn.close()
        for fd in fds:
            os.close(fd)


def _wait_for_command(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """The waiter: fork the command, tell the client its pid, then its exit status."""
    pid = os.fork()
    if pid == 0:
        _become_command(conn, request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    os._exit(0)


def _become_command(conn: socket.socket, request: dict, fds: list[int]) -> None:
    conn.close()
    high = [os.dup(fd) for fd in fds]  # out of 0-2 first, so no dup2 below overwrites another's source
    for target, fd in enumerate(high):
        os.dup2(fd, target)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.chdir(request["cwd"])  # before the uid changes, as subprocess's cwd= is
    if request["user"] is not None:  # what `setpriv --reuid=U --regid=U --clear-groups` gives an exec'd command
        uid = request["user"]
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        # A change of uid clears the process's dumpable flag, which an exec would set again: without it
        # /proc/self/fd is root's, and the launcher opens files through it.
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) != 0:
            os._exit(121)
    tempfile.tempdir = None  # found again from this command's environment
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [request["module"], *request["args"]]
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    # What the interpreter's exit does that a command can see: non-daemon threads joined, atexit
    # callbacks run, streams flushed. Tearing down the server's many modules (a tenth of a second)
    # is skipped: no command sees it.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 120  # as the interpreter does when flushing stdout fails at exit
    os._exit(code)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


class Client:
    """One server per test process, started at its first use."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.path: str | None = None
        self.python_env: dict[str, str] = {}

    def usable(self, env: dict[str, str], user: str | None) -> bool:
        if os.environ.get("DISKKIT_TESTS_EXEC"):  # every run a new interpreter, to compare
            return False
        started_with = self.python_env if self.proc is not None else _python_env(os.environ)
        return _python_env(env) == started_with and (user is None or user.isdigit())

    def start(self) -> None:
        directory = tempfile.mkdtemp(prefix="dkcli")
        self.path = os.path.join(directory, "s")
        self.python_env = _python_env(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from tests.cliserver import serve; serve({self.path!r})"],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
        )
        if self.proc.stdout.readline() != "ready\n":
            raise RuntimeError("the CLI fork server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc.stdout.close()
            os.unlink(self.path)
            os.rmdir(os.path.dirname(self.path))
            self.proc = None

    def run(self, module: str, args: list[str], cwd, env: dict[str, str], timeout: float | None,
            user: str | None = None) -> tuple[int, str, str]:
        """As subprocess.run([python, -m, module, *args], capture_output=True, text=True, ...), as the
        numeric `user` (uid and gid, no supplementary groups) when given."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            request = {"module": module, "args": args, "cwd": str(cwd or os.getcwd()), "env": env,
                       "user": None if user is None else int(user)}
            socket.send_fds(conn, [json.dumps(request).encode()], [0, out_w, err_w])
        finally:
            os.close(out_w)
            os.close(err_w)
        return self._collect(conn, out_r, err_r, args, timeout)

    def _collect(self, conn, out_r: int, err_r: int, args, timeout: float | None) -> tuple[int, str, str]:
        deadline = None if timeout is None else time.monotonic() + timeout
        told = conn.fileno()
        chunks = {out_r: [], err_r: [], told: []}
        selector = selectors.DefaultSelector()
        for fd in chunks:
            selector.register(fd, selectors.EVENT_READ)
        pid = None
        try:
            while selector.get_map():
                wait = None if deadline is None else deadline - time.monotonic()
                if wait is not None and wait <= 0:
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL)
                    raise subprocess.TimeoutExpired(args, timeout)
                for key, _ in selector.select(wait):
                    data = os.read(key.fd, 1 << 16)
                    if data:
                        chunks[key.fd].append(data)
                    else:
                        selector.unregister(key.fd)
                    if key.fd == told and pid is None and b"\n" in b"".join(chunks[told]):
                        pid = int(b"".join(chunks[told]).split(b"\n")[0])
        finally:
            selector.close()
            conn.close()
            os.close(out_r)
            os.close(err_r)
        lines = b"".join(chunks[told]).split(b"\n")
        if len(lines) < 3:
            raise RuntimeError(f"the CLI fork server lost the command {args}")
        return int(lines[1]), _text(b"".join(chunks[out_r])), _text(b"".join(chunks[err_r]))


def _python_env(env) -> dict[str, str]:
    """What an interpreter reads from its environment as it starts: its options, and the locale its
    streams' encoding comes from."""
    return {k: v for k, v in env.items() if k.startswith(("PYTHON", "LC_")) or k == "LANG"}


def _text(data: bytes) -> str:
    # What subprocess's text mode gives: the locale's encoding, universal newlines.
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


CLIENT = Client()

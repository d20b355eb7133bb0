"""Find the node's disk server or start one: what `launcher run --lazy` does first, so kept light.

The server is started detached (its own session, exiting when idle) so it outlives the run that
started it and serves every later VM on the node. This module imports no registry or image code: a
run starts the server before importing its own, and the two interpreters' start-ups overlap.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

from diskkit.errors import DiskkitError
from diskkit.registry.options import RegistryOptions
from launcher.diskserver.control import CONTROL_SOCKET, request, serve_dir, socket_path
from launcher.node.cache import Cache
from launcher.node.selfexec import launcher_argv

START_TIMEOUT = 30.0
FETCH_TIMEOUT = 30.0  # a spawned server's reads fail after this: the VM pauses and its launcher resumes it


def _registry_flags(opts: RegistryOptions) -> list[str]:
    flags = [f"--retry-times={opts.retries}", f"--retry-delay={opts.backoff}"]
    if opts.tls_verify is not None:  # unset stays unset: registries.conf decides in the server too
        flags.append(f"--tls-verify={'true' if opts.tls_verify else 'false'}")
    if opts.cert_dir:
        flags.append(f"--cert-dir={opts.cert_dir}")
    if opts.authfile:
        flags.append(f"--authfile={opts.authfile}")
    if opts.signature_policy:
        flags.append(f"--signature-policy={opts.signature_policy}")
    if opts.registries_d:
        flags.append(f"--registries.d={opts.registries_d}")
    flags += [f"--require-boot-test-key={key}" for key in opts.boot_test_keys]
    flags += [f"--require-boot-test-gpg-key={key}" for key in opts.boot_test_gpg_keys]
    return flags  # credentials travel with each request, never on a command line


# Servers this process started and has not yet seen answer, each with the cache's start lock held
# until it does: `ensure_server` waits for one of these rather than starting another, and so do
# other launchers (the lock), as another server would only find the cache taken after costing an
# interpreter's start on a node busy starting VMs.
_starting: dict[Path, tuple[subprocess.Popen, contextlib.ExitStack]] = {}
START_LOCK = "disk-server-start"


def _answers(control: Path) -> bool:
    with contextlib.suppress(OSError, ValueError):
        return bool(request(control, {"op": "status"}, timeout=5).get("ok"))
    return False


def _started(root: Path) -> None:
    """Our server answers, or will never: the lock is for the next launcher that needs one."""
    _, held = _starting.pop(root)
    held.close()


def start_server(cache: Cache, registry: RegistryOptions | None = None, idle: float = 30.0) -> subprocess.Popen | None:
    """Start the node's server (detached, exiting when idle) if none answers, without waiting for it:
    a run that knows it will boot lazily starts it first, and the server's own start (an interpreter,
    its imports) then overlaps the run's preparation instead of adding to it. The child starting, or
    None when a server answers already or another launcher is starting one."""
    directory = serve_dir(cache)
    if cache.root in _starting:
        return _starting[cache.root][0]
    control = socket_path(directory, CONTROL_SOCKET)
    if _answers(control):
        return None
    held = contextlib.ExitStack()
    try:
        free = held.enter_context(cache.lock_if_free(START_LOCK))
    except OSError:
        free = True  # a cache we cannot lock in (another user's): the server's own lock still decides
    if not free:
        held.close()
        return None  # another launcher is starting one: `ensure_server` waits for it to answer
    if _answers(control):  # it came up while we took the lock
        held.close()
        return None
    directory.mkdir(parents=True, exist_ok=True)
    command = [*launcher_argv(), "serve", "--cache-dir", str(cache.root), "--exit-when-idle", str(idle),
               "--fetch-timeout", str(FETCH_TIMEOUT),
               *_registry_flags(registry or RegistryOptions())]
    with _log_file(directory) as logfile:
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=logfile, stderr=logfile,
                                 start_new_session=True, env={**os.environ, "CI": "true"})
    _starting[cache.root] = (child, held)
    return child


def _log_file(directory: Path):
    """serve/server.log, for appending: the server's own user's alone (0600). It names the images and
    registries the node's users opened and why they failed; a root cache's serve/ is open for the
    sockets in it, so the file's mode is what keeps it private (one an older launcher made is closed
    too). Never through a link."""
    fd = os.open(directory / "server.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise


def ensure_server(cache: Cache, registry: RegistryOptions | None = None, idle: float = 30.0) -> Path:
    """The control socket of the node's server; one is started (detached, exiting when idle) if none
    answers and no other launcher is starting one."""
    directory = serve_dir(cache)
    control = socket_path(directory, CONTROL_SOCKET)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if cache.root not in _starting and _answers(control):
            return control
        child = start_server(cache, registry, idle)
        if child is not None and _answers(control):
            _started(cache.root)
            return control
        if child is not None and child.poll() is not None and child.returncode != 0:
            _started(cache.root)
            # A server started otherwise (`launcher serve`) may hold the cache and answer shortly.
            time.sleep(0.5)
            if _answers(control):
                return control
            tail = (directory / "server.log").read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
            raise DiskkitError(directory, f"the disk server did not start: {tail[0]}")
        time.sleep(0.02)  # a VM is waiting on this: poll often, the server takes a fraction of a second
    if cache.root in _starting:
        child, _ = _starting[cache.root]
        _started(cache.root)
        child.send_signal(signal.SIGTERM)
    raise DiskkitError(directory, f"the disk server did not answer within {START_TIMEOUT:g} s")

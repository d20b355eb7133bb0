"""Hook sidecar scripts run as KubeVirt's sidecar-shim runs them, as the VM's unprivileged user.

The shim (cmd/sidecars/sidecar_shim.go) runs `onDefineDomain --vmi JSON --domain XML` and hands its
standard output back as the domain; virt-launcher waits a minute for each call (pkg/hooks/manager.go,
context.WithTimeout(time.Minute)) and gRPC takes an answer of 4 MiB at most (grpc-go's default
receive limit). The script comes from a ConfigMap, so it is anyone's code:
- it runs as the VM's own uid, never root (a root launcher's VM uid, launcher.runtime.vmuser, or the
  qemu user of the daemon a --connect named), or as the unprivileged launcher's user; with no
  capabilities and no_new_privs, in a pid namespace of its own (it and all it started end together:
  nothing outlives the call) and a mount namespace whose /tmp, /var/tmp and /dev/shm are small tmpfs
  of its own, as its container's would be (nothing it writes there outlives it either);
- a minute at most, 4 MiB of answer at most (more ends it), 1 GiB of address space, and the last
  lines of its standard error are what a failure shows;
- what it answers is judged by launcher.render.hookcheck (nothing of the host the launcher did not give
  the VM) and by libvirt's schema (virt-xml-validate), before anything of the VM runs.
"""

from __future__ import annotations

import fcntl
import json
import os
import selectors
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

from diskkit.errors import DiskkitError
from launcher.render import hookcheck
from launcher.spec.hooks import ON_DEFINE_DOMAIN, Hook, vmi_document
from launcher.spec.k8s import Objects
from launcher.spec.vmi import VMI
from launcher.volumes.configdisks import configmap_files

TIMEOUT = 60.0  # pkg/hooks/manager.go: each callback's context
ANSWER_MAX = 4 << 20  # grpc-go's default largest message a client receives
STDERR_KEPT = 2048
ADDRESS_SPACE = 1 << 30
TMP_SIZE = "16m"
ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
# Run by root (or the namespace's root) in the new namespaces, before it becomes the hook's user.
_PRIVATE_TMP = " && ".join(f"mount -t tmpfs -o mode=1777,size={TMP_SIZE},nosuid,nodev tmpfs {d}" for d in ("/tmp", "/var/tmp", "/dev/shm")) + ' && cd /tmp && exec "$@"'


class HookFailed(DiskkitError):
    """A hook that failed, hung, flooded, or answered what may not run."""


def _script_fd(script: bytes, name: str) -> int:
    """The script as a sealed memory file: nothing on disk, nobody can change it once the hook runs."""
    fd = os.memfd_create(name, os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(script)
        while view:
            view = view[os.write(fd, view):]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
        os.fchmod(fd, 0o555)
    except BaseException:
        os.close(fd)
        raise
    os.set_inheritable(fd, True)
    return fd


def command(fd: int, args: list[str], ids: tuple[int, int] | None) -> list[str]:
    """The hook's command line: `ids` is the host uid and gid it runs as (root's launcher), None for the
    unprivileged launcher's own user (mapped to itself in a user namespace of its own)."""
    namespaces = ["prlimit", f"--as={ADDRESS_SPACE}", "--core=0", "--", "unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
    if ids is None:
        namespaces.insert(namespaces.index("unshare") + 1, "--map-root-user")
        become = ["unshare", f"--map-user={os.getuid()}", f"--map-group={os.getgid()}", "--"]
    else:
        if 0 in ids:
            raise HookFailed("hook sidecars", "would run as root: a hook runs as the VM's own uid only")
        become = ["setpriv", f"--reuid={ids[0]}", f"--regid={ids[1]}", "--clear-groups", "--no-new-privs",
                  "--inh-caps=-all", "--bounding-set=-all", "--"]
    return [*namespaces, "--", "/bin/sh", "-c", _PRIVATE_TMP, "sh", *become, f"/proc/self/fd/{fd}", *args]


def _end(proc: subprocess.Popen) -> None:
    """The pid namespace goes with its first process; unshare's own end does not take it (the
    credentials' change cleared the parent-death signal), so that process is ended by its pid.
    prlimit execs unshare: the Popen's pid is unshare's."""
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:
        children = []
    for pid in children:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    # unshare reaps that process, which ends only once every other process of its namespace has: then
    # nothing of the hook is left. unshare itself is only killed if it does not end.
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_script(script: bytes, name: str, args: list[str], ids: tuple[int, int] | None, where: str,
               timeout: float = TIMEOUT, limit: int = ANSWER_MAX) -> bytes:
    """The script's standard output, once it has ended with status 0 within `timeout` and `limit`."""
    fd = _script_fd(script, name)
    try:
        try:
            proc = subprocess.Popen(command(fd, args, ids), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, pass_fds=(fd,), env=ENV, cwd="/")
        except OSError as exc:
            raise HookFailed(where, f"cannot run the {name} hook: {exc.strerror}") from None
    finally:
        os.close(fd)
    out, err = bytearray(), bytearray()
    deadline = time.monotonic() + timeout
    failure = None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while sel.get_map() and failure is None:
            left = deadline - time.monotonic()
            if left <= 0:
                failure = f"did not answer within {timeout:g} s (KubeVirt's limit for a hook call)"
                break
            for key, _ in sel.select(left):
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
                if key.data is err and len(err) > STDERR_KEPT:
                    del err[:-STDERR_KEPT]
                if len(out) > limit:
                    failure = f"answered more than {limit >> 20} MiB (a hook's answer is one gRPC message)"
                    break
    if failure is not None:
        _end(proc)
    else:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            failure = f"did not end within {timeout:g} s (KubeVirt's limit for a hook call)"
            _end(proc)
    proc.stdout.close()
    proc.stderr.close()
    said = " ".join(err.decode("utf-8", "replace").split())[-400:]
    if failure is None and proc.returncode != 0:
        failure = f"exited with status {proc.returncode}"
    if failure is not None:
        raise HookFailed(where, f"the {name} hook {failure}" + (f"; it said: {said}" if said else ""))
    return bytes(out)


def _script(objects: Objects | None, namespace: str, hook: Hook) -> bytes:
    if objects is None:
        raise HookFailed(f"{hook.where}.configMap", f"ConfigMap {hook.config_map}: give --manifests DIR holding it")
    doc = objects.get("ConfigMap", namespace, hook.config_map)
    if doc is None:
        raise HookFailed(f"{hook.where}.configMap", f'configmaps "{hook.config_map}" not found in namespace {namespace}')
    files = configmap_files(doc)
    if hook.key not in files:
        raise HookFailed(f"{hook.where}.configMap.key", f"ConfigMap {namespace}/{hook.config_map} has no key {hook.key}")
    return files[hook.key]


def validate(xml: str, where: str) -> None:
    """libvirt's own schema, as virt-xml-validate holds it."""
    try:
        done = subprocess.run(["virt-xml-validate", "-", "domain"], input=xml.encode(), capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HookFailed(where, f"cannot check the hook's domain with virt-xml-validate: {exc}") from None
    if done.returncode != 0:
        lines = [line for line in done.stderr.decode("utf-8", "replace").splitlines() if "validity error" in line or "error" in line]
        first = lines[0].split(":", 2)[-1].strip() if lines else "fails to validate"
        raise HookFailed(where, f"the onDefineDomain hook's domain is not one libvirt's schema accepts: {first}")


def on_define_domain(hooks: tuple[Hook, ...], vmi: VMI, xml: str, objects: Objects | None, ids: tuple[int, int] | None,
                     say: Callable[[str], None]) -> str:
    """The domain after each onDefineDomain hook in turn (each gets the previous one's), each answer checked."""
    document = json.dumps(vmi_document(vmi.name, vmi.namespace, vmi.uid, vmi.labels, vmi.annotations, vmi.spec_document),
                          separators=(",", ":"))
    for hook in hooks:
        if hook.point != ON_DEFINE_DOMAIN:
            continue
        script = _script(objects, vmi.namespace, hook)
        answer = run_script(script, ON_DEFINE_DOMAIN, ["--vmi", document, "--domain", xml], ids, hook.where)
        try:
            hooked = answer.decode("utf-8")
        except UnicodeDecodeError:
            raise HookFailed(hook.where, "the onDefineDomain hook's answer is not UTF-8") from None
        try:
            hookcheck.check(xml, hooked)
        except hookcheck.HookRefused as exc:
            raise HookFailed(hook.where, f"the onDefineDomain hook's domain {exc}") from None
        validate(hooked, hook.where)
        say(f"the onDefineDomain hook of ConfigMap {hook.config_map} ({hook.key}) changed the domain" if hooked.strip() != xml.strip()
            else f"the onDefineDomain hook of ConfigMap {hook.config_map} ({hook.key}) left the domain as it was")
        xml = hooked
    return xml

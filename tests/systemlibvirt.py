"""A private libvirt system daemon (`qemu:///system`) as root, leaving the host as it was.

libvirtd runs in a mount namespace of its own (`unshare --mount --propagation private`): its run,
state, cache and log directories and the domain and secret definitions under /etc/libvirt land
in overlays and tmpfs under the test's directory; /etc/libvirt/qemu.conf is replaced by the test's
own (root inside an unprivileged container needs `remember_owner = 0` and `cgroup_controllers = [ ]`;
`namespaces = [ ]` keeps qemu in the daemon's /dev, where an unusable /dev/kvm is hidden).
Only the qemu and secret drivers are loaded (LIBVIRT_DRIVER_DIR): no network, nwfilter or storage
driver, so nothing looks at bridges or firewall rules. Commands under test join the namespace
through `nsenter --mount=/proc/PID/ns/mnt`, and see the same sockets and qemu.conf as libvirtd.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Result, launcher_command
from tests.procs import terminate

DRIVERS = Path("/usr/lib/x86_64-linux-gnu/libvirt/connection-driver")
QEMU_CONF = """\
remember_owner = 0
cgroup_controllers = [ ]
namespaces = [ ]
"""
# Written over with an empty tmpfs in the namespace: they exist on the host.
PRIVATE_DIRS = ("/var/lib/libvirt", "/var/cache/libvirt", "/var/log/libvirt", "/etc/libvirt/qemu")
# Seen through an overlay: /run has no libvirt/ to mount over, and /etc/libvirt gets secrets/ written.
OVERLAID = ("/run", "/etc/libvirt")

NAMESPACE_SH = """\
set -e
S="$1"
for lower in {overlaid}; do
  d="$S/overlay$lower"; mkdir -p "$d/up" "$d/work"
  mount -t overlay overlay -o "lowerdir=$lower,upperdir=$d/up,workdir=$d/work" "$lower"
done
for d in {private}; do mount -t tmpfs -o mode=0755 tmpfs "$d"; done
mount --bind "$S/qemu.conf" /etc/libvirt/qemu.conf
# A /dev/kvm that qemu.conf's user cannot open (0600 root here) makes libvirt probe qemu's capabilities
# over and over ("KVM was enabled when probing ..., but it is not available now"): 90 s before the first
# domain defines. An empty file in its place is a host without KVM, which is what this daemon's qemu has.
if [ -e /dev/kvm ] && ! setpriv --reuid=libvirt-qemu --regid=libvirt-qemu --init-groups test -r /dev/kvm -a -w /dev/kvm; then
  : > "$S/no-kvm"; mount --bind "$S/no-kvm" /dev/kvm
fi
export LIBVIRT_DRIVER_DIR="$S/drivers"
virtlogd -d -p "$S/virtlogd.pid"  # systemd would start it on the first connection to its socket
exec libvirtd -f "$S/libvirtd.conf" -p "$S/libvirtd.pid"
"""


class SystemLibvirt:
    """The daemon's process (whose mount namespace commands join) and its scratch directory."""

    def __init__(self, root: Path, proc: subprocess.Popen):
        self.root = root
        self.proc = proc

    @property
    def log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in (self.root / "libvirtd.out", self.root / "libvirtd.log") if p.exists())

    def command(self, *cmd: str | os.PathLike) -> list[str]:
        # Joining a mount namespace moves to its root: --wd keeps this checkout the one `-m launcher` imports.
        return ["nsenter", f"--mount=/proc/{self.proc.pid}/ns/mnt", f"--wd={os.getcwd()}", "--", *map(str, cmd)]

    def launcher_command(self, *args: str | os.PathLike) -> list[str]:
        return self.command(*launcher_command(*args))

    def launcher(self, *args: str | os.PathLike, env: dict, timeout: float = 600) -> Result:
        proc = subprocess.run(self.launcher_command(*args), capture_output=True, text=True, check=False,
                              env={**os.environ, "CI": "true", **env}, timeout=timeout)
        return Result(proc.returncode, proc.stdout, proc.stderr)

    def virsh(self, *args: str) -> str:
        proc = subprocess.run(self.command("virsh", "-c", "qemu:///system", *args), capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, f"virsh {' '.join(args)}: {proc.stderr}\n{self.log}"
        return proc.stdout

    def domains(self) -> list[str]:
        return self.virsh("list", "--all", "--name").split()


def _answers(daemon: SystemLibvirt) -> bool:
    sock = Path(f"/proc/{daemon.proc.pid}/root/run/libvirt/libvirt-sock")  # the socket as the namespace sees it
    if not sock.exists():
        return False
    probe = subprocess.run(daemon.command("virsh", "-c", "qemu:///system", "uri"), capture_output=True, text=True, timeout=60, check=False)
    return probe.returncode == 0


@contextlib.contextmanager
def system_libvirtd() -> Iterator[SystemLibvirt]:
    """Start the private daemon; fail the test (never skip) if it does not answer within a minute."""
    if os.geteuid() != 0:
        pytest.fail("a system libvirtd needs root")
    for tool in ("libvirtd", "virtlogd", "unshare", "nsenter", "setpriv", "virsh"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing (scripts/setup.sh installs it)")
    for driver in ("qemu", "secret"):
        if not (DRIVERS / f"libvirt_driver_{driver}.so").exists():
            pytest.fail(f"{DRIVERS}/libvirt_driver_{driver}.so is missing (libvirt-daemon-system installs it)")
    root = Path(tempfile.mkdtemp(prefix="diskkit-syslibvirt-"))
    root.chmod(0o755)
    (root / "qemu.conf").write_text(QEMU_CONF)
    (root / "libvirtd.conf").write_text(f'log_outputs = "3:file:{root}/libvirtd.log"\n')
    (root / "drivers").mkdir()
    for driver in ("qemu", "secret"):
        (root / "drivers" / f"libvirt_driver_{driver}.so").symlink_to(DRIVERS / f"libvirt_driver_{driver}.so")
    script = NAMESPACE_SH.format(overlaid=" ".join(OVERLAID), private=" ".join(PRIVATE_DIRS))
    with open(root / "libvirtd.out", "wb") as out:
        proc = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script, "sh", str(root)],
                                stdout=out, stderr=out, start_new_session=True)
    daemon = SystemLibvirt(root, proc)
    try:
        deadline = time.monotonic() + 60
        while not _answers(daemon):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the private system libvirtd did not start (exit {proc.poll()}):\n{daemon.log}")
            time.sleep(0.3)
        yield daemon
    finally:
        try:
            names: list[str] = []
            if proc.poll() is None:
                # qemu outlives libvirtd: end every domain of this namespace (no other is in it) first.
                with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
                    names = daemon.domains()  # none if the daemon never answered
                for name in names:
                    subprocess.run(daemon.command("virsh", "-c", "qemu:///system", "destroy", name), capture_output=True, timeout=120, check=False)
                terminate(proc)
        finally:
            with contextlib.suppress(OSError, ValueError):
                os.kill(int((root / "virtlogd.pid").read_text()), signal.SIGTERM)
            shutil.rmtree(root, ignore_errors=True)


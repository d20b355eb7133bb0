"""A network namespace of the test's own, as root: bridges, taps and DHCP servers a test makes live
there and go with it, never on the host's network. A holder process keeps the namespace; commands join
it with `nsenter --net`. The launcher reads devices through `ip`, so no sysfs of the namespace is needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests import procs

ROOT = Path(__file__).resolve().parent.parent


def tun_node(mode: int) -> list[str]:
    """A command prefix: the rest runs in a mount namespace of its own whose /dev/net/tun has `mode`.
    Hosts give it 0666 (udev's default; KubeVirt's pod gets it from its device plugin), which grants
    nothing but the taps one owns; some containers, this suite's machines among them, 0600."""
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
            f'mount -t tmpfs -o mode=755 tmpfs /dev/net && mknod -m {mode:o} /dev/net/tun c 10 200 && exec "$@"', "sh"]


class NetNS:
    def __init__(self):
        assert os.geteuid() == 0, "a network namespace of the test's own needs root"
        self.holder = subprocess.Popen(["unshare", "--net", "--", "sh", "-c", "ip link set lo up && echo up && exec sleep 3600"],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert self.holder.stdout.readline().strip() == "up", self.holder.stderr.read()
        self.children: list[subprocess.Popen] = []

    @property
    def enter(self) -> list[str]:
        return ["nsenter", f"--net=/proc/{self.holder.pid}/ns/net", "--"]

    def run(self, *cmd, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        done = subprocess.run([*self.enter, *map(str, cmd)], capture_output=True, text=True, **kwargs)
        assert not check or done.returncode == 0, (cmd, done.stderr)
        return done

    def start(self, *cmd, **kwargs) -> subprocess.Popen:
        """A process in the namespace that the namespace's end ends too (a server on its bridge)."""
        proc = subprocess.Popen([*self.enter, *map(str, cmd)], stdin=subprocess.DEVNULL, **kwargs)
        self.children.append(proc)
        return proc

    def python(self, code: str, *args: str, user: int | None = None, tun_mode: int | None = None) -> subprocess.CompletedProcess:
        """`code` run by this interpreter inside the namespace (as `user`, with no groups, when given;
        Debian's python for a user, who may not read the venv); with `tun_mode`, in a mount namespace
        whose /dev/net/tun has that mode (see TUN_FOR_EVERYONE)."""
        become = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", "--"] if user is not None else []
        tun = tun_node(tun_mode) if tun_mode is not None else []
        python = "/usr/bin/python3" if user is not None else sys.executable
        return self.run(*tun, *become, python, "-c", code, *args, check=False, cwd=ROOT)

    def links(self) -> dict[str, dict]:
        """name -> `ip -d -j` view of every device in the namespace."""
        return {link["ifname"]: link for link in json.loads(self.run("ip", "-d", "-j", "link", "show").stdout)}

    def close(self) -> None:
        for proc in self.children:
            procs.terminate(proc, 10)
        self.holder.kill()
        self.holder.wait()

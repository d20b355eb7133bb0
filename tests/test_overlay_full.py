"""A cache on a full filesystem once the VM runs (issue: the node under faults and at scale, item 6):
the VM's qcow2 overlay cannot grow. KubeVirt renders every disk with error_policy="stop" (the
converter's storage/configurator.go setErrorPolicy, errorPolicy's default), so qemu pauses the guest
on the failed write (libvirt's PAUSED_IOERROR, its disk error NO_SPACE) and loses nothing. `launcher
status` says so in one line naming the disk and its file; once space is freed the VM goes on, and
`launcher stop` of a paused VM cleans everything. Also the filesystem full while the overlay is made:
the run fails in one line, nothing left.

The filesystem is a small tmpfs in a private mount namespace held by a process of the test's own;
every command (the launcher, and through it the qemu user's libvirt session daemon and qemu) runs
in that namespace, and the test reads its files through /proc/PID/root, so the host sees nothing."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pwd
import subprocess
from pathlib import Path
from typing import Iterator

from launcher.runtime.iopause import describe
from tests import leftovers
from tests.conftest import Result, launcher_command
from tests.lazyhost import wait_for
from tests.procs import terminate
from tests.vmhost import NOREG, QEMU_UID, QemuUser, qemu_scratch

NAME = "full"
DOMAIN = f"default_{NAME}"


class Namespaced(QemuUser):
    """The qemu user with its cache on a tmpfs of `size` that only a private mount namespace has."""

    def __init__(self, root: Path, size: str):
        super().__init__(root)
        small = root / "small"
        small.mkdir()
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f"mount -t tmpfs -o size={size},mode=0755 tmpfs {small} && echo up && exec sleep 100000"],
            stdout=subprocess.PIPE, text=True)
        assert self.holder.stdout.readline().strip() == "up", "the tmpfs was not mounted"
        self.cache = small / "cache"
        self.seen(self.cache).mkdir()
        os.chown(self.seen(self.cache), QEMU_UID, pwd.getpwuid(QEMU_UID).pw_gid)
        self.env = {**self.env, "DISKKIT_CACHE": str(self.cache)}
        # --wd: joining a mount namespace moves to its root; this checkout stays the one `-m launcher` imports.
        self.enter = ["nsenter", f"--mount=/proc/{self.holder.pid}/ns/mnt", f"--wd={os.getcwd()}", "--"]

    def seen(self, path: Path) -> Path:
        """`path` as the namespace sees it."""
        return Path(f"/proc/{self.holder.pid}/root") / path.relative_to("/")

    def launcher(self, *args, timeout: float = 300) -> Result:
        done = subprocess.run([*self.enter, *launcher_command(*args, user=str(QEMU_UID))], env={**os.environ, "CI": "true", **self.env},
                              capture_output=True, text=True, timeout=timeout)
        return Result(done.returncode, done.stdout, done.stderr)

    def popen(self, *args) -> subprocess.Popen:
        return subprocess.Popen([*self.enter, *launcher_command(*args, user=str(QEMU_UID))], env={**os.environ, "CI": "true", **self.env},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def virsh(self, *args) -> str:
        cmd = [*self.enter, "setpriv", f"--reuid={QEMU_UID}", f"--regid={QEMU_UID}", "--clear-groups", "virsh", "-c", "qemu:///session", *args]
        return subprocess.run(cmd, env={**os.environ, **self.env}, capture_output=True, text=True, check=True).stdout

    def fill(self, leave: int) -> Path:
        """A file that leaves `leave` bytes free on the tmpfs (root's: the qemu user cannot remove it)."""
        filler = self.seen(self.cache.parent) / "filler"
        with open(filler, "wb") as f:  # emptied first: what it held is free again
            # A running VM's writes may take some of the space between the count and the allocation;
            # a failed allocation is undone, so it is counted again and asked again.
            for _ in range(50):
                st = os.statvfs(self.seen(self.cache))
                want = st.f_bavail * st.f_frsize - leave
                if want <= 0:
                    break  # no more than `leave` is free already
                try:
                    os.posix_fallocate(f.fileno(), 0, want)
                    break
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
            else:
                raise AssertionError(f"{filler}: could not leave {leave} bytes free")
        return filler

    def close(self) -> None:
        leftovers.end_processes_of(self.root)  # the session daemon and qemu in the namespace
        terminate(self.holder)


@contextlib.contextmanager
def namespaced(size: str) -> Iterator[Namespaced]:
    with qemu_scratch("e2e-full-") as root:
        user = Namespaced(root, size)
        try:
            yield user
        finally:
            user.close()


def files_of_run(user: Namespaced) -> list[str]:
    """What a run leaves in the cache: its run directory (overlays, console log), its record."""
    cache = user.seen(user.cache)
    return sorted(str(p.relative_to(cache)) for where in ("run", "vms") for p in (cache / where).rglob("*"))


def last_sector(user: Namespaced, overlay: Path) -> str:
    """The ASCII column (a space shown as a dot) of `qemu-io`'s dump of the last sector, read in the namespace through
the overlay (shared: qemu holds it) and its base."""
    image = ["-U", "-f", "qcow2", str(overlay)]
    info = subprocess.run([*user.enter, "qemu-img", "info", "--output=json", *image], capture_output=True, text=True, check=True)
    size = json.loads(info.stdout)["virtual-size"]
    dump = subprocess.run([*user.enter, "qemu-io", "-r", *image[:-1], "-c", f"read -v {size - 512} 512", image[-1]], capture_output=True, text=True)
    return "".join(line.rsplit("  ", 1)[-1] for line in dump.stdout.splitlines() if ":" in line)


def test_a_vm_whose_overlay_cannot_grow_pauses_is_said_so_and_goes_on_once_space_is_freed(guest_image):
    with namespaced("64m") as user:
        assert user.launcher("pull", NOREG, guest_image).code == 0
        vmi = user.write_vmi(NAME, guest_image, serial="hold-600")
        # The run's overlay (a few hundred KiB) and files fit; the guest's first write to the disk
        # (its stamp in the last sector: an L2 table and a data cluster, 128 KiB) does not.
        user.fill(leave=640 << 10)
        proc = user.popen("run", NOREG, "--no-lazy", "--console", vmi)
        try:
            overlay = wait_for(lambda: proc.poll() is None and list(user.seen(user.cache / "run" / DOMAIN / "root").glob("*.qcow2")),
                               120, "the overlay")[0]
            user.fill(leave=0)  # whatever the run wrote meanwhile: now nothing is left
            status = wait_for(lambda: (s := user.launcher("status", NAME)).out.startswith("paused") and s, 180, "the VM to pause")
            real = Path("/") / overlay.relative_to(user.seen(Path("/")))
            assert status.code == 1
            assert status.out.strip() == f"paused (PausedIOError): vda: no space left on device ({real})", status
            assert "I/O error" in user.virsh("domstate", "--reason", DOMAIN)
            listed = user.launcher("ls").out
            assert DOMAIN in listed and "paused" in listed, listed
            # Nothing of the guest's is lost meanwhile: it waits, however long the admin takes.
            assert proc.poll() is None
            user.seen(user.cache.parent / "filler").unlink()
            wait_for(lambda: user.launcher("status", NAME).out.strip() == "running", 120, "the VM to go on")
            # The write that waited landed: the guest's stamp in the disk's last sector, read from the
            # overlay qemu holds (the console's log is on the same full filesystem: its lines from
            # then are lost, the disk's are not).
            wait_for(lambda: "DKSTAMP.1" in last_sector(user, real), 120, "the guest's stamp in the overlay")
            stopped = user.launcher("stop", NAME)
            assert stopped.code == 0 and stopped.out.strip() == f"VM {NAME} was stopped", stopped
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        notes = [line for line in err.splitlines() if "want of space" in line]
        assert notes == [f"launcher: note: the VM paused for want of space: vda: no space left on device ({real}); it goes on once space is "
                         f"freed there (or stop it: launcher stop {DOMAIN})"], err
        assert "kept pausing" not in err
        assert files_of_run(user) == [], files_of_run(user)
        assert DOMAIN not in user.virsh("list", "--all", "--name").split()


def start_detached_with_room_to_boot(user, guest_image) -> None:
    """A --detach VM on the small filesystem, filled but for what its boot writes."""
    assert user.launcher("pull", NOREG, guest_image).code == 0
    vmi = user.write_vmi(NAME, guest_image, serial="hold-600")
    user.fill(leave=640 << 10)
    started = user.launcher("run", NOREG, "--no-lazy", "--detach", vmi)
    assert started.code == 0, started.err


def test_a_vm_paused_for_want_of_space_is_stopped_clean(guest_image):
    with namespaced("64m") as user:
        start_detached_with_room_to_boot(user, guest_image)
        user.fill(leave=0)
        wait_for(lambda: user.launcher("status", NAME).out.startswith("paused (PausedIOError): vda: no space left on device ("), 180, "the VM to pause")
        # A paused guest cannot answer the power button: without --force the whole grace period would pass first.
        stopped = user.launcher("stop", "--force", "--grace-period=0", NAME)
        assert stopped.code == 0 and stopped.out.strip() == f"VM {NAME} was stopped", stopped
        assert user.launcher("status", NAME).code != 0
        assert files_of_run(user) == [], files_of_run(user)
        assert DOMAIN not in user.virsh("list", "--all", "--name").split()


def test_a_detached_vm_paused_for_want_of_space_goes_on_at_launcher_unpause_once_space_is_freed(guest_image):
    """No launcher follows a --detach VM to resume it: `launcher unpause` does, as KubeVirt's unpause
    resumes a VMI an I/O error paused (tests/test_pause.py). While the disk is still full qemu's retry
    of the write pauses it again, and unpause says so."""
    with namespaced("64m") as user:
        start_detached_with_room_to_boot(user, guest_image)
        [overlay] = user.seen(user.cache / "run" / DOMAIN / "root").glob("*.qcow2")
        real = Path("/") / overlay.relative_to(user.seen(Path("/")))
        user.fill(leave=0)
        why = f"vda: no space left on device ({real})"
        wait_for(lambda: user.launcher("status", NAME).out.strip() == f"paused (PausedIOError): {why}", 180, "the VM to pause")
        answer = json.loads(user.launcher("status", "--json", NAME).out)
        assert (answer["state"], answer["reason"], answer["message"]) == ("paused", "PausedIOError", why)
        # Paused already, whoever paused it.
        assert user.launcher("pause", NAME).err.strip() == f"launcher: {NAME}: VMI is already paused"

        still_full = user.launcher("unpause", NAME)
        assert (still_full.code, still_full.out.strip()) == (0, f"VMI {NAME} was unpaused"), still_full.err
        assert still_full.err.strip() == (f"launcher: note: VMI {NAME} paused again at once: {why}; free what it needs, "
                                          "then unpause it again"), still_full.err
        assert user.launcher("status", NAME).out.strip() == f"paused (PausedIOError): {why}"
        assert "DKSTAMP.1" not in last_sector(user, real)

        user.seen(user.cache.parent / "filler").unlink()
        unpaused = user.launcher("unpause", "--json", NAME)
        assert unpaused.code == 0, unpaused.err
        assert json.loads(unpaused.out) == {"name": NAME, "domain": DOMAIN, "unpaused": True, "was": "PausedIOError",
                                            "pausedAgain": None, "message": f"VMI {NAME} was unpaused"}
        assert user.launcher("status", NAME).out.strip() == "running"
        # The write that waited landed: the guest's stamp in the disk's last sector.
        wait_for(lambda: "DKSTAMP.1" in last_sector(user, real), 120, "the guest's stamp in the overlay")
        stopped = user.launcher("stop", NAME)
        assert stopped.code == 0 and stopped.out.strip() == f"VM {NAME} was stopped", stopped
        assert files_of_run(user) == [], files_of_run(user)


def test_a_full_filesystem_while_the_overlay_is_made_fails_the_run_in_one_line(guest_image):
    with namespaced("64m") as user:
        assert user.launcher("pull", NOREG, guest_image).code == 0
        vmi = user.write_vmi(NAME, guest_image)
        user.fill(leave=0)
        result = user.launcher("run", NOREG, "--no-lazy", "--console", vmi)
        assert result.code != 0
        assert len(result.err.strip().splitlines()) == 1, result.err
        assert "No space left on device" in result.err, result.err
        assert files_of_run(user) == [], files_of_run(user)
        assert DOMAIN not in user.virsh("list", "--all", "--name").split()


def test_the_line_that_says_why_a_vm_paused():
    assert describe({"vdb": ("I/O error", None), "vda": ("no space left on device", "/c/run/d/root/disk.qcow2")}) \
        == "vda: no space left on device (/c/run/d/root/disk.qcow2); vdb: I/O error"
    assert describe({}) == "an I/O error libvirt names no disk for"

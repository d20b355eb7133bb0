"""A VM paused by an I/O error (KubeVirt's default errorPolicy stop) is resumed, as its disks may be
back: a lazy containerDisk's reads fail while the registry is away for longer than the disk
server's fetch timeout, and qemu retries the failed request when the VM continues. A VM that keeps
pausing is given up on, within a bound, with the disk server's own reason.

KubeVirt only reports such a pause (a Paused condition for libvirt's PAUSED_IOERROR reason:
pkg/virt-handler/vm.go, api.ReasonPausedIOError); resuming is ours, since a lazy disk's errors
are a registry's outage rather than a broken device.

A pause for want of space (an overlay that cannot grow on a full filesystem) is never given up on:
the guest lost nothing, and what it waits for is an admin freeing space, which may take any time.
It is said once, naming the file, and the VM is resumed now and then (qemu retries the write, and
pauses again while the filesystem is still full) until it runs on or is stopped."""

from __future__ import annotations

import time
from typing import Callable

from diskkit.errors import DiskkitError
from launcher.runtime.runner import NO_SPACE, Libvirt

RESUME_AFTER = (1.0, 2.0, 4.0, 8.0, 15.0, 15.0)  # then it is given up on
PATIENCE = sum(RESUME_AFTER)  # `run --io-error-patience`'s default: the schedule above as it stands
SETTLED = 30.0  # running this long since the last resume: the outage is over, the count starts again
NO_SPACE_RETRY = 5.0  # between resumes of a VM paused for want of space


def describe(errors: dict[str, tuple[str, str | None]]) -> str:
    """One line for the disks that paused a VM: `vda: no space left on device (/run/.../root.qcow2)`."""
    return "; ".join(f"{dev}: {kind}" + (f" ({where})" if where else "") for dev, (kind, where) in sorted(errors.items())) \
        or "an I/O error libvirt names no disk for"


class PauseWatch:
    def __init__(self, lv: Libvirt, name: str, say: Callable[[str], None], reason: Callable[[], str | None] = lambda: None,
                 patience: float = PATIENCE):
        self.lv = lv
        # The same six resumes, spread over `patience` seconds: a registry's maintenance window waited
        # out, or a VM given up on sooner.
        self.resume_after = tuple(delay * patience / PATIENCE for delay in RESUME_AFTER)
        self.name = name
        self.say = say
        self.reason = reason  # what the disk server last failed with, for the final error
        self.resumes = 0
        self.paused_at: float | None = None
        self.resumed_at = 0.0
        self.told_no_space = False

    def running(self) -> bool:
        """For console.follow: True while the domain is up, resuming it when an I/O error paused it."""
        now = time.monotonic()
        errors = self.lv.disk_errors(self.name)
        if errors is None:
            self.paused_at = None
            if now - self.resumed_at >= SETTLED:
                self.resumes = 0
                self.told_no_space = False
            return self.lv.active(self.name)
        disks = ", ".join(sorted(errors)) or "a disk"
        no_space = bool(errors) and all(kind == NO_SPACE for kind, _ in errors.values())
        if no_space:
            if not self.told_no_space:
                self.told_no_space = True
                self.say(f"note: the VM paused for want of space: {describe(errors)}; it goes on once space is freed there"
                         f" (or stop it: launcher stop {self.name})")
            if now - self.resumed_at >= NO_SPACE_RETRY:
                self.resumed_at = now
                self.lv.resume(self.name)
            return True
        if self.paused_at is None:
            self.paused_at = now
            self.say(f"note: the VM paused on an I/O error of {disks}")
        if self.resumes >= len(self.resume_after):
            why = self.reason()
            raise DiskkitError(self.name, f"the VM kept pausing on I/O errors of {disks}" + (f" ({why})" if why else "")
                               + f" after {self.resumes} resumes; the domain was destroyed")
        if now - self.paused_at >= self.resume_after[self.resumes]:
            self.resumes += 1
            self.resumed_at = now
            self.paused_at = None
            self.say(f"note: resuming the VM (attempt {self.resumes} of {len(self.resume_after)})")
            self.lv.resume(self.name)
        return True

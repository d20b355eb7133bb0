"""What KubeVirt says of a paused VMI, and when it refuses to pause or unpause one.

virt-handler turns libvirt's pause reason into the VMI's Paused condition (pkg/virt-handler/vm.go):
a pause by the user (libvirt's PAUSED_USER) is reason PausedByUser, one by a disk's I/O error with
error_policy stop (PAUSED_IOERROR) is PausedIOError; other reasons get no condition. virt-api's
pause and unpause subresources check the VMI before asking virt-launcher (PauseVMIRequestHandler and
UnpauseVMIRequestHandler, pkg/virt-api/rest/lifecycle.go; the messages are subresource.go's): an
unpause of a VMI paused by an I/O error is no refusal, virt-launcher resumes any paused domain
(UnpauseVMI, pkg/virt-launcher/virtwrap/manager.go) and qemu retries the failed request."""

from __future__ import annotations

from dataclasses import dataclass

PAUSED_BY_USER = "PausedByUser"
PAUSED_IO_ERROR = "PausedIOError"
MESSAGES = {PAUSED_BY_USER: "VMI was paused by user", PAUSED_IO_ERROR: "VMI was paused, low-level IO error detected"}


@dataclass(frozen=True)
class Paused:
    """The VMI's Paused condition: its reason, and its message or, for an I/O error, the disks and why."""

    reason: str
    message: str


def paused_condition(paused_by: str | None, disks: str | None = None) -> Paused | None:
    """The condition for libvirt's pause reason (runner.Libvirt.paused_by); `disks`: iopause.describe's line."""
    if paused_by == "user":
        return Paused(PAUSED_BY_USER, MESSAGES[PAUSED_BY_USER])
    if paused_by == "ioerror":
        return Paused(PAUSED_IO_ERROR, disks or MESSAGES[PAUSED_IO_ERROR])
    return None


def pause_refusal(running: bool, condition: Paused | None, liveness_probe: str | None = None) -> str | None:
    """Why virt-api refuses to pause the VMI, in its words; None: it pauses. `running`: the domain is
    active, as a VMI's phase Running (a paused VMI's phase stays Running); `liveness_probe`: the
    handler of the VMI's livenessProbe (a frozen guest fails any but a guest-agent ping, which
    virt-launcher excuses for a user's pause)."""
    if not running:
        return "VM is not running"  # sic: the pause handler uses vmNotRunning, the unpause handler vmiNotRunning
    if liveness_probe not in (None, "guestAgentPing"):
        return "Pausing VMIs with a non-GuestAgentPing LivenessProbe is not supported"
    if condition is not None:
        return "VMI is already paused"
    return None


def unpause_refusal(running: bool, condition: Paused | None) -> str | None:
    """Why virt-api refuses to unpause the VMI, in its words; None: it resumes."""
    if not running:
        return "VMI is not running"
    if condition is None:
        return "VMI is not paused"
    return None

"""How a running VM is ended, whoever ends it: as KubeVirt stops a VMI, the ACPI power button first,
pressed again every few seconds, and the domain destroyed only when the grace period is over.

virt-handler signals a graceful shutdown (virt-launcher's SignalShutdownVMI: libvirt's default
shutdown, the power button, for a running or paused domain), presses again every 5 s while the VMI's
terminationGracePeriodSeconds lasts ("a booting OS can miss ACPI signals"), and kills the domain
(KillVMI) once it is over, or at once when it is 0 (processVmShutdown, hasGracePeriodExpired and
shutdownVMI in pkg/virt-handler/vm.go; pkg/virt-launcher/virtwrap/manager.go). `virtctl stop --force
--grace-period=0` sets that period to 0 first (pkg/virt-api/rest/lifecycle.go).

`launcher stop`, SIGTERM or Ctrl-C of a `launcher run`, gc and the launcher's own failures (which
give no grace period) all end a domain through `shut_down`, so a guest that is given the time to
flush what it wrote never loses it to one path that pulls the plug.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from launcher.runtime.runner import Libvirt

# KubeVirt's default VMI terminationGracePeriodSeconds (staging/src/kubevirt.io/api/core/v1/types.go,
# DefaultGracePeriodSeconds); its launcher pod gets 15 s more (pkg/virt-controller/services/template.go).
DEFAULT_GRACE_PERIOD = 30
# virt-handler presses the power button again every 5 s of the grace period (shutdownVMI).
PRESS_AGAIN = 5
POLL = 0.2  # how often a stop with no console to follow asks libvirt whether the domain still runs

SHUT_DOWN = "shut down"  # the guest powered off after the power button
DESTROYED = "destroyed"  # still running when the grace period ended, or none was given
NOT_RUNNING = "not running"
UNREACHABLE = "unreachable"  # its libvirt daemon could not be reached: only its files were removed


@dataclass(frozen=True)
class Stopped:
    """What ending a domain came to: how (SHUT_DOWN, DESTROYED, NOT_RUNNING, UNREACHABLE), the grace
    period it was given, and how long it took."""

    how: str
    grace: float
    seconds: float = 0.0


def polling(lv: Libvirt, name: str) -> Callable[[float], bool]:
    """A wait for `shut_down` that asks libvirt, for a stop with no console to follow."""

    def wait(seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while lv.active(name):
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(POLL, max(0.0, deadline - time.monotonic())))
        return True

    return wait


def shut_down(lv: Libvirt, name: str, grace: float, wait: Callable[[float], bool] | None = None,
              say: Callable[[str], None] = lambda _: None, drop_tpm_state: bool = False) -> Stopped:
    """End the domain `name`: the power button, up to `grace` seconds for the guest to power off
    (`wait(seconds)` is True once the domain stopped within them), then destroyed and undefined
    (a persistent TPM's state kept unless `drop_tpm_state`). With `grace` 0 it is destroyed at once,
    as KubeVirt kills a VMI whose grace period is 0."""
    if not lv.active(name):
        lv.destroy(name, drop_tpm_state)  # defined and shut off, or already gone: only its definition to forget
        return Stopped(NOT_RUNNING, grace)
    began = time.monotonic()
    if grace <= 0:
        say(f"{name}: destroying it at once (grace period 0)")
        lv.destroy(name, drop_tpm_state)
        return Stopped(DESTROYED, grace)
    if not lv.shutdown(name):
        if not lv.active(name):
            lv.destroy(name, drop_tpm_state)
            return Stopped(NOT_RUNNING, grace)
        say(f"{name}: libvirt could not press its power button; destroying it")
        lv.destroy(name, drop_tpm_state)
        return Stopped(DESTROYED, grace, time.monotonic() - began)
    say(f"{name}: shutting down (up to {grace:g} s)")
    wait = wait or polling(lv, name)
    deadline = began + grace
    while True:
        if wait(min(PRESS_AGAIN, max(0.0, deadline - time.monotonic()))):
            took = time.monotonic() - began
            say(f"{name}: the guest powered off ({took:.0f} s after the power button)")
            lv.destroy(name, drop_tpm_state)
            return Stopped(SHUT_DOWN, grace, took)
        if time.monotonic() >= deadline:
            break
        lv.shutdown(name)
    say(f"{name}: still running after {grace:g} s; destroying it")
    lv.destroy(name, drop_tpm_state)
    return Stopped(DESTROYED, grace, time.monotonic() - began)

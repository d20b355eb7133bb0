"""A clean stop: `launcher stop` (and SIGTERM, Ctrl-C, gc) end a VM as KubeVirt stops a VMI, the ACPI
power button first and the domain destroyed only after the grace period (issue 38, item 8: a file a
guest had just written to its claim was empty after the next boot).

KubeVirt's rules, read in its source: virt-handler presses the button (virt-launcher's SignalShutdownVMI
in pkg/virt-launcher/virtwrap/manager.go, for a running or paused domain), again every 5 s, and kills
the domain once the VMI's terminationGracePeriodSeconds is over, at once when it is 0
(processVmShutdown, hasGracePeriodExpired and shutdownVMI in pkg/virt-handler/vm.go); the period is 30 s
when unset (DefaultGracePeriodSeconds in staging/src/kubevirt.io/api/core/v1/types.go,
gracePeriodInSeconds in pkg/virt-controller/services/template.go); `virtctl stop` takes --force and
--grace-period only together (pkg/virtctl/vm/stop.go), and virt-api sets the VMI's grace period to the
one given (pkg/virt-api/rest/lifecycle.go).

The bookkeeping is checked against libvirt's test driver (`test:///default`: a running domain `test`
that powers off at once when its power button is pressed), the rest with the test guest, whose power
button handler syncs before it powers off (images/testguest/init).
"""

from __future__ import annotations

import json
import os

import pytest

from launcher.node.cache import Cache
from launcher.runtime.runner import Libvirt
from launcher.runtime.stopping import DEFAULT_GRACE_PERIOD, DESTROYED, NOT_RUNNING, SHUT_DOWN, shut_down
from tests.conftest import run_launcher
from tests.testdriver import TEST_URI
from tests.testguest import parse_console
from tests.vmhost import NOREG, QEMU_UID, assert_clean



@pytest.fixture
def test_driver():
    lv = Libvirt(TEST_URI)  # the driver's state lives while a connection to it is open: a fresh `test` each time
    yield lv
    lv.close()


@pytest.mark.parametrize("flags", [["--force"], ["--grace-period", "0"], ["--grace-period=5"]])
def test_force_and_grace_period_only_together_in_virtctls_words(tmp_path, flags):
    result = run_launcher("stop", "--cache-dir", tmp_path / "cache", *flags, "vm")
    assert result.code == 2, result.err
    assert result.err.strip().splitlines()[-1] == "Error: Must both use --force=true and set --grace-period.", result.err


def test_the_power_button_comes_first(test_driver):
    said = []
    stopped = shut_down(test_driver, "test", 30, say=said.append)
    assert stopped.how == SHUT_DOWN and stopped.grace == 30, stopped
    assert said[0] == "test: shutting down (up to 30 s)" and said[1].startswith("test: the guest powered off ("), said
    assert not test_driver.exists("test")  # and its definition forgotten


def test_a_paused_domain_gets_the_power_button_too(test_driver):
    test_driver.suspend("test")
    assert shut_down(test_driver, "test", 30).how == SHUT_DOWN


def test_grace_period_0_destroys_at_once_without_the_power_button(test_driver):
    # Pressed, the test driver's domain would have shut down by itself.
    said = []
    stopped = shut_down(test_driver, "test", 0, say=said.append)
    assert stopped.how == DESTROYED and said == ["test: destroying it at once (grace period 0)"], (stopped, said)
    assert not test_driver.exists("test")


def test_a_domain_that_is_not_running_is_only_undefined(test_driver):
    test_driver.conn.lookupByName("test").destroy()  # shut off, still defined
    assert shut_down(test_driver, "test", 30).how == NOT_RUNNING
    assert not test_driver.exists("test")


def _recorded_on_the_test_driver(cache_dir, grace: int | None) -> None:
    """A VM record as `launcher run` leaves one, for the test driver's running domain."""
    cache = Cache(cache_dir)
    record = {"domain": "test", "vmi": "test", "namespace": "default", "uri": TEST_URI, "run_dir": str(cache.run_dir("test"))}
    if grace is not None:
        record["gracePeriod"] = grace
    cache.write_json(cache.vm_record_path("test"), record)


@pytest.mark.parametrize("recorded, flags, how, grace, said", [
    (7, [], SHUT_DOWN, 7, "test: shutting down (up to 7 s)"),
    (None, [], SHUT_DOWN, 30, "test: shutting down (up to 30 s)"),  # a record of an older run: KubeVirt's default
    (7, ["--force", "--grace-period=0"], DESTROYED, 0, "test: destroying it at once (grace period 0)"),
    (7, ["--force", "--grace-period", "12"], SHUT_DOWN, 12, "test: shutting down (up to 12 s)"),
])
def test_stop_says_how_the_vm_ended_and_with_which_grace_period(tmp_path, recorded, flags, how, grace, said):
    _recorded_on_the_test_driver(tmp_path / "cache", recorded)
    result = run_launcher("stop", "--json", "--cache-dir", tmp_path / "cache", *flags, "test")
    assert result.code == 0, result.err
    [vm] = json.loads(result.out)["vms"]
    assert (vm["stopped"], vm["how"], vm["gracePeriod"], vm["message"]) == (True, how, grace, "VM test was stopped"), vm
    assert said in result.err.splitlines()[0], result.err
    assert not (tmp_path / "cache" / "vms" / "test.json").exists()


def test_a_guests_last_write_to_its_claim_survives_launcher_stop(qemu_user, guest_image):
    """The guest writes to its claim (a PVC's disk.img) just before `launcher stop` and finds it on its next
    boot: the power button let it sync. Before, stop destroyed the domain and the write was lost. The
    second boot's guest ignores the power button: `--force --grace-period 3` destroys it after 3 s."""
    claim = qemu_user.root / "stop-claim"
    claim.mkdir()
    os.chown(claim, QEMU_UID, QEMU_UID)
    data = ({"name": "data", "serial": "unsynced", "disk": {"bus": "virtio"}}, {"name": "data", "persistentVolumeClaim": {"claimName": "data"}})
    args = [NOREG, "--detach", "--wait-for", "UNSYNCED name=", "--timeout", "300", "--pvc", f"data={claim}:16Mi"]

    def boot(serial: str) -> tuple[int, int]:
        vmi = qemu_user.write_vmi("stopping", guest_image, serial=serial, extra=[data])
        started = qemu_user.launcher("run", *args, vmi)
        assert started.code == 0, started.err
        console = parse_console(qemu_user.launcher("logs", "stopping").out)
        [written] = console["unsynced"].values()
        return written

    assert boot("hold-300") == (0, 1)
    stopped = qemu_user.launcher("stop", "--json", "stopping")
    assert stopped.code == 0, stopped.err
    [vm] = json.loads(stopped.out)["vms"]
    assert (vm["how"], vm["gracePeriod"]) == (SHUT_DOWN, DEFAULT_GRACE_PERIOD), (vm, stopped.err)
    assert "default_stopping: the guest powered off (" in stopped.err, stopped.err
    assert_clean(qemu_user, "default_stopping")

    try:
        assert boot("hold-300-ignore-acpi") == (1, 2)  # the first boot's last write is there
        forced = qemu_user.launcher("stop", "--json", "--force", "--grace-period", "3", "stopping")
        assert forced.code == 0, forced.err
        [vm] = json.loads(forced.out)["vms"]
        assert (vm["how"], vm["gracePeriod"]) == (DESTROYED, 3), (vm, forced.err)
        assert "default_stopping: still running after 3 s; destroying it" in forced.err, forced.err
    finally:
        qemu_user.launcher("stop", "--force", "--grace-period=0", "stopping")
    assert_clean(qemu_user, "default_stopping")

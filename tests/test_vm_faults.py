"""Faults around a running VM with real parts (issue: the node under faults and at scale, item 6): two
launchers racing on one VMI name, and the libvirt session daemon killed under a running VM."""

from __future__ import annotations

import json
import os
import signal

from tests.lazyhost import wait_for
from tests.test_killed_launcher import daemon_pids, domains, reap
from tests.vmhost import NOREG, assert_clean


def _until(proc, text: str) -> str:
    seen = ""
    while text not in seen:
        line = proc.stdout.readline()
        assert line, seen + proc.stderr.read()
        seen += line
    return seen


def test_two_launchers_racing_on_one_vmi_one_wins_the_other_refuses_in_one_line(qemu_user, guest_image):
    vmi = qemu_user.write_vmi("race", guest_image, serial="hold-600")
    runs = [qemu_user.popen("run", NOREG, "--no-lazy", "--console", "--grace-period", "0", vmi) for _ in range(2)]
    try:
        # The loser waits for the winner's preparation (the VM's lock), then finds its domain.
        wait_for(lambda: any(p.poll() is not None for p in runs), 300, "one of the runs to give up")
        loser = next(p for p in runs if p.poll() is not None)
        winner = next(p for p in runs if p is not loser)
        assert loser.returncode != 0
        err = loser.stderr.read().strip()
        assert err == ("launcher: default_race: a domain of this name already exists on qemu:///session; "
                       "stop it first (launcher stop race)"), err
        # The winner's VM runs on, untouched: its guest gets to its hold, its record and overlay stay.
        _until(winner, "HOLD seconds=600")
        assert winner.poll() is None
        assert json.loads((qemu_user.cache / "vms" / "default_race.json").read_text())["pid"] == winner.pid
        assert (qemu_user.cache / "run" / "default_race" / "root" / "disk.qcow2").is_file()
        assert qemu_user.launcher("status", "race").out.strip() == "running"
        winner.terminate()
        assert winner.wait(timeout=120) == 130
    finally:
        for proc in runs:
            if proc.poll() is None:
                proc.kill()
            reap(proc)
    assert_clean(qemu_user, "default_race")


def test_a_session_daemon_killed_under_a_running_vm(qemu_user, guest_image):
    """libvirt's session daemon dies (SIGKILL) while its VM runs: qemu lives on, and a daemon started
    anew finds it. status says running, the launcher that ran the VM goes on following it (it ended
    with "libvirt: internal error: client socket is closed", the VM left running) until stop stops
    it, and a new run works."""
    vmi = qemu_user.write_vmi("orphan", guest_image, serial="hold-600")
    qemu_user.virsh("list")
    proc = qemu_user.popen("run", NOREG, "--no-lazy", "--console", "--grace-period", "0", vmi)
    try:
        _until(proc, "HOLD seconds=600")
        daemons = daemon_pids(qemu_user)
        for pid in daemons:
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not set(daemons) & set(daemon_pids(qemu_user)), 30, "the daemon to die")
        status = qemu_user.launcher("status", "orphan")
        assert (status.code, status.out.strip()) == (0, "running"), status
        # The new daemon reconnects to the running qemu in a thread of its own: listed once it has.
        wait_for(lambda: "default_orphan" in domains(qemu_user), 60, "the new daemon to list the running VM")
        stopped = qemu_user.launcher("stop", "orphan")
        assert (stopped.code, stopped.out.strip()) == (0, "VM orphan was stopped"), stopped
        # The launcher that ran it sees its VM stopped, as when its guest powers off.
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
        assert proc.stderr.read().strip().splitlines()[-1] == "launcher: default_orphan stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
        reap(proc)
    assert_clean(qemu_user, "default_orphan")
    plain = qemu_user.write_vmi("orphan", guest_image)
    result = qemu_user.launcher("run", NOREG, "--no-lazy", "--console", plain)
    assert result.code == 0, result.err
    assert_clean(qemu_user, "default_orphan")

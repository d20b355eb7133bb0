"""The launcher as a container's PID 1 (launcher.runtime.reaper): orphans are reaped, the launcher's
own children keep their exit status, signals reach it and its exit status is the container's.
Each case runs in a fresh PID namespace (`unshare --pid --fork --mount-proc`), as in a pod with
shareProcessNamespace: false."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import launcher_command

ROOT = Path(__file__).resolve().parent.parent

# An orphan (sh exits, its background child is handed to PID 1 and dies later), then a child of
# our own whose status must come back intact, then a count of zombies in the namespace.
SCRIPT = textwrap.dedent("""
    import os, subprocess, sys, time
    if sys.argv[1] == "reaper":
        from launcher.runtime.reaper import init_if_pid1
        init_if_pid1()
    print("PID", os.getpid(), flush=True)
    for _ in range(3):
        subprocess.run(["sh", "-c", "(sleep 0.2; exit 5) & exit 0"], check=True)
    own = subprocess.run(["sh", "-c", "sleep 0.5; exit 7"])
    time.sleep(0.5)
    def state(pid):
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1].split()[0]
    zombies = [p for p in os.listdir("/proc") if p.isdigit() and state(p) == "Z"]
    print("OWN", own.returncode, "ZOMBIES", len(zombies), flush=True)
    sys.exit(3)
""")


def in_pid_namespace(*cmd: str) -> list[str]:
    return ["unshare", "--pid", "--fork", "--mount-proc", *cmd]


def run_script(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(in_pid_namespace(sys.executable, "-c", SCRIPT, mode), capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_pid1_reaps_orphans_and_keeps_own_children_status():
    proc = run_script("reaper")
    assert proc.returncode == 3, proc.stderr  # the launcher's status is the container's
    # The launcher itself runs as PID 2, PID 1 reaps what it is handed.
    assert "PID 2" in proc.stdout
    assert "OWN 7 ZOMBIES 0" in proc.stdout, proc.stdout


def test_without_the_reaper_orphans_stay_zombies():
    # The control: the same processes with nobody reaping them, so the check above can fail.
    proc = run_script("none")
    assert proc.returncode == 3, proc.stderr
    assert "PID 1" in proc.stdout
    zombies = int(proc.stdout.split("ZOMBIES")[1])
    assert zombies >= 3, proc.stdout


def test_launcher_entry_point_as_pid1_keeps_its_exit_status_and_error(tmp_path):
    proc = subprocess.run(in_pid_namespace(*launcher_command("status", "nosuch", "--cache-dir", tmp_path)),
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode not in (0, 3), proc
    assert "nosuch" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


def _pid_in_namespace_of(unshare_pid: int) -> int:
    """The host pid of the namespace's PID 1: unshare's only child."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        children = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.05)
    raise AssertionError("unshare started no child")


def _signal_state(pid: int) -> str:
    """Signal masks, pending sets and wait channels of `pid` and its children."""
    lines = []
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for p in [str(pid), *children]:
        try:
            status = Path(f"/proc/{p}/status").read_text().splitlines()
            wchan = Path(f"/proc/{p}/wchan").read_text()
        except OSError as e:
            lines.append(f"{p}: {e}")
            continue
        fields = [x for x in status if x.split(":")[0] in ("Name", "State", "NSpid", "SigQ", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")]
        lines.append(f"{p} wchan={wchan} " + " | ".join(" ".join(f.split()) for f in fields))
    return "\n".join(lines)


def test_sigterm_to_pid1_reaches_the_launcher():
    # The launcher waits for SIGTERM with sigtimedwait, not a Python handler and a sleep: a handler
    # whose signal lands between the interpreter's last check and the sleep's syscall runs only when
    # the sleep ends, and that race (not PID 1) is what lost the first SIGTERM twice in CI (states
    # below: PID 1 in sigtimedwait, the launcher asleep, nothing pending anywhere). si_pid says the
    # signal came from PID 1, forwarded, not from outside.
    script = textwrap.dedent("""
        import os, signal, sys
        from launcher.runtime.reaper import init_if_pid1
        init_if_pid1()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        print("READY", flush=True)
        info = signal.sigtimedwait({signal.SIGTERM}, 60)
        if info is None:
            sys.exit(1)
        print("TERM in", os.getpid(), "from", info.si_pid, flush=True)
        sys.exit(42)
    """)
    proc = subprocess.Popen(in_pid_namespace(sys.executable, "-c", script), stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "READY"
        pid1 = _pid_in_namespace_of(proc.pid)
        os.kill(pid1, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            # Say where the signal went, and whether a second one gets through (lost on the way in)
            # or not (stuck in PID 1 or the launcher).
            state = _signal_state(pid1)
            os.kill(pid1, signal.SIGTERM)
            try:
                proc.communicate(timeout=10)
                again = f"a second SIGTERM ended it (exit {proc.returncode})"
            except subprocess.TimeoutExpired:
                again = "a second SIGTERM did not end it either"
            raise AssertionError(f"no exit 30 s after SIGTERM; {again}:\n{state}") from None
    finally:
        proc.kill()
    assert "TERM in 2 from 1" in out, out
    assert proc.returncode == 42


@pytest.mark.parametrize("signum", [signal.SIGKILL])
def test_launcher_killed_by_a_signal_exits_like_a_shell_says(signum):
    script = textwrap.dedent(f"""
        import os
        from launcher.runtime.reaper import init_if_pid1
        init_if_pid1()
        os.kill(os.getpid(), {int(signum)})
    """)
    proc = subprocess.run(in_pid_namespace(sys.executable, "-c", script), capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 128 + signum, proc


def test_the_test_runners_subreaper_reaps_orphans_with_the_same_loop():
    # scripts/subreaper.py (what scripts/test.sh runs pytest under) marks itself child subreaper and
    # serves its command with launcher.runtime.reaper.serve: orphans of the command are its own, and
    # reaped as they die instead of staying zombies until PID 1 gets round to them.
    script = textwrap.dedent("""
        import os, subprocess, sys, time
        for _ in range(3):
            subprocess.run(["sh", "-c", "(sleep 0.2; exit 5) & exit 0"], check=True)
        time.sleep(0.8)
        def fields(pid):
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(") ", 1)[1].split()
        mine = [p for p in os.listdir("/proc") if p.isdigit() and os.path.exists(f"/proc/{p}/stat")]
        zombies = []
        for p in mine:
            try:
                state, ppid = fields(p)[:2]
            except OSError:
                continue
            if int(ppid) == os.getppid() and state == "Z":
                zombies.append(p)
        print("ZOMBIES", len(zombies), flush=True)
        sys.exit(4)
    """)
    proc = subprocess.run([sys.executable, ROOT / "scripts" / "subreaper.py", sys.executable, "-c", script],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 4, proc.stderr
    assert "ZOMBIES 0" in proc.stdout, proc.stdout

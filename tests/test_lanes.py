"""The suite's scheduler (tests/lanes.py): two workers on the files that boot guests, booting ones
first; the third, the background lane, only on files that boot none, at a lower priority."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from types import SimpleNamespace

from tests import lanes as lanes_module
from tests.lanes import BACKGROUND_NICE, GUEST_LANES, GuestLanes, has_background, is_background

BOOTING = {f"tests/test_vm{n}.py" for n in range(5)}
QUIET = {f"tests/test_quiet{n}.py" for n in range(6)}
NEW = "tests/test_new.py"  # not in the recorded run: counted as booting


class Worker:
    def __init__(self, name):
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.queue: list[int] = []

    def send_runtest_some(self, indexes):
        self.queue.extend(indexes)

    def shutdown(self):
        self.shutting_down = True


def collection():
    # The longest first, as tests/conftest.py orders them: quiet files among the booting ones.
    files = [*sorted(QUIET)[:2], *sorted(BOOTING)[:3], *sorted(QUIET)[2:4], *sorted(BOOTING)[3:], NEW, *sorted(QUIET)[4:]]
    return [f"{path}::test_{n}" for path in files for n in range(4)]


def run(workers: int, order):
    """Runs the collection through the scheduler, the workers taking a test each in `order`; returns
    the scheduler, the workers, the collection, and which worker ran what."""
    config = SimpleNamespace(getvalue=lambda name: [f"{workers}*popen"], option=SimpleNamespace(loadscopereorder=False))
    lanes = GuestLanes(config, files=(BOOTING, BOOTING | QUIET))
    nodes = [Worker(f"gw{n}") for n in range(workers)]
    tests = collection()
    for node in nodes:
        lanes.add_node(node)
        lanes.add_node_collection(node, tests)
    lanes.schedule()
    ran: dict[str, list[str]] = {node.gateway.id: [] for node in nodes}
    for node in order(nodes):
        if not lanes.has_pending:
            break
        assert any(each.queue for each in nodes), "tests are left but no worker was given any"
        if not node.queue:
            continue
        index = node.queue.pop(0)
        ran[node.gateway.id].append(tests[index])
        lanes.mark_test_complete(node, index)
    return lanes, nodes, tests, ran


def files(tests: list[str]) -> set[str]:
    return {test.split("::")[0] for test in tests}


def test_the_background_lane_runs_only_files_that_boot_none_and_every_test_runs_once():
    lanes, nodes, tests, ran = run(3, itertools.cycle)
    assert not lanes.has_pending
    assert sorted(sum(ran.values(), [])) == sorted(tests)
    assert ran["gw2"] and files(ran["gw2"]) <= QUIET, ran["gw2"]
    assert all(node.shutting_down for node in nodes)


def test_a_foreground_file_goes_to_a_guest_lane_among_the_booting_ones(monkeypatch):
    foreground = sorted(QUIET)[0]
    monkeypatch.setattr(lanes_module, "FOREGROUND", {foreground})
    lanes, nodes, tests, ran = run(3, itertools.cycle)
    assert foreground not in files(ran["gw2"]) and files(ran["gw2"]) <= QUIET, ran["gw2"]
    first = [test.split("::")[0] for test in ran["gw0"] + ran["gw1"]][:8]
    assert foreground in first, first  # taken in the queue's order, as a booting file is
    assert sorted(sum(ran.values(), [])) == sorted(tests)


def test_the_guest_lanes_take_booting_files_before_quiet_ones():
    lanes, nodes, tests, ran = run(3, itertools.cycle)
    for lane in ("gw0", "gw1"):
        order = list(dict.fromkeys(test.split("::")[0] for test in ran[lane]))
        booted = [path in BOOTING | {NEW} for path in order]
        assert booted == sorted(booted, reverse=True), order  # every booting file before any quiet one


def test_a_background_lane_that_finds_only_booting_files_waits_and_ends_with_the_queue():
    # The background lane takes a test only when the others have taken theirs: its files go first.
    lanes, nodes, tests, ran = run(3, lambda nodes: itertools.chain(itertools.repeat(nodes[2], 100), itertools.cycle(nodes[:2])))
    assert files(ran["gw2"]) <= QUIET and not lanes.has_pending
    assert sorted(sum(ran.values(), [])) == sorted(tests)
    assert nodes[2].shutting_down


def test_two_workers_have_no_background_lane():
    lanes, nodes, tests, ran = run(2, itertools.cycle)
    assert sorted(sum(ran.values(), [])) == sorted(tests)
    assert not any(lanes.background(node) for node in nodes)
    assert [is_background(f"gw{n}", 3) for n in range(3)] == [False, False, True]
    # Only a run with a background lane is scheduled by GuestLanes (tests/conftest.py); two workers keep loadfile's.
    assert [has_background(SimpleNamespace(getvalue=lambda name, n=n: [f"{n}*popen"])) for n in (2, 3)] == [False, True]
    assert GUEST_LANES == 2


def test_the_background_lanes_worker_and_what_it_starts_run_niced():
    # What pytest_configure does on each worker (tests/conftest.py), in a process of its own.
    code = ("import os, subprocess; from types import SimpleNamespace; from tests.lanes import enter_background; "
            "enter_background(SimpleNamespace(workerinput={'workerid': os.environ['W'], 'workercount': 3}, "
            "getoption=lambda name, default: os.environ['Q'] == '1')); "
            "print(os.nice(0), subprocess.run(['nice'], capture_output=True, text=True).stdout.strip())")
    base = os.nice(0)
    niced = {(worker, quick): subprocess.run([sys.executable, "-c", code], env={**os.environ, "W": worker, "Q": quick},
                                             capture_output=True, text=True, check=True).stdout.split()
             for worker in ("gw0", "gw2") for quick in "01"}
    assert niced["gw0", "0"] == niced["gw0", "1"] == [str(base)] * 2
    assert niced["gw2", "0"] == [str(min(19, base + BACKGROUND_NICE))] * 2
    assert niced["gw2", "1"] == [str(base)] * 2  # the quick tier boots no guest: no lane yields

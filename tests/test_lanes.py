"""The suite's scheduler (tests/lanes.py): never more than two workers on files that boot guests."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

from tests.lanes import GUEST_LANES, GuestLanes

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
    files = sorted(BOOTING) + [NEW] + sorted(QUIET)  # the longest first, as tests/conftest.py orders them
    return [f"{path}::test_{n}" for path in files for n in range(4)]


def run(workers: int, order):
    config = SimpleNamespace(getvalue=lambda name: [f"{workers}*popen"], option=SimpleNamespace(loadscopereorder=False))
    lanes = GuestLanes(config, files=(BOOTING, BOOTING | QUIET))
    nodes = [Worker(f"gw{n}") for n in range(workers)]
    tests = collection()
    for node in nodes:
        lanes.add_node(node)
        lanes.add_node_collection(node, tests)
    lanes.schedule()
    ran, most = [], 0
    for node in order(nodes):
        if not lanes.has_pending:
            break
        assert any(each.queue for each in nodes), "tests are left but no worker was given any"
        if not node.queue:
            continue
        index = node.queue.pop(0)
        ran.append(tests[index])
        lanes.mark_test_complete(node, index)
        most = max(most, sum(lanes.holds_guests(each) for each in nodes))
    return lanes, nodes, tests, ran, most


def test_three_workers_never_boot_three_guests_and_run_each_test_once():
    lanes, nodes, tests, ran, most = run(3, itertools.cycle)
    assert not lanes.has_pending
    assert sorted(ran) == sorted(tests)
    assert most == GUEST_LANES
    assert all(node.shutting_down for node in nodes)


def test_the_third_worker_takes_quiet_files_while_two_boot():
    lanes, nodes, tests, ran, most = run(3, lambda nodes: itertools.islice(itertools.cycle(nodes), 3))
    first = [lanes._split_scope(tests[node.queue[0] if node.queue else 0]) for node in nodes]
    assert [path in BOOTING for path in first] == [True, True, False], first


def test_two_workers_take_the_files_in_the_queues_order():
    lanes, nodes, tests, ran, most = run(2, itertools.cycle)
    assert sorted(ran) == sorted(tests)
    starts = [test.split("::")[0] for test in ran]
    assert list(dict.fromkeys(starts))[:2] == sorted(BOOTING)[:2]

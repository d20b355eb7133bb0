"""Which test file a worker runs next: two workers run the files that boot guests, and a third, the
background lane, only files that boot none, at a lower CPU priority.

Guests boot under TCG and each takes a core, so two of them fill this kind of machine; yet a run
with two workers left the cores idle a fifth of the time (tests/timing.py IdleSampler), while its
tests waited on a registry gone away, a slow link, a timeout meant to expire. The background lane
fills that idle time with the files that boot none, and yields the cores whenever the other two
compute: its process and everything it starts run at nice BACKGROUND_NICE, where a core busy with a
guest leaves it about a tenth. A third worker at the same priority as the others made every test
41 % slower (tests/README.md).

Which files boot a guest is what the recorded run saw (tests/durations.json); a file it does not know
counts as one that boots. Files keep xdist's loadfile grouping (a file's module fixtures are made
once) and the queue's order (the longest files first, tests/conftest.py); the two guest lanes take
booting files first and the rest once none is left.
"""

from __future__ import annotations

import os

from xdist.scheduler import LoadFileScheduling
from xdist.workermanage import parse_tx_spec_config

from tests import timing

GUEST_LANES = 2
BACKGROUND_NICE = 10
# Files for the guest lanes that the recorded run does not see boot: test_lazy_link's assertions
# order events by when threads woke, which a lane yielding its cores delays (a prefetch request meant
# to go out early went late); test_lazy_prefetch checks what the disk server holds back on a fast
# link, and a server starved at nice 10 measured the loopback registry below its slow-link rate and
# rightly fetched the rest; test_pod boots its guest inside a pod, out of the count's sight, and at
# nice 10 that boot took 72-191 s against 36 on a guest lane.
FOREGROUND = {"tests/test_lazy_link.py", "tests/test_lazy_prefetch.py", "tests/test_pod.py"}


def is_background(workerid: str | None, workers: int) -> bool:
    """The background lane is the last worker, when there are more than GUEST_LANES."""
    return workers > GUEST_LANES and workerid == f"gw{workers - 1}"


def has_background(config) -> bool:
    """On the controller: the run has more workers than GUEST_LANES, so its last is the background lane."""
    return len(parse_tx_spec_config(config)) > GUEST_LANES


def enter_background(config) -> None:
    """On the background lane's worker: lower its priority, and so that of all it starts. Not in the
    quick tier, which boots no guest to yield to."""
    worker = getattr(config, "workerinput", None)
    if worker is not None and not config.getoption("--quick", False) \
            and is_background(worker.get("workerid"), int(worker.get("workercount", 0))):
        os.nice(BACKGROUND_NICE)


def booting_files() -> tuple[set[str], set[str]]:
    """The test files the recorded run saw boot a guest, and every file it recorded."""
    tests = timing.recorded()["tests"]
    known = {nodeid.split("::", 1)[0] for nodeid in tests}
    booting = {nodeid.split("::", 1)[0] for nodeid, (_, boots) in tests.items() if boots > 0}
    return booting, known


class GuestLanes(LoadFileScheduling):
    def __init__(self, config, log=None, files: tuple[set[str], set[str]] | None = None):
        super().__init__(config, log)
        self.booting, self.known = files if files is not None else booting_files()

    def foreground(self, scope: str) -> bool:
        """A file for the guest lanes: one that boots a guest (or may: unknown), or FOREGROUND's."""
        return scope in self.booting or scope not in self.known or scope in FOREGROUND

    def background(self, node) -> bool:
        return is_background(node.gateway.id, self.numnodes)

    def _next_scope(self, node) -> str | None:
        if self.background(node):
            return next((scope for scope in self.workqueue if not self.foreground(scope)), None)
        return next((scope for scope in self.workqueue if self.foreground(scope)), next(iter(self.workqueue), None))

    def _assign_work_unit(self, node) -> None:
        scope = self._next_scope(node)
        if scope is None:
            return  # only the guest lanes' files are left: the background lane ends once the queue is empty
        self.workqueue.move_to_end(scope, last=False)
        super()._assign_work_unit(node)

    def mark_test_complete(self, node, item_index, duration=0) -> None:
        super().mark_test_complete(node, item_index, duration)
        # A background lane left waiting once the queue holds no file for it is told to end when it empties.
        for other in self.nodes:
            if other is not node:
                self._reschedule(other)

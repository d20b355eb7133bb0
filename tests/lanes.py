"""Which test file a worker runs next: at most two workers hold files that boot guests.

Guests boot under TCG and each takes a core, so two of them fill this kind of machine; the tests that
boot none mostly wait on processes and sockets. A third worker therefore runs only files that boot
no guest, beside the two that boot them, instead of a third guest slowing the other two.

Which files boot a guest is what the recorded run saw (tests/durations.json); a file it does not know
counts as one that boots. Files keep xdist's loadfile grouping (a file's module fixtures are made
once) and the queue's order (the longest files first, tests/conftest.py).
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

from tests import timing

GUEST_LANES = 2


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

    def boots(self, scope: str) -> bool:
        return scope in self.booting or scope not in self.known

    def holds_guests(self, node) -> bool:
        return any(self.boots(scope) and not all(done.values()) for scope, done in self.assigned_work.get(node, {}).items())

    def _assign_work_unit(self, node) -> None:
        lanes = sum(self.holds_guests(other) for other in self.assigned_work if other is not node)
        may_boot = self.holds_guests(node) or lanes < GUEST_LANES
        scope = next((scope for scope in self.workqueue if may_boot or not self.boots(scope)), None)
        if scope is None:
            return  # only booting files are left and both lanes are busy: asked again when a test ends
        self.workqueue.move_to_end(scope, last=False)
        super()._assign_work_unit(node)

    def mark_test_complete(self, node, item_index, duration=0) -> None:
        super().mark_test_complete(node, item_index, duration)
        # A lane that ended its last booting file frees a worker that waits for one, and a worker
        # left waiting once the queue is empty is told to end.
        for other in self.nodes:
            if other is not node:
                self._reschedule(other)

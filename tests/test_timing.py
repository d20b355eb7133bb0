"""tests/timing.py's account of where a run idled: each second's idle cores shared among the tests running then."""

from __future__ import annotations

import pytest

from tests.timing import budget_line, idle_charged


def test_idle_cores_are_shared_among_the_files_running_in_proportion_to_their_overlap():
    samples = [(0.0, 1.0, 2.0), (1.0, 2.0, 1.0), (2.0, 3.0, 0.5)]  # 2 idle cores, then 1, then half of one
    spans = [("a", 0.0, 2.0), ("b", 1.5, 3.0)]  # a alone, then a and b for half a second, then b alone
    per_file, idle, seconds = idle_charged(samples, spans)
    assert per_file["a"] == pytest.approx(2.0 + 1.0 * 1.0 / 1.5)  # the second sample: a ran 1 s of it, b 0.5 s
    assert per_file["b"] == pytest.approx(1.0 * 0.5 / 1.5 + 0.5)
    assert (idle, seconds) == (3.5, 3.0)


def test_a_second_with_no_test_running_is_charged_to_none():
    per_file, idle, seconds = idle_charged([(0.0, 1.0, 2.0)], [("a", 5.0, 6.0)])
    assert dict(per_file) == {} and (idle, seconds) == (2.0, 1.0)


@pytest.mark.parametrize("wall, quick, line", [
    (19.9 * 60, False, "wall time 19.9 min: within the tests' budget of 20 min (the whole CI run, set-up included: 25 min)"),
    (20.1 * 60, False, "wall time 20.1 min: OVER the tests' budget of 20 min (the whole CI run, set-up included: 25 min)"),
    (3.4 * 60, True, "wall time 3.4 min: within the quick tier's budget of 5 min"),
    (5.2 * 60, True, "wall time 5.2 min: OVER the quick tier's budget of 5 min"),
])
def test_a_run_is_measured_against_its_own_tiers_budget(wall, quick, line):
    assert budget_line(wall, quick) == line

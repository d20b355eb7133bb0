"""tests/timing.py's account of where a run idled: each second's idle cores shared among the tests running then."""

from __future__ import annotations

import pytest

from tests.timing import idle_charged


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

"""The pool of ranks on a loaded machine: a run past its limit whose ranks compute is slow, not hung; one whose
ranks wait for nothing that comes is a hang, told with the machine's load."""

import time

import pytest

from support import harness


def busy(seconds: float) -> float:
    """Keep this rank's CPU busy for ``seconds`` (as a slow machine would make a short test last)."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass
    return seconds


def idle(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def test_a_run_that_computes_past_its_limit_is_slow_not_hung(dist2):
    dist2.run(busy, seconds=0)  # the pool started
    assert dist2.run(busy, timeout=1 / harness.SLACK, seconds=3) == [3, 3]


def test_a_run_that_waits_past_its_limit_is_a_hang_told_with_the_load(dist2):
    with pytest.raises(AssertionError, match=r"did not answer within 1s and used no CPU time over the last of it "
                                             r"\(hang; load [\d.]+ [\d.]+ [\d.]+ on \d+ cores; HYBRIDPAR_TEST_SLACK="):
        dist2.run(idle, timeout=1 / harness.SLACK, seconds=30)
    assert dist2.run(busy, seconds=0) == [0, 0]  # the pool restarted

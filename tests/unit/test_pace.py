"""Fail-slow detection and rebalancing, the parts that need no process group: each rank's factor against its
peers, and what the rebalancing decides from a window's timing (a split tried, kept where it paid, undone and not
tried again where it did not)."""

import torch

from hybridpar.ir.analysis import graph_of
from hybridpar.models.cosmoflow import cosmoflow
from hybridpar.plan import Plan
from hybridpar.train.balance import Balancer, Replan
from hybridpar.train.faults import Fault, _parse
from hybridpar.train.pace import Window, _factors


def test_a_factor_is_the_time_over_the_median_of_the_peers():
    assert _factors([1.0, 2.0, 1.0, 1.0]) == (1.0, 2.0, 1.0, 1.0)
    assert _factors([1.0, 3.0]) == (1 / 3, 3.0), "two ranks: each against the other"
    assert _factors([5.0]) == (1.0,)


def test_a_rank_is_reported_after_two_windows_over_the_factor_that_matter(monkeypatch):
    """Two windows in a row over ``train.slow_factor``, each with the forward past its expectation by ``MATTERS`` of
    the step: a noisy forward of a few milliseconds in a long step is no report."""
    from types import SimpleNamespace

    from hybridpar.train import pace

    monkeypatch.setattr(pace.dist, "get_world_size", lambda: 4)
    measured = iter([])

    def all_gather(out, mine):
        for o, row in zip(out, next(measured), strict=True):
            o.copy_(torch.tensor(row, dtype=torch.float64))

    monkeypatch.setattr(pace.dist, "all_gather", all_gather)
    config = SimpleNamespace(train=SimpleNamespace(slow_window=1, slow_factor=1.5))
    parallel = SimpleNamespace(device=torch.device("cpu"), computing_modules=lambda: [], modules={})
    # forward, halo waits, step (seconds), peak memory and device bytes (not known on a CPU)
    slow = [(0.1, 0.0, 1.0, 0, 0)] * 3 + [(0.25, 0.0, 1.0, 0, 0)]  # rank 3: 2.5x, 0.15 s past its peers in 1 s
    noise = [(0.002, 0.0, 1.0, 0, 0)] * 3 + [(0.005, 0.0, 1.0, 0, 0)]  # 2.5x too, but 3 ms
    for windows, reports in (([slow, slow, slow], [{}, {3: 2.5}, {}]), ([noise, noise, noise], [{}, {}, {}])):
        measured = iter(windows)
        timing = pace.Pace(config, Plan(dp=4, global_batch=4), parallel)
        assert timing.end(1) is None  # the first step is not timed
        found = [timing.end(step) for step in (2, 3, 4)]
        assert [w.slow for w in found] == reports and all(w.factors[3] == 2.5 for w in found)


def test_the_slow_fault_is_planned_by_the_environment():
    assert _parse("slow:2@5, slow:1@3x4") == (Fault("slow", 2, 5), Fault("slow", 1, 3, 4))


def window(step: int, took: float, slow: dict, speeds=(1.0, 1.0, 1.0, 1.0)) -> Window:
    return Window(step, (0.1,) * 4, (0.0,) * 4, (took,) * 4, (1.0,) * 4, slow, speeds)


def analysed():
    with torch.device("meta"):
        model = cosmoflow(size=32, in_channels=1, base_channels=2, num_blocks=2, fc_sizes=(8,), num_outputs=2)
    example = torch.empty(16, 1, 32, 32, 32, device="meta")
    return model, example, graph_of(model, example)


def test_a_rebalance_is_kept_where_it_paid_and_undone_where_it_did_not():
    even = Plan(dp=4, global_batch=16, input_shape=(16, 1, 32, 32, 32))
    balancer = Balancer(enabled=True)
    assert not balancer.wants(window(5, 2.0, {}))
    slow = window(10, 2.0, {2: 2.0}, speeds=(1.0, 1.0, 0.5, 1.0))
    assert balancer.wants(slow)
    tried = balancer.decide(even, (1.0,) * 4, slow, analysed())
    assert isinstance(tried, Replan) and tried.plan.shares == (5, 5, 2, 4) and tried.reason == "rank 2 slow (2.00x)"
    assert balancer.wants(window(15, 1.9, {}))  # the first window under it decides
    back = balancer.decide(tried.plan, tried.speeds, window(15, 1.95, {}), analysed())
    assert isinstance(back, Replan) and back.plan == even and "did not pay (1.95 s per step against 2 s" in back.reason
    again = balancer.decide(even, (1.0,) * 4, slow, analysed())
    assert again == "rank 2 slow (2.00x): no uneven split of dp=4 is predicted faster (the splits tried did not " \
                    "pay); the plan stays"


def test_a_rebalance_that_paid_stays():
    even = Plan(dp=4, global_batch=16, input_shape=(16, 1, 32, 32, 32))
    balancer = Balancer(enabled=True)
    tried = balancer.decide(even, (1.0,) * 4, window(10, 2.0, {1: 2.0}, (1.0, 0.5, 1.0, 1.0)), analysed())
    kept = balancer.decide(tried.plan, tried.speeds, window(15, 1.2, {}), analysed())
    assert kept == "rebalancing paid: 1.2 s per step against 2 s before"
    assert not balancer.wants(window(20, 1.2, {})) and not Balancer(enabled=False).wants(window(5, 2.0, {0: 3.0}))


def test_a_rebalanced_rank_must_keep_its_memory_within_its_device():
    """A rank whose measured peak, grown with its new work, would pass 90% of its device keeps its share."""
    from hybridpar.train.planning import sized_for

    even = Plan(dp=4, global_batch=16, input_shape=(16, 1, 32, 32, 32))
    speeds = (1.0, 1.0, 0.5, 1.0)
    roomy = sized_for(*analysed(), even, speeds, memory=((2e9,) * 4, (10e9,) * 4))
    assert roomy.shares == (5, 5, 2, 4)
    tight = sized_for(*analysed(), even, speeds, memory=((8e9,) * 4, (10e9,) * 4))  # 5 / 4 x 8 GB > 9 GB
    assert tight == even

"""Fail-slow detection and rebalancing, the parts that need no process group: each rank's factor against its
peers, and what the rebalancing decides from a window's timing (a split tried, kept where it paid, undone and not
tried again where it did not)."""

import torch

from hybridpar.models.cosmoflow import cosmoflow
from hybridpar.plan import Plan
from hybridpar.train.balance import Balancer, Replan
from hybridpar.train.faults import Fault, _parse
from hybridpar.train.pace import Window, _factors


def test_a_factor_is_the_time_over_the_median_of_the_peers():
    assert _factors([1.0, 2.0, 1.0, 1.0]) == (1.0, 2.0, 1.0, 1.0)
    assert _factors([1.0, 3.0]) == (1 / 3, 3.0), "two ranks: each against the other"
    assert _factors([5.0]) == (1.0,)


def test_the_slow_fault_is_planned_by_the_environment():
    assert _parse("slow:2@5, slow:1@3x4") == (Fault("slow", 2, 5), Fault("slow", 1, 3, 4))


def window(step: int, took: float, slow: dict, speeds=(1.0, 1.0, 1.0, 1.0)) -> Window:
    return Window(step, (0.1,) * 4, (0.0,) * 4, (took,) * 4, (1.0,) * 4, slow, speeds)


def analysed():
    with torch.device("meta"):
        model = cosmoflow(size=32, in_channels=1, base_channels=2, num_blocks=2, fc_sizes=(8,), num_outputs=2)
    return model, torch.empty(16, 1, 32, 32, 32, device="meta")


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

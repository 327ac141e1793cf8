"""Rebalancing around slow ranks (``train.rebalance``, ``hybridpar train --rebalance``): when the timing
(``pace``) reports a slow rank, the run is re-planned with work sized to the speeds it measured
(``plan.sizing``: uneven shares, uneven slabs), from a checkpoint of that step, in the same processes.

A rebalanced plan is a prediction from a linear model of work (a slab half as thick costs half as much), which a
thin slab's fixed costs can break; so it is kept only if it pays: the first window under it must take at least
``sizing.MIN_GAIN`` less time per step than the window before. Otherwise the run goes back to the plan before,
and the next time a rank is reported slow the best split not yet tried is tried (uneven shares where uneven
slabs did not pay, say), until none is left. Every rank takes the same decisions from the same all-gathered
timing.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridpar.plan import Plan, sizing
from hybridpar.train import planning
from hybridpar.train.pace import Window


@dataclass(frozen=True)
class Replan:
    """A plan to run next, the speeds it is sized for, and why."""

    plan: Plan
    speeds: tuple[float, ...]
    reason: str

    @property
    def told(self) -> str:
        return told(self.plan)


def told(plan: Plan) -> str:
    """``plan`` in words, with its pipeline stages (which ``Plan.describe`` leaves out)."""
    return plan.describe() + (f"; stages from {', '.join(plan.stages)}" if plan.stages else "")


class Balancer:
    """What to do after each window: nothing, or re-plan (``decide``)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self._trial: tuple[Replan, Plan, float] | None = None  # the plan before, the plan on trial, step time before
        self._failed: set[tuple[bool, bool, bool]] = set()  # the kinds of split that did not pay

    def wants(self, window: Window) -> bool:
        """Whether ``window`` asks for a decision: a slow rank to rebalance around, or a rebalance on trial."""
        return self.enabled and (self._trial is not None or bool(window.slow))

    def decide(self, plan: Plan, speeds: tuple[float, ...], window: Window, analysed: tuple) -> Replan | str:
        """The re-plan after ``window`` under ``plan`` (sized for ``speeds``), or a line saying why none."""
        took = max(window.step_s)
        if self._trial is not None:
            before, tried, before_took = self._trial
            self._trial = None
            if took < (1 - sizing.MIN_GAIN) * before_took:
                return f"rebalancing paid: {took:.3g} s per step against {before_took:.3g} s before"
            self._failed.add(_split(tried, before.plan))
            return Replan(before.plan, before.speeds, f"{told(tried)} did not pay ({took:.3g} s per step against "
                                                      f"{before_took:.3g} s before); back")
        slow = ", ".join(f"rank {r} slow ({f:.2f}x)" for r, f in window.slow.items())
        sized = planning.sized_for(*analysed, plan, window.speeds, lambda p: _split(p, plan) not in self._failed,
                                   (window.peak, window.capacity))
        if sized == plan:
            tried = " (the splits tried did not pay)" if self._failed else ""
            return f"{slow}: no uneven split of {plan.describe()} is predicted faster{tried}; the plan stays"
        self._trial = (Replan(plan, speeds, ""), sized, took)
        return Replan(sized, window.speeds, slow)


def _split(plan: Plan, before: Plan) -> tuple[bool, bool, bool]:
    """The kind of split (uneven shares, uneven slabs, stages moved from ``before``'s): one that did not pay is not
    tried again with other weights (a few rows more or less do not change what made it slow)."""
    return bool(plan.shares), bool(plan.slabs), plan.stages != before.stages

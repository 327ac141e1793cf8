"""Pipeline stages: what a stage of consecutive layers costs, and the cuts of least pipeline time.

A stage's time is that of one micro-batch through its layers (forward and backward, their
communication, the recomputation of checkpointing, FSDP's gathers) plus sending its output forward
and the gradient back. Its memory holds the model state of its layers (by ZeRO level), the
activations of the micro-batches in flight under 1F1B, the largest transient buffer and the reserve.

Stages start at *units*: the runs of layers between legal cut points (one tensor crosses, whole over
tp). Checkpointing keeps each unit's input and recomputes one unit at a time in backward.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from hybridpar.plan import cost
from hybridpar.plan.cluster import ClusterSpec, Link


@dataclass(frozen=True)
class StageSetting:
    """Choices that price a stage besides its layers."""

    cluster: ClusterSpec
    num_stages: int
    micro_batches: int
    sharding: int
    checkpointing: bool
    optimizer: str
    data_group: cost.Group  # dp x spatial: gradients, ZeRO shards
    pipe_link: Link  # between consecutive stages


@dataclass(frozen=True)
class Units:
    """Per-unit sums of one chain of per-layer options (``starts[u]`` is the first layer of unit ``u``)."""

    starts: tuple[int, ...]
    time: tuple[float, ...]  # forward + backward + communication of one micro-batch
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    params: tuple[float, ...]
    param_layers: tuple[int, ...]  # layers with parameters (FSDP gathers each)
    saved: tuple[float, ...]
    workspace: tuple[float, ...]  # largest in the unit
    largest_params: tuple[float, ...]  # of one layer
    kept: tuple[float, ...]  # the unit's input (what checkpointing keeps)
    out_bytes: tuple[float, ...]  # the unit's output (what a cut after it sends)

    @staticmethod
    def of(chain, starts: list[int]) -> "Units":
        bounds = list(zip(starts, starts[1:] + [len(chain.options)]))
        opts = chain.options
        return Units(
            tuple(starts),
            tuple(sum(chain.layer_time(i) for i in range(a, b)) for a, b in bounds),
            tuple(sum(o.forward for o in opts[a:b]) for a, b in bounds),
            tuple(sum(o.time - o.forward for o in opts[a:b]) for a, b in bounds),
            tuple(sum(o.params for o in opts[a:b]) for a, b in bounds),
            tuple(sum(1 for o in opts[a:b] if o.params) for a, b in bounds),
            tuple(sum(o.saved for o in opts[a:b]) for a, b in bounds),
            tuple(max(o.workspace for o in opts[a:b]) for a, b in bounds),
            tuple(max(o.params for o in opts[a:b]) for a, b in bounds),
            tuple(opts[a].in_bytes for a, _ in bounds),
            tuple(opts[b - 1].out_bytes for _, b in bounds),
        )

    def __len__(self) -> int:
        return len(self.starts)

    @cached_property
    def max_workspace(self) -> "RangeMax":
        return RangeMax(self.workspace)

    @cached_property
    def max_largest_params(self) -> "RangeMax":
        return RangeMax(self.largest_params)

    @cached_property
    def max_saved(self) -> "RangeMax":
        return RangeMax(self.saved)

    def total_time(self, setting: "StageSetting") -> float:
        """Sum of every unit's time under ``setting`` (a stage of all units, sends aside)."""
        return sum(self.time) + sum(_extra(self, setting))

    def state_memory(self, setting: "StageSetting") -> float:
        """Model state of every unit, spread evenly over the stages: what no cut can go below."""
        params, grads, state = cost.model_state_memory(sum(self.params), setting.sharding,
                                                       setting.data_group.size, setting.optimizer)
        return (params + grads + state) / setting.num_stages + setting.cluster.reserved_memory


class RangeMax:
    """Maximum over ``values[a:b]`` in O(1) (a sparse table)."""

    def __init__(self, values):
        self.table = [list(values)]
        k = 1
        while 2 * k <= len(values):
            prev = self.table[-1]
            self.table.append([max(prev[i], prev[i + k]) for i in range(len(values) - 2 * k + 1)])
            k *= 2

    def __call__(self, a: int, b: int) -> float:
        j = (b - a).bit_length() - 1
        row = self.table[j]
        return max(row[a], row[b - (1 << j)])


def _prefix(values) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _extra(units: Units, s: StageSetting) -> list[float]:
    """Time each unit adds under ``s``: the recomputed forward of checkpointing, FSDP's gathers (one per
    layer with parameters, before forward and again before backward)."""
    extra = list(units.forward) if s.checkpointing else [0.0] * len(units)
    if s.sharding == 3 and s.data_group.size > 1:
        link, n = s.data_group.link, s.data_group.size
        for u, (p, k) in enumerate(zip(units.params, units.param_layers)):
            extra[u] += 2 * ((n - 1) * link.step_latency * k + (n - 1) / n * p / link.bus_bandwidth)
    return extra


class StageCosts:
    """Any stage of units ``[a, b)`` priced in O(1)."""

    def __init__(self, units: Units, setting: StageSetting):
        self.units, self.setting = units, setting
        self.time = _prefix(t + e for t, e in zip(units.time, _extra(units, setting)))
        self.backward = _prefix(units.backward)
        self.params = _prefix(units.params)
        self.saved = _prefix(units.saved)
        self.kept = _prefix(units.kept)
        self.workspace = units.max_workspace
        self.largest_params = units.max_largest_params
        self.unit_saved = units.max_saved
        link = setting.pipe_link
        self.sends = [2 * cost.send_time(b, link) for b in units.out_bytes[:-1]] + [0.0, 0.0]
        self._first_fitting: dict = {}

    def send(self, b: int) -> float:
        """Forward activation and backward gradient across the cut before unit ``b`` (none after the last)."""
        return self.sends[b - 1]

    def stage_time(self, a: int, b: int) -> float:
        return self.time[b] - self.time[a] + self.sends[b - 1]

    def memory(self, a: int, b: int, stage: int) -> cost.Memory:
        s = self.setting
        params, grads, state = cost.model_state_memory(self.params[b] - self.params[a], s.sharding,
                                                       s.data_group.size, s.optimizer)
        in_flight = cost.micro_batches_in_flight(stage, s.num_stages, s.micro_batches)
        if s.checkpointing:
            activations = in_flight * (self.kept[b] - self.kept[a]) + self.unit_saved(a, b)
        else:
            activations = in_flight * (self.saved[b] - self.saved[a])
        workspace = self.workspace(a, b)
        if s.sharding == 3:
            workspace += 2 * self.largest_params(a, b)  # the gathered layer and the next one prefetched
        return cost.Memory(params, grads, state, activations, workspace, s.cluster.reserved_memory)

    def gradient_sync(self, a: int, b: int) -> float:
        s = self.setting
        backward = (self.backward[b] - self.backward[a]) * s.micro_batches
        return cost.gradient_sync_time(self.params[b] - self.params[a], s.data_group, backward, s.sharding)

    def first_fitting(self, stage: int, limit: float) -> list[int]:
        """``lo[b]``: the first unit ``a`` such that stage ``stage`` over ``[a, b)`` fits in ``limit`` bytes
        (``b`` when none does). Non-decreasing in ``b``, since a stage that fits still fits with fewer units."""
        s = self.setting
        in_flight = cost.micro_batches_in_flight(stage, s.num_stages, s.micro_batches)
        key = (in_flight, limit)
        if key not in self._first_fitting:
            self._first_fitting[key] = self._first_fitting_for(in_flight, limit)
        return self._first_fitting[key]

    def _first_fitting_for(self, in_flight: int, limit: float) -> list[int]:
        s = self.setting
        params, grads, state = cost.model_state_memory(1.0, s.sharding, s.data_group.size, s.optimizer)
        per_param = params + grads + state
        acts = self.kept if s.checkpointing else self.saved
        budget = limit - s.cluster.reserved_memory
        fsdp = 2.0 if s.sharding == 3 else 0.0

        def total(a: int, b: int) -> float:
            mem = per_param * (self.params[b] - self.params[a]) + in_flight * (acts[b] - acts[a]) + self.workspace(a, b)
            if s.checkpointing:
                mem += self.unit_saved(a, b)
            return mem + fsdp * self.largest_params(a, b) if fsdp else mem

        lo, out = 0, [0]
        for b in range(1, len(self.units) + 1):
            while lo < b and total(lo, b) > budget:
                lo += 1
            out.append(lo)
        return out


def best_cuts(costs: StageCosts, limit: float) -> tuple[int, ...] | None:
    """Units that start stages 2..k, of least pipeline time ``(m - 1) · max + sum`` of stage times
    with every stage within ``limit`` bytes; ``None`` if no cut fits.

    Exact: the bottleneck ``B`` of the best cut is one of the stage times. From the least ``B`` that
    admits a cut (a greedy cut decides that), each ``B`` in ascending order gets the least sum of stage
    times with every stage at most ``B`` (dynamic programming over units, a sliding-window minimum
    per stage), until ``(m - 1) · B`` alone exceeds the best found."""
    n, k, m = len(costs.units), costs.setting.num_stages, costs.setting.micro_batches
    if n < k:
        return None
    fitting = [costs.first_fitting(stage, limit) for stage in range(k)]
    time = np.asarray(costs.time)
    spans = time[None, 1:] - time[:-1, None] + np.asarray(costs.sends[:n])[None, :]
    bounds = np.unique(spans[np.triu_indices(n)]).tolist()
    lo, hi = 0, len(bounds)
    while lo < hi:  # the least bound that admits a cut
        mid = (lo + hi) // 2
        if _greedy(costs, bounds[mid], fitting):
            hi = mid
        else:
            lo = mid + 1
    best, best_value = None, math.inf
    floor = costs.time[n]
    for bound in bounds[lo:]:
        if (m - 1) * bound + floor >= best_value:
            break
        found = _least_sum(costs, bound, fitting)
        if found is not None and (m - 1) * bound + found[0] < best_value:
            best_value, best = (m - 1) * bound + found[0], found[1]
    return best


def _greedy(costs: StageCosts, bound: float, fitting: list[list[int]]) -> bool:
    """Can ``k`` stages, each within ``bound`` and the memory limit, cover every unit? Each stage as long
    as it may be is optimal, since a stage within the limits stays within them when it loses units."""
    n, k = len(costs.units), costs.setting.num_stages
    time, sends = costs.time, costs.sends
    a = 0
    for stage in range(k):
        lo, b = fitting[stage], a
        last = n - (k - stage - 1)
        while b < last and lo[b + 1] <= a and time[b + 1] - time[a] + sends[b] <= bound:
            b += 1
        if b == a:
            return False
        a = b
    return a == n


def _least_sum(costs: StageCosts, bound: float, fitting: list[list[int]]) -> tuple[float, tuple[int, ...]] | None:
    """Least sum of stage times over cuts whose every stage is within ``bound`` and the memory limit.

    ``g[j]`` after stage ``s``: the least sum for units ``[0, j)`` in ``s + 1`` stages. A stage
    ``[i, j)`` costs ``time[j] - time[i] + send(j)``, so ``g[j] = time[j] + send(j) + min(g_prev[i] - time[i])``
    over the ``i`` that keep it within the limits: a window that only moves right as ``j`` grows."""
    n, k = len(costs.units), costs.setting.num_stages
    time, sends = costs.time, costs.sends
    inf = math.inf
    g = [0.0] + [inf] * n
    parents = []
    for stage in range(k):
        new, parent = [inf] * (n + 1), [-1] * (n + 1)
        fit = fitting[stage]
        window: deque[int] = deque()
        i_next, lo = 0, 0
        first_j = n if stage == k - 1 else stage + 1
        for j in range(first_j, n - (k - stage - 1) + 1):
            while i_next < j:  # admit i < j
                if g[i_next] < inf:
                    v = g[i_next] - time[i_next]
                    while window and g[window[-1]] - time[window[-1]] >= v:
                        window.pop()
                    window.append(i_next)
                i_next += 1
            lo = max(lo, fit[j])
            while lo < j and time[j] - time[lo] + sends[j - 1] > bound:
                lo += 1
            while window and window[0] < lo:
                window.popleft()
            if window:
                i = window[0]
                new[j] = g[i] - time[i] + time[j] + sends[j - 1]
                parent[j] = i
        parents.append(parent)
        g = new
    if g[n] == inf:
        return None
    cuts, j = [], n
    for stage in range(k - 1, 0, -1):
        j = parents[stage][j]
        cuts.append(j)
    return g[n], tuple(reversed(cuts))

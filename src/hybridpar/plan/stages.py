"""Pipeline stages: what a stage of consecutive layers costs, and the cuts of least pipeline time.

A stage's time is that of one micro-batch through its layers (forward and backward, their
communication, the recomputation of checkpointing, FSDP's gathers) plus sending its output forward
and the gradient back. Its memory holds the model state of its layers (by ZeRO level), the
activations of the micro-batches in flight under 1F1B, the largest transient buffer and the reserve.

Stages start at *units*: the runs of layers between legal cut points (one tensor crosses, whole over
tp). Checkpointing keeps each unit's input and recomputes one unit at a time in backward.
"""

from __future__ import annotations

import bisect
import math
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
    schedule: str = "1f1b"  # how many micro-batches' activations a stage holds (cost.micro_batches_in_flight)


@dataclass(frozen=True)
class Units:
    """Per-unit sums of one chain of per-layer options (``starts[u]`` is the first layer of unit ``u``)."""

    starts: tuple[int, ...]
    time: tuple[float, ...]  # forward + backward + communication of one micro-batch
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    params: tuple[float, ...]
    param_blocks: tuple[int, ...]  # blocks with parameters (FSDP gathers each: parallelize wraps them)
    saved: tuple[float, ...]
    workspace: tuple[float, ...]  # largest in the unit
    largest_params: tuple[float, ...]  # of one layer
    kept: tuple[float, ...]  # the unit's input (what checkpointing keeps)
    out_bytes: tuple[float, ...]  # the unit's output (what a cut after it sends)

    @staticmethod
    def of(chain, starts: list[int], block_index: tuple[int | None, ...]) -> Units:
        """The units of ``chain`` starting at the layers ``starts``; ``block_index`` gives each layer's
        block (``ModelGraph.block_index``)."""
        bounds = list(zip(starts, starts[1:] + [len(chain.options)]))
        opts = chain.options
        return Units(
            tuple(starts),
            tuple(sum(chain.layer_time(i) for i in range(a, b)) for a, b in bounds),
            tuple(sum(o.forward for o in opts[a:b]) for a, b in bounds),
            tuple(sum(o.time - o.forward for o in opts[a:b]) for a, b in bounds),
            tuple(sum(o.params for o in opts[a:b]) for a, b in bounds),
            tuple(len({block_index[i] for i in range(a, b) if opts[i].params}) for a, b in bounds),
            tuple(sum(o.saved for o in opts[a:b]) for a, b in bounds),
            tuple(max(o.workspace for o in opts[a:b]) for a, b in bounds),
            tuple(max(o.params for o in opts[a:b]) for a, b in bounds),
            tuple(opts[a].in_bytes for a, _ in bounds),
            tuple(opts[b - 1].out_bytes for _, b in bounds),
        )

    def __len__(self) -> int:
        return len(self.starts)

    @cached_property
    def max_workspace(self) -> RangeMax:
        return RangeMax(self.workspace)

    @cached_property
    def max_largest_params(self) -> RangeMax:
        return RangeMax(self.largest_params)

    @cached_property
    def max_saved(self) -> RangeMax:
        return RangeMax(self.saved)

    def total_time(self, setting: StageSetting) -> float:
        """Sum of every unit's time under ``setting`` (a stage of all units, sends aside)."""
        return sum(self.time) + sum(_extra(self, setting))

    def state_memory(self, setting: StageSetting) -> float:
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

    def many(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """``self(a, b)`` elementwise where ``a < b`` (anything elsewhere)."""
        if not hasattr(self, "_padded"):
            width = len(self.table[0])
            self._padded = np.array([row + [0.0] * (width - len(row)) for row in self.table])
        span = np.maximum(b - a, 1)
        j = np.floor(np.log2(span)).astype(int)
        right = np.maximum(b - (1 << j), 0)
        return np.maximum(self._padded[j, np.minimum(a, self._padded.shape[1] - 1)], self._padded[j, right])


def _prefix(values) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _extra(units: Units, s: StageSetting) -> list[float]:
    """Time each unit adds under ``s``: the recomputed forward of checkpointing, FSDP's gathers."""
    recompute = units.forward if s.checkpointing else [0.0] * len(units)
    return [r + g for r, g in zip(recompute, _fsdp_gathers(units, s))]


def _fsdp_gathers(units: Units, s: StageSetting) -> list[float]:
    """FSDP's gathers per unit (sharding 3): one per block with parameters, before forward and backward."""
    if s.sharding != 3:
        return [0.0] * len(units)
    return [cost.fsdp_gather_time(p, s.data_group, k) for p, k in zip(units.params, units.param_blocks)]


class StageCosts:
    """Any stage of units ``[a, b)`` priced in O(1)."""

    def __init__(self, units: Units, setting: StageSetting):
        self.units, self.setting = units, setting
        self.time = _prefix(t + e for t, e in zip(units.time, _extra(units, setting)))
        self.gathers = _prefix(_fsdp_gathers(units, setting))
        self.backward = _prefix(units.backward)
        self.params = _prefix(units.params)
        self.saved = _prefix(units.saved)
        self.kept = _prefix(units.kept)
        self.workspace = units.max_workspace
        self.largest_params = units.max_largest_params
        self.unit_saved = units.max_saved
        link = setting.pipe_link
        self.sends = [2 * (cost.send_time(b, link) + link.sync_wait) for b in units.out_bytes[:-1]] + [0.0, 0.0]

    def fsdp_gathers(self, a: int, b: int) -> float:
        """FSDP's parameter gathers of units ``[a, b)`` for one micro-batch (0 without sharding 3)."""
        return self.gathers[b] - self.gathers[a]

    def send(self, b: int) -> float:
        """Forward activation and backward gradient across the cut before unit ``b`` (none after the last)."""
        return self.sends[b - 1]

    def stage_time(self, a: int, b: int) -> float:
        return self.time[b] - self.time[a] + self.sends[b - 1]

    def memory(self, a: int, b: int, stage: int) -> cost.Memory:
        s = self.setting
        params, grads, state = cost.model_state_memory(self.params[b] - self.params[a], s.sharding,
                                                       s.data_group.size, s.optimizer)
        in_flight = cost.micro_batches_in_flight(stage, s.num_stages, s.micro_batches, s.schedule)
        if s.checkpointing:
            activations = in_flight * (self.kept[b] - self.kept[a]) + self.unit_saved(a, b)
        else:
            activations = in_flight * (self.saved[b] - self.saved[a])
        workspace = self.workspace(a, b)
        if s.sharding == 3:
            workspace += 2 * self.largest_params(a, b)  # the gathered layer and the next one prefetched
        return cost.Memory(params, grads, state, activations, workspace, s.cluster.reserved_memory)

    def optimizer_step(self, a: int, b: int) -> float:
        s = self.setting
        shards = s.data_group.size if s.sharding >= 1 else 1
        return cost.optimizer_step_time((self.params[b] - self.params[a]) / shards, s.optimizer, s.cluster)

    def gradient_sync(self, a: int, b: int) -> float:
        s = self.setting
        backward = (self.backward[b] - self.backward[a]) * s.micro_batches
        return cost.gradient_sync_time(self.params[b] - self.params[a], s.data_group, backward, s.sharding)

    def fitting(self, limit: float) -> list[list[int]]:
        """``lo[stage][b]``: the first unit ``a`` such that stage ``stage`` over ``[a, b)`` fits in ``limit``
        bytes (``b`` when none does); non-decreasing in ``b``, since a stage that fits still fits with fewer
        units. The parts of memory that add up are searched (``searchsorted``); the largest-buffer parts
        then move ``a`` right until the stage fits."""
        s = self.setting
        k, n = s.num_stages, len(self.units)
        params, grads, state = cost.model_state_memory(1.0, s.sharding, s.data_group.size, s.optimizer)
        in_flight = np.array([cost.micro_batches_in_flight(t, k, s.micro_batches) for t in range(k)], dtype=float)
        acts = np.asarray(self.kept if s.checkpointing else self.saved)
        linear = (params + grads + state) * np.asarray(self.params)[None, :] + in_flight[:, None] * acts[None, :]
        budget = limit - s.cluster.reserved_memory
        lo = np.stack([np.searchsorted(row, row - budget, side="left") for row in linear])
        b = np.broadcast_to(np.arange(n + 1), lo.shape)
        rows = np.arange(k)[:, None]
        while True:
            a = np.minimum(lo, b)
            inside = a < b
            extra = np.where(inside, self.units.max_workspace.many(a, b), 0.0)
            if s.checkpointing:
                extra = extra + np.where(inside, self.units.max_saved.many(a, b), 0.0)
            if s.sharding == 3:
                extra = extra + 2 * np.where(inside, self.units.max_largest_params.many(a, b), 0.0)
            over = inside & (linear[rows, b] - linear[rows, a] + extra > budget)
            if not over.any():
                return np.minimum(lo, b).tolist()
            lo = lo + over


def best_cuts(costs: StageCosts, limit: float) -> tuple[int, ...] | None:
    """Units that start stages 2..k, of least pipeline time ``(m - 1) · max + sum`` of stage times
    with every stage within ``limit`` bytes; ``None`` if no cut fits.

    Exact: the bottleneck ``B`` of the best cut is one of the stage times. From the least ``B`` that
    admits a cut (found by bisection), each ``B`` in ascending order gets the least sum of stage
    times with every stage at most ``B`` (dynamic programming over units, a sliding-window minimum
    per stage), until ``(m - 1) · B`` alone exceeds the best found."""
    n, k, m = len(costs.units), costs.setting.num_stages, costs.setting.micro_batches
    if n < k:
        return None
    fitting = costs.fitting(limit)
    time = np.asarray(costs.time)
    spans = time[None, 1:] - time[:-1, None] + np.asarray(costs.sends[:n])[None, :]
    bounds = np.unique(spans[np.triu_indices(n)]).tolist()
    least = _least_bottleneck(costs, fitting)
    if least is None:
        return None
    lo = bisect.bisect_left(bounds, least * (1 - 1e-12))
    best, best_value = None, math.inf
    floor = costs.time[n]
    for bound in bounds[lo:]:
        if (m - 1) * bound + floor >= best_value:
            break
        found = _least_sum(costs, bound, fitting)
        if found is not None and (m - 1) * bound + found[0] < best_value:
            best_value, best = (m - 1) * bound + found[0], found[1]
    return best


def _least_bottleneck(costs: StageCosts, fitting: list[list[int]]) -> float | None:
    """The least possible time of the slowest stage over cuts that fit (``None`` if none fits):
    ``M[j] = min over i of max(M_prev[i], time of [i, j))`` per stage, for every ``(i, j)`` at once."""
    n, k = len(costs.units), costs.setting.num_stages
    time = np.asarray(costs.time)
    send = np.concatenate([[0.0], np.asarray(costs.sends[:n])])
    span = time[None, :] - time[:, None] + send[None, :]  # span[i, j]: a stage of units [i, j)
    i = np.arange(n + 1)[:, None]
    j = np.arange(n + 1)[None, :]
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    for stage in range(k):
        first = n if stage == k - 1 else stage + 1
        ok = (i < j) & (i >= np.asarray(fitting[stage])[None, :]) & (j >= first) & (j <= n - (k - stage - 1))
        best = np.where(ok, np.maximum(best[:, None], span), np.inf).min(axis=0)
    return float(best[n]) if np.isfinite(best[n]) else None


def _least_sum(costs: StageCosts, bound: float, fitting: list[list[int]]) -> tuple[float, tuple[int, ...]] | None:
    """Least sum of stage times over cuts whose every stage is within ``bound`` and the memory limit.

    ``g[j]`` after stage ``s``: the least sum for units ``[0, j)`` in ``s + 1`` stages. A stage
    ``[i, j)`` costs ``time[j] - time[i] + send(j)``, so ``g[j] = time[j] + send(j) + min(g_prev[i] - time[i])``
    over ``lo[j] <= i < j``, where ``lo[j]`` is the first start that keeps the stage within the limits;
    the minima come from a range-minimum table, for every ``j`` at once."""
    n, k = len(costs.units), costs.setting.num_stages
    time = np.asarray(costs.time)
    send = np.concatenate([[0.0], np.asarray(costs.sends[:n])])  # send[j]: the cut before unit j
    j = np.arange(n + 1)
    slack = 1e-12 * max(bound, time[n])  # `time[j] - time[i] + send[j] <= bound`, rearranged, rounds differently
    by_time = np.searchsorted(time, time + send - bound - slack, side="left")
    g = np.full(n + 1, np.inf)
    g[0] = 0.0
    parents = []
    for stage in range(k):
        lo = np.maximum(np.asarray(fitting[stage]), by_time)
        first = n if stage == k - 1 else stage + 1
        ok = (j >= first) & (j <= n - (k - stage - 1)) & (lo < j)
        best, arg = _range_min(g - time, lo, j, ok)
        new = np.where(ok, time + send + best, np.inf)
        parents.append(arg)
        g = new
    if not np.isfinite(g[n]):
        return None
    cuts, at = [], n
    for stage in range(k - 1, 0, -1):
        at = int(parents[stage][at])
        cuts.append(at)
    return float(g[n]), tuple(reversed(cuts))


def _range_min(h: np.ndarray, lo: np.ndarray, hi: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Minimum of ``h[lo[j]:hi[j]]`` and where it is, for every ``j`` with ``ok[j]`` (a sparse table)."""
    levels = [np.arange(len(h))]
    width = 1
    while 2 * width <= len(h):
        prev = levels[-1]
        left, right = prev[: len(prev) - width], prev[width:]
        levels.append(np.where(h[right] < h[left], right, left))
        width *= 2
    span = np.where(ok, hi - lo, 1)
    level = np.floor(np.log2(span)).astype(int)
    a = np.where(ok, lo, 0)
    b = np.where(ok, hi - (1 << level), 0)
    table = np.zeros((len(levels), len(h)), dtype=int)
    for i, row in enumerate(levels):
        table[i, : len(row)] = row
    left, right = table[level, a], table[level, b]
    arg = np.where(h[right] < h[left], right, left)
    return np.where(ok, h[arg], np.inf), arg

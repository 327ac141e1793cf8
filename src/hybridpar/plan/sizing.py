"""Work sized to each device's speed: a slow or an older device gets fewer samples (uneven data-parallel
``shares``) or a thinner slab (``slabs`` weights), so that the ranks of a synchronous step finish together
(Asteroid and HierTrain over mixed devices; ResiHP re-partitioning around a slow one). Pure: the planner sizes a
heterogeneous cluster's plan with it, and the runtime a slowed rank's (``hybridpar.train.pace``), by one rule.

A rank's *work* is its share of a step relative to the even split's (1 on every rank of an even plan): its
replica's share of the batch times its slab's share of the volume, and in a pipeline its stage's share of the
model's FLOPs (``Layers``); its *speed* is relative too (1: the reference device). The compute of a synchronous
step goes as the slowest rank's work over its speed. A pipeline's slow rank gets a stage of fewer layers: the
stage boundaries that minimise the slowest stage's FLOPs over its speed, among the cuts the model allows.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, replace

from hybridpar.errors import PlanError
from hybridpar.ir.types import Plan

WEIGHT_SCALE = 1000  # weights are whole numbers: speeds to three digits
MIN_GAIN = 0.05  # a new split must cut the predicted step by this fraction: no re-plan for a rounding's worth


@dataclass(frozen=True)
class Layers:
    """What sizing knows of a model for its pipeline stages: each layer's forward FLOPs and name, and the layers
    a stage may start at (after the first: ``ModelGraph.stage_starts``)."""

    flops: tuple[float, ...]
    names: tuple[str, ...]
    starts: tuple[int, ...]

    @staticmethod
    def of(graph) -> Layers:
        return Layers(tuple(layer.flops for layer in graph.layers), tuple(layer.name for layer in graph.layers),
                      tuple(graph.stage_starts))

    def stage_work(self, plan: Plan) -> tuple[float, ...]:
        """Each pp rank's share of the FLOPs relative to an even share (its stages', under interleaved 1F1B)."""
        unknown = [name for name in plan.stages if name not in self.names]
        if unknown:
            raise PlanError(f"stage boundary {unknown[0]!r} is no layer of the model")
        bounds = [0, *(self.names.index(name) for name in plan.stages), len(self.flops)]
        stages = [sum(self.flops[a:b]) for a, b in zip(bounds, bounds[1:])]
        per_rank = [sum(stages[s] for s in range(r, len(stages), plan.pp)) for r in range(plan.pp)]
        mean = sum(per_rank) / plan.pp
        return tuple(w / mean if mean else 1.0 for w in per_rank)


def rank_work(plan: Plan, rank: int, layers: Layers | None = None) -> float:
    """Global rank ``rank``'s work under ``plan`` (its slab of a sample of ``plan.input_shape``; with ``layers``,
    its pipeline stage's share of the FLOPs)."""
    at = plan.dims.coords(rank)
    start, stop = plan.batch_rows(at["dp"])
    work = (stop - start) * plan.dp / plan.global_batch
    if plan.dims.num_spatial > 1:
        spatial_shape = plan.input_shape[2:]
        slab = plan.grid.slab(spatial_shape, at["spatial"])
        work *= math.prod(hi - lo for lo, hi in slab) * plan.dims.num_spatial / math.prod(spatial_shape)
    if layers is not None and plan.pp > 1:
        work *= layers.stage_work(plan)[at["pp"]]
    return work


def step_time(plan: Plan, speeds: tuple[float, ...], layers: Layers | None = None) -> float:
    """The compute of one step relative to the even plan's on reference devices: the slowest rank's work over
    its speed."""
    return max(rank_work(plan, r, layers) / s for r, s in enumerate(speeds))


def weights(speeds) -> tuple[int, ...]:
    """Whole-number weights in proportion to ``speeds`` (the fastest gets ``WEIGHT_SCALE``)."""
    fastest = max(speeds)
    out = [max(1, round(WEIGHT_SCALE * s / fastest)) for s in speeds]
    common = math.gcd(*out)
    return tuple(w // common for w in out)


def sized(plan: Plan, speeds: tuple[float, ...], accept=lambda p: True, layers: Layers | None = None) -> Plan:
    """``plan`` with its work sized to the ranks' ``speeds``: of the even split, uneven shares, uneven slabs and
    both (and, with ``layers``, a pipeline's stages moved), the one ``accept`` allows (the runtime's rules) with
    the least ``step_time``; ``plan`` itself where that gains less than ``MIN_GAIN``."""
    even = replace(plan, shares=(), slabs=())
    candidates = [even]
    if layers is not None and plan.pp > 1 and plan.schedule != "interleaved-1f1b":
        candidates.append(_with_stages(even, speeds, layers))
    slabs = _slab_weights(even, speeds) if even.dims.num_spatial > 1 else ()
    if slabs:
        candidates.append(replace(even, slabs=slabs))
    if plan.dp > 1 and plan.pp == 1 and plan.global_batch >= plan.dp:
        candidates += [_with_shares(p, speeds) for p in list(candidates)]
    allowed = [p for p in candidates if p == even or accept(p)]
    best = min(allowed, key=lambda p: step_time(p, speeds, layers))  # the first (the simplest) on ties
    return best if step_time(best, speeds, layers) < (1 - MIN_GAIN) * step_time(plan, speeds, layers) else plan


def _slab_weights(plan: Plan, speeds) -> tuple[tuple[int, ...], ...]:
    """Per spatial dim, each part's weight: the least speed of the ranks holding that part."""
    grid, dims = plan.grid, plan.dims
    part_speed = [[math.inf] * p for p in grid.parts]
    for rank, speed in enumerate(speeds):
        for axis, c in enumerate(grid.coords(dims.coords(rank)["spatial"])):
            part_speed[axis][c] = min(part_speed[axis][c], speed)
    return tuple(weights(s) if len(s) > 1 else () for s in part_speed)


def _with_shares(plan: Plan, speeds) -> Plan:
    """``plan`` with the batch shared among the replicas so that the slowest finishes first: each replica's speed
    is its slowest rank's speed over that rank's work, and each sample goes, one at a time, where it ends
    soonest (at least one sample per replica; for whole samples this minimises the slowest replica's time)."""
    replica = [math.inf] * plan.dp
    for rank, speed in enumerate(speeds):
        dp = plan.dims.coords(rank)["dp"]
        replica[dp] = min(replica[dp], speed / rank_work(plan, rank))
    shares = [1] * plan.dp
    ends = [(2 / s, r) for r, s in enumerate(replica)]  # when each replica would end with one sample more
    heapq.heapify(ends)
    for _ in range(plan.global_batch - plan.dp):
        _, r = heapq.heappop(ends)
        shares[r] += 1
        heapq.heappush(ends, ((shares[r] + 1) / replica[r], r))
    return replace(plan, shares=tuple(shares))


def _with_stages(plan: Plan, speeds, layers: Layers) -> Plan:
    """``plan`` (one stage per pp rank) with the stage boundaries that minimise the slowest stage's FLOPs over its
    pp rank's speed (its slowest rank's, over that rank's other work), among ``layers.starts``."""
    pp_speed = [math.inf] * plan.pp
    for rank, speed in enumerate(speeds):
        k = plan.dims.coords(rank)["pp"]
        pp_speed[k] = min(pp_speed[k], speed / rank_work(plan, rank))
    total = [0.0]
    for f in layers.flops:
        total.append(total[-1] + f)
    points = [0, *sorted(set(layers.starts)), len(layers.flops)]
    # best[k][j]: the least slowest-stage time of stages 0..k-1 covering layers [0, points[j]), and its cuts
    best = [{0: (0.0, ())}]
    for k in range(plan.pp):
        last = k == plan.pp - 1
        row = {}
        for j in ([len(points) - 1] if last else range(1, len(points) - 1)):
            options = [(max(t, (total[points[j]] - total[points[i]]) / pp_speed[k]), cuts + ((points[i],) if i else ()))
                       for i, (t, cuts) in best[k].items() if i < j]
            if options:
                row[j] = min(options)
        best.append(row)
    if not best[plan.pp]:
        return plan
    _, cuts = best[plan.pp][len(points) - 1]
    return replace(plan, stages=tuple(layers.names[c] for c in cuts))

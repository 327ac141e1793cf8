"""The search: every mesh of the search space (``plan.space``), then per-layer tp strategies by dynamic
programming along the layer chain (``plan.chains``), pipeline stage cuts, micro-batch count, ZeRO level and
activation checkpointing, under the per-device memory limit, candidates in the order of a lower bound of their
step time (``plan.pricing``). ``price`` prices one fully specified candidate; the search, ``validate`` and the
brute-force oracle of the tests all call it, so they rank by the same numbers.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field

from hybridpar.dims import ParallelDims
from hybridpar.errors import PlanError
from hybridpar.ir import rules
from hybridpar.ir.check import check
from hybridpar.ir.graph import ModelGraph
from hybridpar.ir.rules import check_grid
from hybridpar.ir.types import Plan
from hybridpar.plan.cluster import ClusterSpec
from hybridpar.plan.pricing import Candidate, Problem, evaluate, layer_floor, mesh_floor, settings_of
from hybridpar.plan.space import Constraints, family, meshes

EXPLAINED = 2.0  # families of strategies whose best is within this factor of the fastest are priced exactly


@dataclass
class SearchResult:
    plans: list[Plan]  # fastest first, one per mesh
    rejected: dict[str, str] = field(default_factory=dict)  # family of strategies -> why it lost or did not fit
    num_candidates: int = 0
    closest: str = ""  # when nothing fits: the candidate that came nearest to the memory limit
    sized: tuple = ()  # on a mixed cluster: each plan's sizing (``mixed.Sized``: the even plan, speeds, work)


def search(graph: ModelGraph, cluster: ClusterSpec, c: Constraints) -> SearchResult:
    """Ranked plans for ``cluster.num_devices`` devices, fastest first (one per mesh), and for every
    family of strategies (``dp``, ``dp x spatial``, ``dp x tp x pp``, ...) why it lost or did not fit.

    Candidates are priced in the order of a lower bound of their step time, and one whose bound can neither
    beat the ``top``-th plan found nor its family's best within ``EXPLAINED`` times the fastest is not priced
    further: each family's best (what ``rejected`` shows) is exact or "``EXPLAINED``x the fastest or slower",
    whatever ``top`` is. A mesh's bound is first that of its heaviest layer alone;
    a mesh that may still win gets the bounds of its candidates (a stage as fast as an even split of its least
    chain of per-layer strategies)."""
    world = cluster.num_devices
    all_meshes = [d for d in meshes(world, graph, c, cluster.devices_per_node)
                  if c.families is None or family(d) in c.families]
    if not all_meshes:
        raise PlanError(_no_mesh_message(world, graph, c))
    p, log = Problem(graph, cluster, c), _Log()
    runnable = _runnable(graph, all_meshes, log)
    heaviest = max(graph.layers, key=lambda layer: layer.flops)
    order = itertools.count()
    # a heap of (lower bound of step time, order, dims, a Setting or None for all of the mesh's)
    pending = [(layer_floor(p, heaviest, dims, c.global_batch // dims.dp), next(order), dims, None)
               for dims in runnable]
    heapq.heapify(pending)
    found: list[Candidate] = []
    best_per_mesh: dict[ParallelDims, float] = {}
    while pending:
        bound, _, dims, setting = heapq.heappop(pending)
        beat = _threshold(c.top, best_per_mesh, log.best.get(family(dims), math.inf))
        if bound >= beat:
            log.skipped.add(family(dims))
            continue
        if setting is None:
            # the replica's batch in one micro-batch, every split allowed: a lower bound for any sharding.
            # Every cost is affine in the micro-batch with a non-negative constant, so one micro-batch of
            # 1/m of the samples takes at least 1/m of the time.
            floor = mesh_floor(p, dims, c.global_batch // dims.dp)
            for s in settings_of(c, dims, graph):
                m = s.micro_batches
                heapq.heappush(pending, (floor.bound(m, dims.pp, s.checkpointing, 1 / m), next(order), dims, s))
            continue
        if dims in best_per_mesh and bound >= best_per_mesh[dims]:
            continue
        cand = evaluate(p, dims, setting, min(beat, best_per_mesh.get(dims, math.inf)))
        if cand.plan is None:
            if cand.reason:
                log.fail(dims, cand.reason, cand.memory)
            else:
                log.skipped.add(family(dims))
            continue
        found.append(cand)
        best_per_mesh[dims] = min(best_per_mesh.get(dims, math.inf), cand.step_time)
        log.best[family(dims)] = min(log.best.get(family(dims), math.inf), cand.step_time)
    found.sort(key=lambda x: (x.step_time, x.memory, tuple(-n for n in x.dims.spatial)))
    best: dict[ParallelDims, Plan] = {}
    for cand in found:
        best.setdefault(cand.dims, cand.plan)  # each mesh's fastest
    plans = list(best.values())[:c.top]
    for plan in plans:  # what the search proposes is what the runtime runs: the IR's one check, as theirs
        check(plan, graph)
    total = sum(len(settings_of(c, dims, graph)) for dims in runnable)
    return SearchResult(plans, log.explain(found), total, log.closest[1])


def _threshold(top: int, best_per_mesh: dict[ParallelDims, float], family_best: float) -> float:
    """What a candidate's lower bound must stay under to be priced: the ``top``-th mesh's time, or its family's
    best while that is within ``EXPLAINED`` times the fastest."""
    times = sorted(best_per_mesh.values())
    top_time = times[top - 1] if len(times) >= top else math.inf
    fastest = times[0] if times else math.inf
    return max(top_time, min(family_best, EXPLAINED * fastest))


def _runnable(graph: ModelGraph, all_meshes: list[ParallelDims], log: _Log) -> list[ParallelDims]:
    """The meshes whose spatial grid the model splits into, and without pipelines where a batch norm refuses
    them; the others logged with why."""
    out = []
    for dims in all_meshes:
        try:
            check_grid(graph, dims.spatial)
        except PlanError as err:
            log.fail(dims, f"spatial grid {'x'.join(map(str, dims.spatial))}: {err}")
            continue
        refused = rules.pipeline_norm_refusal(graph, dims.pp) if dims.pp > 1 else None  # the search's pipelines
        if refused:  # take at least one micro-batch per stage
            log.fail(dims, f"pp={dims.pp}: {refused}")
            continue
        out.append(dims)
    return out


class _Log:
    """Why each family of strategies lost: its best plan, or the failure nearest to fitting."""

    def __init__(self):
        self.failures: dict[str, tuple[float, str]] = {}  # family -> the failure nearest to fitting
        self.closest: tuple[float, str] = (math.inf, "")
        self.best: dict[str, float] = {}  # family -> its fastest step time priced
        self.skipped: set[str] = set()  # families with candidates that could not come within EXPLAINED x the fastest

    def fail(self, dims: ParallelDims, reason: str, memory: float = math.inf) -> None:
        name = family(dims)
        if name not in self.failures or memory < self.failures[name][0]:
            self.failures[name] = (memory, reason)
        if memory < self.closest[0]:
            self.closest = (memory, reason)

    def explain(self, found: list[Candidate]) -> dict[str, str]:
        out: dict[str, str] = {}
        fastest = found[0].step_time if found else math.inf
        for cand in found:
            name = family(cand.dims)
            if name in out:
                continue
            if cand.step_time < EXPLAINED * fastest:
                ratio = f" ({cand.step_time / fastest:.2f}x the fastest)" if cand is not found[0] else ""
                out[name] = f"best {cand.plan.describe()}: {cand.step_time * 1e3:.4g} ms per step{ratio}"
        slow = f"{EXPLAINED:g}x the fastest or slower ({EXPLAINED * fastest * 1e3:.4g} ms per step or more)"
        for name in [family(cand.dims) for cand in found] + sorted(self.skipped):
            out.setdefault(name, slow)
        for name, (_, reason) in self.failures.items():
            out.setdefault(name, reason)
        return out


def _no_mesh_message(world: int, graph: ModelGraph, c: Constraints) -> str:
    fixed = any(v is not None for v in (c.dp, c.spatial, c.tp, c.pp))
    kinds = f"as {' or '.join(c.families)}" if c.families else "as dp x spatial x tp x pp"
    return (f"no way to arrange {world} device{'s' if world > 1 else ''} {kinds} with global batch "
            f"{c.global_batch}{' and the degrees you fixed' if fixed else ''}; use a global batch divisible by "
            f"more of the device count's factors{', or fix fewer degrees' if fixed else ''}")


__all__ = ["SearchResult", "search"]

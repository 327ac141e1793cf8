"""The search: every mesh factorisation, then per-layer tp strategies by dynamic programming along the
layer chain, pipeline stage cuts, micro-batch count, ZeRO level and activation checkpointing, under the
per-device memory limit. ``evaluate`` prices one fully specified candidate; the search and the
brute-force oracle of the tests both call it, so they rank by the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridpar.errors import PlanError
from hybridpar.plan import cost
from hybridpar.plan.cluster import ClusterSpec
from hybridpar.plan.graph import ModelGraph
from hybridpar.plan.layers import R, MeshContext, Option, check_grid, layer_options, transition
from hybridpar.plan.stages import StageCosts, StageSetting, Units, best_cuts
from hybridpar.plan.types import Plan, Prediction

SHARDING_LEVELS = (0, 1, 2, 3)


@dataclass(frozen=True)
class Constraints:
    """What the user fixes or limits; ``None`` leaves a choice to the search."""

    global_batch: int
    dtype: str = "float32"
    optimizer: str = "adam"
    dp: int | None = None
    spatial: tuple[int, ...] | None = None
    tp: int | None = None
    pp: int | None = None
    sharding: tuple[int, ...] = SHARDING_LEVELS
    checkpointing: tuple[bool, ...] = (False, True)
    max_micro_batches: int = 8  # per pipeline stage: m runs from pp to this many times pp
    overlap_halo: bool = True
    top: int = 5


@dataclass(frozen=True)
class Candidate:
    """One point of the search space, with its verdict: ``plan`` if it fits, ``reason`` if not."""

    mesh: tuple  # (dp, grid, tp, pp)
    micro_batches: int
    sharding: int
    checkpointing: bool
    step_time: float = math.inf
    memory: float = math.inf
    plan: Plan | None = None
    reason: str = ""


@dataclass
class SearchResult:
    plans: list[Plan]
    rejected: dict[str, str] = field(default_factory=dict)  # family of strategies -> why it lost or did not fit
    num_candidates: int = 0


# --- mesh factorisations --------------------------------------------------------------------------

def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def grids(parts: int, ndim: int) -> list[tuple[int, ...]]:
    """Every way to split ``parts`` over ``ndim`` spatial dims."""
    if ndim == 0:
        return [()] if parts == 1 else []
    if ndim == 1:
        return [(parts,)]
    return [(d,) + rest for d in divisors(parts) for rest in grids(parts // d, ndim - 1)]


def meshes(world: int, graph: ModelGraph, c: Constraints) -> list[tuple[int, tuple[int, ...], int, int]]:
    """``(dp, grid, tp, pp)`` with ``dp * prod(grid) * tp * pp == world`` that the constraints allow."""
    ndim = graph.spatial_ndim
    out = []
    for pp in divisors(world):
        for tp in divisors(world // pp):
            for dp in divisors(world // (pp * tp)):
                s = world // (pp * tp * dp)
                if c.global_batch % dp or any(v is not None and v != x for v, x in ((c.dp, dp), (c.tp, tp),
                                                                                   (c.pp, pp))):
                    continue
                options = grids(s, ndim) if ndim else ([()] if s == 1 else [])
                for grid in options:
                    full = grid or (1,)
                    if c.spatial is not None and tuple(c.spatial) != full:
                        continue
                    out.append((dp, full, tp, pp))
    return out


def micro_batch_counts(per_replica: int, pp: int, c: Constraints) -> list[int]:
    if pp == 1:
        return [1]
    return [m for m in divisors(per_replica) if pp <= m <= c.max_micro_batches * pp]


# --- per-layer strategies ------------------------------------------------------------------------

def _context(cluster: ClusterSpec, c: Constraints, dp: int, grid: tuple[int, ...], tp: int,
             micro_batch: int) -> MeshContext:
    s = math.prod(grid)
    return MeshContext(cluster, c.dtype, grid, tp, micro_batch, cost.Group.of(cluster, s, tp),
                       cost.Group.of(cluster, tp, 1), cost.Group.of(cluster, dp * s, tp), c.overlap_halo)


@dataclass(frozen=True)
class Chain:
    """The per-layer choice for one mesh: an option per layer, the redistribution time paid before
    each layer, and the tp layout after each layer."""

    options: tuple[Option, ...]
    redistribution: tuple[float, ...]
    layouts: tuple[str, ...]

    def layer_time(self, i: int) -> float:
        return self.options[i].time + self.redistribution[i]


def best_chain(graph: ModelGraph, ctx: MeshContext, cache: dict | None = None) -> Chain:
    """Per-layer tp strategies of least time (then least memory), by dynamic programming over the
    layout (R, S, P) of the activation between consecutive layers. Exact: every assignment the
    layouts allow is considered, with the redistribution between layers priced by ``transition``.

    Outputs that must be whole (``forced_replicated``) cut the chain into segments that start and end
    in layout R; a segment is solved once per sequence of layer signatures (the blocks of a GPT share one)."""
    cache = {} if cache is None else cache
    picks: list[tuple[Option, float]] = []
    for start, stop, kind in graph.segments:
        key = ("segment", ctx, kind)
        if key not in cache:
            cache[key] = _segment(graph, graph.layers[start:stop], ctx, cache)
        picks.extend(cache[key])
    return _assemble(picks, graph.forced_replicated)


def _segment(graph: ModelGraph, layers, ctx: MeshContext, cache: dict) -> tuple[tuple[Option, float], ...]:
    """(option, redistribution paid before the layer) per layer of a segment from layout R to R."""
    best: dict[str, tuple[float, float, tuple]] = {R: (0.0, 0.0, ())}
    last = layers[-1].index
    for layer in layers:
        i = layer.index
        chained = i > 0 and (i - 1) in layer.inputs and i != layers[0].index
        options = _options(layer, graph, ctx, layer.inputs == (i - 1,), cache)
        nxt: dict[str, tuple[float, float, tuple]] = {}
        for k, opt in enumerate(options):
            for layout, (t, mem, path) in best.items():
                move = 0.0
                if chained and layout != opt.layout_in:
                    move = transition(layout, opt.layout_in, opt.in_bytes, ctx.tp_group)
                elif not chained and opt.layout_in != R and layer.kind != "embedding":
                    move = transition(R, opt.layout_in, opt.in_bytes, ctx.tp_group)
                out, fix = opt.layout_out, 0.0
                if i == last and out != R:
                    fix, out = transition(out, R, opt.out_bytes, ctx.tp_group), R
                value = (t + move + fix + opt.time, mem + opt.params + opt.saved)
                if math.isinf(value[0]):
                    continue
                if out not in nxt or value < nxt[out][:2]:
                    nxt[out] = (*value, (path, opt, move + fix))
        best = nxt
    path, picks = best[R][2], []
    while path:
        path, opt, paid = path
        picks.append((opt, paid))
    return tuple(reversed(picks))


def _options(layer, graph, ctx, chain_only, cache: dict) -> tuple[Option, ...]:
    """Options of a layer, priced once per signature (the 96 blocks of a GPT share theirs)."""
    key = (layer.signature, ctx, chain_only)
    if key not in cache:
        cache[key] = layer_options(layer, graph, ctx, chain_only)
    return cache[key]


def _assemble(picks, forced) -> Chain:
    options = tuple(opt for opt, _ in picks)
    layouts = tuple(R if i in forced else opt.layout_out for i, opt in enumerate(options))
    return Chain(options, tuple(paid for _, paid in picks), layouts)


# --- whole candidates ------------------------------------------------------------------------------

def _setting(cluster, c, mesh, m, z, ckpt) -> StageSetting:
    dp, grid, tp, pp = mesh
    s = math.prod(grid)
    return StageSetting(cluster, pp, m, z, ckpt, c.optimizer, cost.Group.of(cluster, dp * s, tp),
                        cost.Group.of(cluster, pp, dp * s * tp).link)


def legal_starts(graph: ModelGraph, chain: Chain) -> list[int]:
    """Layers a stage may start at: 0, and after each legal cut point whose activation is whole over tp."""
    return [0] + [i + 1 for i in graph.cut_points if chain.layouts[i] == R]


def price(graph: ModelGraph, cluster: ClusterSpec, c: Constraints, mesh, m: int, z: int, ckpt: bool,
          chain: Chain, cuts: tuple[int, ...]) -> tuple[float, list[cost.Memory], dict]:
    """Step time, memory per stage and exposed communication by kind of one fully specified candidate;
    ``cuts`` are the layers that start stages 2..pp (legal starts only)."""
    starts = legal_starts(graph, chain)
    units = Units.of(chain, starts)
    costs = StageCosts(units, _setting(cluster, c, mesh, m, z, ckpt))
    index = [starts.index(b) for b in cuts]
    bounds = list(zip([0] + index, index + [len(units)]))
    times = [costs.stage_time(a, b) for a, b in bounds]
    sync = max(costs.gradient_sync(a, b) for a, b in bounds)
    step = cost.pipeline_time(times, m) + sync
    memory = [costs.memory(a, b, k) for k, (a, b) in enumerate(bounds)]
    slowest = max(bounds, key=lambda ab: costs.stage_time(*ab))
    layers = (starts[slowest[0]], starts[slowest[1]] if slowest[1] < len(starts) else len(chain.options))
    return step, memory, _communication(chain, costs, layers, costs.send(slowest[1]), m, sync)


def _communication(chain: Chain, costs: StageCosts, layers, send: float, m: int, sync: float) -> dict:
    """Exposed communication per step on the slowest stage, by kind."""
    out: dict[str, float] = {}
    for i in range(*layers):
        for kind, t in chain.options[i].comm.items():
            out[kind] = out.get(kind, 0.0) + t * m
        if chain.redistribution[i]:
            out["tp"] = out.get("tp", 0.0) + chain.redistribution[i] * m
    s = costs.setting
    if s.sharding == 3:
        out["fsdp"] = sum(cost.fsdp_gather_time(o.params, s.data_group) for o in chain.options[slice(*layers)]) * m
    out["pipeline"] = send * m
    out["gradients"] = sync
    return {k: v for k, v in out.items() if v}


def search(graph: ModelGraph, cluster: ClusterSpec, c: Constraints) -> SearchResult:
    """Ranked plans for ``cluster.num_devices`` devices, fastest first (one per mesh)."""
    world, limit = cluster.num_devices, cluster.device_memory
    all_meshes = meshes(world, graph, c)
    if not all_meshes:
        raise PlanError(_no_mesh_message(world, graph, c))
    rejected: dict[str, str] = {}
    cache: dict = {}
    pending = []  # (lower bound of step time, candidate parts)
    for mesh in all_meshes:
        dp, grid, tp, pp = mesh
        try:
            check_grid(graph, grid)
        except PlanError as err:
            rejected.setdefault(_family(mesh), f"spatial grid {'x'.join(map(str, grid))}: {err}")
            continue
        per_replica = c.global_batch // dp
        for m in micro_batch_counts(per_replica, pp, c):
            units = _units(graph, cluster, c, mesh, per_replica // m, cache)
            if units is None:
                rejected.setdefault(_family(mesh), f"pp={pp}: the model has fewer places to cut than stages")
                continue
            for z in (c.sharding if dp * math.prod(grid) > 1 else (0,)):
                for ckpt in c.checkpointing:
                    setting = _setting(cluster, c, mesh, m, z, ckpt)
                    if units[1].state_memory(setting) > limit:
                        rejected.setdefault(_family(mesh), _state_too_big(units[1], setting, mesh, limit))
                        continue
                    total = units[1].total_time(setting)
                    bottleneck = max(total / pp, max(units[1].time))
                    pending.append(((m - 1) * bottleneck + total, mesh, m, z, ckpt, units, setting))
    pending.sort(key=lambda p: p[0])
    found: list[Candidate] = []
    best_per_mesh: dict = {}
    for bound, mesh, m, z, ckpt, units, setting in pending:
        if len(best_per_mesh) >= c.top and bound >= sorted(best_per_mesh.values())[c.top - 1]:
            rejected.setdefault(_family(mesh), f"slower: at least {bound * 1e3:.4g} ms per step")
            continue
        if mesh in best_per_mesh and bound >= best_per_mesh[mesh]:
            continue
        cand = _candidate(graph, cluster, c, mesh, m, z, ckpt, units, StageCosts(units[1], setting), limit)
        if cand.plan is None:
            rejected.setdefault(_family(mesh), cand.reason)
            continue
        found.append(cand)
        best_per_mesh[mesh] = min(best_per_mesh.get(mesh, math.inf), cand.step_time)
    found.sort(key=lambda x: (x.step_time, x.memory))
    plans, seen = [], set()
    for cand in found:
        if cand.mesh not in seen and len(plans) < c.top:
            plans.append(cand.plan)
            seen.add(cand.mesh)
        family = _family(cand.mesh)
        if not plans or cand.plan is not plans[0]:
            rejected.setdefault(family, f"best {cand.plan.describe()}: {cand.step_time * 1e3:.4g} ms per step")
    return SearchResult(plans, rejected, len(pending))


def _units(graph, cluster, c, mesh, micro_batch, cache):
    """(chain, units) of a mesh and micro-batch size, or ``None`` if it cannot be cut into ``pp`` stages."""
    dp, grid, tp, pp = mesh
    ctx = _context(cluster, c, dp, grid, tp, micro_batch)
    key = ("units", ctx)
    if key not in cache:
        chain = best_chain(graph, ctx, cache)
        cache[key] = (chain, Units.of(chain, legal_starts(graph, chain)))
    chain, units = cache[key]
    return None if len(units) < pp else (chain, units)


def _family(mesh) -> str:
    dp, grid, tp, pp = mesh
    parts = [name for name, on in (("dp", dp > 1), ("spatial", math.prod(grid) > 1), ("tp", tp > 1),
                                   ("pp", pp > 1)) if on]
    return " x ".join(parts) or "one device"


def _candidate(graph, cluster, c, mesh, m, z, ckpt, units, costs, limit) -> Candidate:
    chain, unit_table = units
    if mesh[3] == 1:
        cuts = ()
    else:
        index = best_cuts(costs, limit)
        if index is None:
            return Candidate(mesh, m, z, ckpt, reason=_too_big(costs, mesh, m, z, ckpt, limit))
        cuts = tuple(unit_table.starts[u] for u in index)
    step, memory, comm = price(graph, cluster, c, mesh, m, z, ckpt, chain, cuts)
    peak = max(mem.total for mem in memory)
    if peak > limit:
        return Candidate(mesh, m, z, ckpt, reason=_too_big(costs, mesh, m, z, ckpt, limit, memory))
    plan = _plan(graph, cluster, c, mesh, m, z, ckpt, chain, cuts, step, memory, comm)
    return Candidate(mesh, m, z, ckpt, step, peak, plan)


def _state_too_big(units: Units, setting: StageSetting, mesh, limit) -> str:
    dp, grid, tp, pp = mesh
    return (f"dp={dp} spatial={'x'.join(map(str, grid))} tp={tp} pp={pp} zero={setting.sharding}: parameters, "
            f"gradients and optimizer state alone need {units.state_memory(setting) / 2**30:.3g} GiB per device "
            f"> {limit / 2**30:.3g} GiB")


def _too_big(costs, mesh, m, z, ckpt, limit, memory=None) -> str:
    memory = memory or [costs.memory(0, len(costs.units), 0)]
    worst = max(memory, key=lambda mem: mem.total)
    parts = ", ".join(f"{k} {v / 2**30:.3g}" for k, v in worst.as_dict().items() if k != "total" and v)
    dp, grid, tp, pp = mesh
    return (f"dp={dp} spatial={'x'.join(map(str, grid))} tp={tp} pp={pp} m={m} zero={z}"
            f"{' ckpt' if ckpt else ''} needs {worst.total / 2**30:.3g} GiB per device ({parts}) "
            f"> {limit / 2**30:.3g} GiB")


def _plan(graph, cluster, c, mesh, m, z, ckpt, chain, cuts, step, memory, comm) -> Plan:
    dp, grid, tp, pp = mesh
    worst = max(memory, key=lambda mem: mem.total)
    compute = sum(o.time - sum(o.comm.values()) for o in chain.options) * m
    prediction = Prediction(step, compute, worst.as_dict(), comm, c.global_batch / step if step else 0.0)
    layers = tuple((graph.layers[i].name, o.strategy) for i, o in enumerate(chain.options)
                   if o.strategy != "replicate")
    return Plan(dp=dp, spatial=grid, tp=tp, pp=pp, global_batch=c.global_batch, micro_batches=m, sharding=z,
                checkpointing=ckpt, stages=tuple(graph.layers[b].name for b in cuts), layers=layers,
                optimizer=c.optimizer, dtype=c.dtype, input_shape=(c.global_batch,) + graph.input_shape[1:],
                cluster=cluster.name, prediction=prediction)


def _no_mesh_message(world: int, graph: ModelGraph, c: Constraints) -> str:
    fixed = any(v is not None for v in (c.dp, c.spatial, c.tp, c.pp))
    return (f"no way to arrange {world} devices as dp x spatial x tp x pp with global batch {c.global_batch}"
            f"{' and the degrees you fixed' if fixed else ''}; use a global batch divisible by more of the "
            f"device count's factors{', or fix fewer degrees' if fixed else ''}")

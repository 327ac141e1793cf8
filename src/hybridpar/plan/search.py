"""The search: every mesh factorisation, then per-layer tp strategies by dynamic programming along the
layer chain, pipeline stage cuts, micro-batch count, ZeRO level and activation checkpointing, under the
per-device memory limit. ``evaluate`` prices one fully specified candidate; the search and the
brute-force oracle of the tests both call it, so they rank by the same numbers.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from dataclasses import dataclass, field

from hybridpar.errors import PlanError
from hybridpar.plan import cost, rules
from hybridpar.plan.cluster import ClusterSpec
from hybridpar.plan.graph import ModelGraph
from hybridpar.plan.options import MeshContext, Option, R, S, check_grid, layer_options, redistribution, strategies
from hybridpar.plan.stages import StageCosts, StageSetting, Units, best_cuts
from hybridpar.plan.types import Plan, Prediction

SHARDING_LEVELS = (0, 1, 2, 3)

FAMILY_ORDER = ("dp", "spatial", "tp", "pp")  # the order of the kinds of parallelism in a family's name
ONE_DEVICE = "one device"  # the family of a plan that uses none


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
    max_tp: int | None = None  # largest tp degree; None: one node's devices (tp groups stay inside a node)
    top: int = 5
    families: tuple[str, ...] | None = None  # only these families, e.g. ("dp", "dp x spatial"); None: all


@dataclass(frozen=True)
class Candidate:
    """One point of the search space, with its verdict: ``plan`` if it fits; ``reason`` if not (and the
    memory it needs); neither if it was not priced because ``bound`` (a lower bound of its step time)
    could not win."""

    mesh: tuple  # (dp, grid, tp, pp)
    micro_batches: int
    sharding: int
    checkpointing: bool
    step_time: float = math.inf
    memory: float = math.inf
    plan: Plan | None = None
    reason: str = ""
    bound: float = 0.0


@dataclass
class SearchResult:
    plans: list[Plan]  # fastest first, one per mesh
    rejected: dict[str, str] = field(default_factory=dict)  # family of strategies -> why it lost or did not fit
    num_candidates: int = 0
    closest: str = ""  # when nothing fits: the candidate that came nearest to the memory limit


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


def meshes(world: int, graph: ModelGraph, c: Constraints,
           cluster_devices_per_node: int) -> list[tuple[int, tuple[int, ...], int, int]]:
    """``(dp, grid, tp, pp)`` with ``dp * prod(grid) * tp * pp == world`` that the constraints allow."""
    ndim = graph.spatial_ndim
    max_tp = c.max_tp or cluster_devices_per_node
    out = []
    for pp in divisors(world):
        for tp in [t for t in divisors(world // pp) if t <= max_tp or t == c.tp]:
            for dp in divisors(world // (pp * tp)):
                s = world // (pp * tp * dp)
                if c.global_batch % dp or any(v is not None and v != x for v, x in ((c.dp, dp), (c.tp, tp),
                                                                                   (c.pp, pp))):
                    continue
                options = grids(s, ndim) if ndim else ([()] if s == 1 else [])
                if graph.isotropic:  # permuted grids cost the same: keep one, split depth first
                    options = [g for g in options if list(g) == sorted(g, reverse=True)]
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
             micro_batch: int, sequence_parallel: bool = False, sharding: int = 0) -> MeshContext:
    s = math.prod(grid)
    return MeshContext(cluster, c.dtype, grid, tp, micro_batch, cost.Group.of(cluster, s, tp),
                       cost.Group.of(cluster, tp, 1), cost.Group.of(cluster, dp * s, tp), c.overlap_halo,
                       sequence_parallel and tp > 1, sharding > 0 and dp * s > 1)


@dataclass(frozen=True)
class Chain:
    """The per-layer choice for one mesh: an option per layer, the time of the layout changes the runtime
    makes at each layer (``layers.redistribution``), and the tp layout of each layer's output as its readers
    get it (``R`` whole, ``S`` split)."""

    options: tuple[Option, ...]
    redistribution: tuple[float, ...]
    layouts: tuple[str, ...]

    def layer_time(self, i: int) -> float:
        return self.options[i].time + self.redistribution[i]

    @property
    def total_time(self) -> float:
        return sum(map(self.layer_time, range(len(self.options))))

    @property
    def memory(self) -> float:
        return sum(o.params + o.saved for o in self.options)


def best_chain(graph: ModelGraph, ctx: MeshContext, cache: dict | None = None, allowed=None) -> Chain:
    """Per-layer tp strategies of least time (then least memory), exact over the assignments the rules allow:
    dynamic programming along the layers, each layer either alone (whole at its edges: replicate, a column
    layer that gathers, a row layer that slices) or in a region (``rules.regions``: layers split together,
    whole at the region's edges). With tp > 1, the best assignment that splits some layer (if any does; one
    that splits none would have every tp rank repeat all the work: ``rules.idle_tp_refusal``). Layers that
    share a parameter split it alike (``rules.check_shared``): each way to split the shared ones is solved,
    and the best kept. ``allowed`` (``{layer index: strategies}``) restricts the choice."""
    cache = {} if cache is None else cache
    choices = _tied_choices(graph, ctx) if allowed is None and ctx.tp > 1 else [None]
    if choices != [None] and choices != [{}]:
        chains = [best_chain(graph, ctx, cache, choice) for choice in choices]
        return min(chains, key=lambda c: (c.total_time, c.memory))
    key = ("chain", ctx, None if allowed is None else tuple(sorted((i, tuple(sorted(s))) for i, s in allowed.items())))
    if key in cache:
        return cache[key]
    regions = [r for r in _regions(graph, ctx, cache)
               if allowed is None or all(s in allowed.get(i, (s,)) for i, s in zip(r.layers, r.strategies))]
    # the layers split into segments that no region crosses, each kind of segment (one sequence of signatures,
    # as the 96 blocks of a GPT repeat theirs) solved once without and with a split layer among them; with
    # tp > 1 some layer must split (else every tp rank repeats all the work), in the segment where it costs least
    segments_key = ("segments", ctx.tp, math.prod(ctx.grid) > 1, ctx.sharded, key[2])
    if segments_key not in cache:
        cache[segments_key] = _segments(graph, regions, allowed)
    segments, kinds = cache[segments_key]
    solved = {kind: _segment(graph, ctx, cache, *first) for kind, first in kinds.items()}
    plain = {kind: pair[0][0] <= pair[1][0] for kind, pair in solved.items()}
    forced = None
    if ctx.tp > 1 and all(plain.values()):  # no segment splits by itself: force the split that costs least
        extra = {kind: (pair[1][0][0] - pair[0][0][0], pair[1][0][1] - pair[0][0][1]) for kind, pair in solved.items()}
        kind = min(extra, key=lambda k: extra[k])
        forced = kind if extra[kind][0] < math.inf else None
    picks = []
    for kind in segments:
        picks.extend(solved[kind][0 if plain[kind] and kind != forced else 1][1])
        forced = None if kind == forced else forced
    cache[key] = Chain(tuple(o for o, _, _ in picks), tuple(m for _, m, _ in picks), tuple(lay for _, _, lay in picks))
    return cache[key]


def _segments(graph, regions: list, allowed) -> tuple[list, dict]:
    """The kind of each run of layers between places that no region crosses, in order, and for each kind the
    arguments of ``_segment`` for its first run (a kind: its layers' signatures, its regions, what ``allowed``
    leaves its layers)."""
    n = len(graph.layers)
    crossed = [0] * (n + 1)
    for region in regions:
        for p in range(region.start + 1, region.stop):
            crossed[p] = 1
    inside: dict[int, list] = {}
    for region in regions:
        inside.setdefault(region.start, []).append(region)
    bounds = [p for p in range(n + 1) if not crossed[p]]
    order, kinds = [], {}
    for a, b in zip(bounds, bounds[1:]):
        within = [r for p in range(a, b) for r in inside.get(p, ())]
        kind = (tuple(layer.signature for layer in graph.layers[a:b]),
                tuple((r.start - a, r.stop - a, r.strategies) for r in within),
                None if allowed is None else tuple(allowed.get(i) for i in range(a, b)))
        kinds.setdefault(kind, (a, b, within, allowed))
        order.append(kind)
    return order, kinds


def _segment(graph, ctx: MeshContext, cache: dict, start: int, stop: int, regions: list, allowed) -> list:
    """The best ``((time, memory), picks)`` of layers ``[start, stop)`` without (``[0]``) and with (``[1]``) a
    split layer among them: dynamic programming over each layer alone or a region from it."""
    layers = graph.layers[start:stop]
    limits = None if allowed is None else tuple(allowed.get(i, None) for i in range(start, stop))
    key = ("segment", ctx, tuple(layer.signature for layer in layers),
           tuple((r.start - start, r.stop - start, r.strategies) for r in regions), limits)
    if key in cache:
        return cache[key]
    n = stop - start
    inf = ((math.inf, math.inf), None)
    best = [[((0.0, 0.0), None), inf]] + [[inf, inf] for _ in range(n)]
    by_start: dict[int, list] = {}
    for region in regions:
        by_start.setdefault(region.start - start, []).append(region)

    def offer(a: int, b: int, picks: tuple, time: float, memory: float, splits: bool) -> None:
        for k in (0, 1):
            (t, m), _ = best[a][k]
            value = (t + time, m + memory)
            to = k or splits
            if value < best[b][to][0]:
                best[b][to] = (value, (a, k, picks))

    for j, layer in enumerate(layers):
        for name, pick in _standalone(graph, layer, ctx, cache):
            if limits is None or limits[j] is None or name in limits[j]:
                offer(j, j + 1, (pick,), pick[0].time + pick[1], pick[0].params + pick[0].saved, name != "replicate")
        for region in by_start.get(j, ()):
            offer(j, region.stop - start, *_region_picks(graph, region, ctx, cache), True)
    out = []
    for k in (0, 1):
        value, at, state, chunks = best[n][k][0], n, k, []
        while at > 0 and value[0] < math.inf:
            at, state, picks = best[at][state][1]
            chunks.append(picks)
        out.append((value, tuple(p for chunk in reversed(chunks) for p in chunk)))
    cache[key] = out
    return out


def _regions(graph, ctx: MeshContext, cache: dict) -> list:
    key = ("regions", ctx.tp, math.prod(ctx.grid) > 1, ctx.sharded)
    if key not in cache:
        cache[key] = rules.regions(graph, ctx.tp, spatial=key[2], sharded=ctx.sharded) if ctx.tp > 1 else []
    return cache[key]


def _standalone(graph, layer, ctx: MeshContext, cache: dict) -> list[tuple[str, tuple[Option, float, str]]]:
    """``(strategy, (option, redistribution, layout after))`` of each way the layer runs whole at its edges
    (priced once per signature, as ``_options``)."""
    key = ("standalone", layer.signature, ctx)
    if key not in cache:
        options = {o.strategy: o for o in _options(layer, graph, ctx, cache)}
        names = rules.standalone(layer, ctx.tp, spatial=math.prod(ctx.grid) > 1, sharded=ctx.sharded)
        cache[key] = [(name, (options[name], redistribution(layer, options[name], name == "column",
                                                            name == "row" and layer.kind != "embedding",
                                                            ctx.tp_group), R))
                      for name in names]
    return cache[key]


def _region_picks(graph, region, ctx: MeshContext, cache: dict) -> tuple[tuple, float, float]:
    """The members' ``(option, redistribution, layout after)``, and their time and memory."""
    key = ("region", ctx, tuple(graph.layers[i].signature for i in region.layers), region.strategies)
    if key not in cache:
        picks = []
        for i, name in zip(region.layers, region.strategies):
            layer = graph.layers[i]
            option = next(o for o in _options(layer, graph, ctx, cache) if o.strategy == name)
            picks.append((option, redistribution(layer, option, False, False, ctx.tp_group), R if name == "row" else S))
        cache[key] = (tuple(picks), sum(o.time + m for o, m, _ in picks), sum(o.params + o.saved for o, _, _ in picks))
    return cache[key]


def _tied_choices(graph, ctx: MeshContext) -> list[dict[int, tuple[str, ...]]]:
    """Each way to split the layers that share a parameter alike (``rules.weight_split``): for every shared
    parameter, its users all whole, all by rows or all by columns, where each user can."""
    per_group = []
    for names in graph.shared:
        users = [layer for layer in graph.layers if set(layer.params) & set(names)]
        if len(users) < 2:
            continue  # one layer (a module registered twice): nothing to split alike
        ways = []
        for split in ("whole", "dim0", "dim1"):
            way = {layer.index: tuple(s for s in strategies(layer, ctx) if rules.weight_split(layer, s) == split)
                   for layer in users}
            if all(way.values()):
                ways.append(way)
        per_group.append(ways)
    return [{k: v for way in combo for k, v in way.items()} for combo in itertools.product(*per_group)]


_ANY = cost.Group(0, None)  # the norm group in the cache key of a layer that does not use it


def _options(layer, graph, ctx, cache: dict) -> tuple[Option, ...]:
    """Options of a layer, priced once per signature (the 96 blocks of a GPT share theirs), for every
    sharding level but for convolutions (only their options depend on it) and for every dp degree but
    for batch norms (only they talk over dp)."""
    uses = (layer.kind == "conv", layer.kind == "batch_norm")
    if (ctx, uses) not in cache:
        cache[ctx, uses] = dataclasses.replace(ctx, sharded=ctx.sharded and uses[0],
                                               norm_group=ctx.norm_group if uses[1] else _ANY)
    ctx = cache[ctx, uses]
    key = (layer.signature, ctx)
    if key not in cache:
        cache[key] = layer_options(layer, graph, ctx)
    return cache[key]


# --- whole candidates ------------------------------------------------------------------------------

def _setting(cluster, c, mesh, m, z, ckpt, schedule: str = "1f1b", num_stages: int = 0) -> StageSetting:
    dp, grid, tp, pp = mesh
    s = math.prod(grid)
    return StageSetting(cluster, num_stages or pp, m, z, ckpt, c.optimizer, cost.Group.of(cluster, dp * s, tp),
                        cost.Group.of(cluster, pp, dp * s * tp).link, schedule)


def legal_starts(graph: ModelGraph, chain: Chain) -> list[int]:
    """Layers a stage may start at: 0, and each of the graph's stage starts (a block's first layer where the rules
    allow a cut) where everything that crosses is whole over tp (``rules.crossing_sources``; a graph built by
    hand, without blocks: the layer before)."""
    if not graph.blocks:
        return [0] + [i for i in graph.stage_starts if chain.layouts[i - 1] == R]
    sources = rules.crossing_sources(graph)
    block_of = {first: b for b, first in graph.block_starts.items()}
    return [0] + [i for i in graph.stage_starts if all(chain.layouts[p] == R for p in sources[block_of[i]])]


def price(graph: ModelGraph, cluster: ClusterSpec, c: Constraints, mesh, m: int, z: int, ckpt: bool,
          chain: Chain, cuts: tuple[int, ...], units: Units | None = None,
          schedule: str = "1f1b") -> tuple[float, list[cost.Memory], dict]:
    """Step time, memory per pipeline rank and exposed communication by kind (with ``compute``, all on the
    slowest stage) of one fully specified candidate; ``cuts`` are the layers that start stages 2..S (``S =
    pp``, or a multiple of it under interleaved 1F1B, where rank ``r`` holds stages ``r, r + pp, ...``)."""
    units = units or Units.of(chain, legal_starts(graph, chain), graph.block_index)
    starts = list(units.starts)
    costs = StageCosts(units, _setting(cluster, c, mesh, m, z, ckpt, schedule, len(cuts) + 1))
    index = [starts.index(b) for b in cuts]
    bounds = list(zip([0] + index, index + [len(units)]))
    times = [costs.stage_time(a, b) for a, b in bounds]
    pp = mesh[3]
    ranks = [bounds[r::pp] for r in range(pp)]  # the stages each pipeline rank holds
    tails = [tuple(sum(f(a, b) for a, b in held) for f in (costs.gradient_sync, costs.optimizer_step))
             for held in ranks]
    sync, update = max(tails, key=sum)
    interleaved = len(bounds) > pp
    step = (cost.interleaved_pipeline_time(times, m, pp) if interleaved else cost.pipeline_time(times, m)) + sync \
        + update
    memory = [costs.memory(a, b, k) for k, (a, b) in enumerate(bounds)]
    memory = [cost.combined(memory[r::pp]) for r in range(pp)] if interleaved else memory
    slowest = max(bounds, key=lambda ab: costs.stage_time(*ab))
    layers = (starts[slowest[0]], starts[slowest[1]] if slowest[1] < len(starts) else len(chain.options))
    comm = _communication(chain, costs, layers, costs.send(slowest[1]), costs.fsdp_gathers(*slowest) * m, sync)
    comm["compute"] += update
    return step, memory, comm


def _communication(chain: Chain, costs: StageCosts, layers, send: float, fsdp: float, sync: float) -> dict:
    """Exposed communication per step on the slowest stage, by kind, and its ``compute``."""
    m = costs.setting.micro_batches
    out: dict[str, float] = {}
    for i in range(*layers):
        for kind, t in chain.options[i].comm.items():
            out[kind] = out.get(kind, 0.0) + t * m
        if chain.redistribution[i]:
            out["tp"] = out.get("tp", 0.0) + chain.redistribution[i] * m
    s = costs.setting
    out["fsdp"] = fsdp
    out["pipeline"] = send * m
    out["gradients"] = sync
    out = {k: v for k, v in out.items() if v}
    out["compute"] = sum(chain.options[i].time - sum(chain.options[i].comm.values()) for i in range(*layers)) * m
    if s.checkpointing:
        out["compute"] += sum(chain.options[i].forward for i in range(*layers)) * m
    return out


def search(graph: ModelGraph, cluster: ClusterSpec, c: Constraints) -> SearchResult:
    """Ranked plans for ``cluster.num_devices`` devices, fastest first (one per mesh), and for every
    family of strategies (``dp``, ``dp x spatial``, ``dp x tp x pp``, ...) why it lost or did not fit.

    Candidates are priced in the order of a lower bound of their step time, and one whose bound cannot
    beat the ``top``-th plan found is not priced further. A mesh's bound is first that of its heaviest
    layer alone; a mesh that may still win gets the bounds of its candidates (a stage as fast as an even
    split of its least chain of per-layer strategies)."""
    world, limit = cluster.num_devices, cluster.device_memory
    all_meshes = [m for m in meshes(world, graph, c, cluster.devices_per_node)
                  if c.families is None or family(m) in c.families]
    if not all_meshes:
        raise PlanError(_no_mesh_message(world, graph, c))
    log = _Log()
    cache: dict = {}
    norm = next((layer for layer in graph.layers if layer.kind == "batch_norm"), None)  # refuses pipelines
    heaviest = max(graph.layers, key=lambda layer: layer.flops)
    pending = []  # a heap of (lower bound of step time, order, mesh, candidate (m, z, ckpt) or None for all)
    order, total = itertools.count(), 0
    for mesh in all_meshes:
        dp, grid, tp, pp = mesh
        try:
            check_grid(graph, grid)
        except PlanError as err:
            log.fail(mesh, f"spatial grid {'x'.join(map(str, grid))}: {err}")
            continue
        if pp > 1 and norm is not None:
            log.fail(mesh, f"pp={pp}: layer {norm.name!r} is a batch norm, whose statistics a pipeline would take "
                           "per micro-batch, unlike one process on the batch")
            continue
        total += len(_settings(c, mesh, graph))
        pending.append((_layer_floor(graph, heaviest, cluster, c, mesh, c.global_batch // dp, cache), next(order),
                        mesh, None))
    heapq.heapify(pending)
    found: list[Candidate] = []
    best_per_mesh: dict = {}
    while pending:
        bound, _, mesh, setting = heapq.heappop(pending)
        if len(best_per_mesh) >= c.top and bound >= sorted(best_per_mesh.values())[c.top - 1]:
            log.skip(mesh, bound)
            continue
        if setting is None:
            # the replica's batch in one micro-batch, every split allowed: a lower bound for any sharding.
            # Every cost is affine in the micro-batch with a non-negative constant, so one micro-batch of
            # 1/m of the samples takes at least 1/m of the time.
            floor = _floor(graph, cluster, c, mesh, c.global_batch // mesh[0], cache)
            for m, z, ckpt in _settings(c, mesh, graph):
                heapq.heappush(pending, (floor.bound(m, mesh[3], ckpt, 1 / m), next(order), mesh, (m, z, ckpt)))
            continue
        m, z, ckpt = setting
        if mesh in best_per_mesh and bound >= best_per_mesh[mesh]:
            continue
        beat = sorted(best_per_mesh.values())[c.top - 1] if len(best_per_mesh) >= c.top else math.inf
        beat = min(beat, best_per_mesh.get(mesh, math.inf))
        cand = _evaluate(graph, cluster, c, mesh, m, z, ckpt, cache, limit, beat)
        if cand.plan is None and not cand.reason:
            log.skip(mesh, cand.bound)
            continue
        if cand.plan is None:
            log.fail(mesh, cand.reason, cand.memory)
            continue
        found.append(cand)
        best_per_mesh[mesh] = min(best_per_mesh.get(mesh, math.inf), cand.step_time)
    found.sort(key=lambda x: (x.step_time, x.memory, tuple(-p for p in x.mesh[1])))
    plans, seen = [], set()
    for cand in found:
        if cand.mesh not in seen and len(plans) < c.top:
            plans.append(cand.plan)
            seen.add(cand.mesh)
    return SearchResult(plans, log.explain(found), total, log.closest[1])


class _Log:
    """Why each family of strategies lost: its best plan, a lower bound that could not win, or a failure."""

    def __init__(self):
        self.failures: dict[str, tuple[float, str]] = {}  # family -> the failure nearest to fitting
        self.bounds: dict[str, float] = {}
        self.closest: tuple[float, str] = (math.inf, "")

    def fail(self, mesh, reason: str, memory: float = math.inf) -> None:
        name = family(mesh)
        if name not in self.failures or memory < self.failures[name][0]:
            self.failures[name] = (memory, reason)
        if memory < self.closest[0]:
            self.closest = (memory, reason)

    def skip(self, mesh, bound: float) -> None:
        name = family(mesh)
        self.bounds[name] = min(self.bounds.get(name, math.inf), bound)

    def explain(self, found: list[Candidate]) -> dict[str, str]:
        out: dict[str, str] = {}
        fastest = found[0].step_time if found else math.inf
        for cand in found:
            name = family(cand.mesh)
            if name not in out:
                ratio = f" ({cand.step_time / fastest:.2f}x the fastest)" if cand is not found[0] else ""
                out[name] = f"best {cand.plan.describe()}: {cand.step_time * 1e3:.4g} ms per step{ratio}"
        for name, bound in self.bounds.items():
            out.setdefault(name, f"at least {bound * 1e3:.4g} ms per step ({bound / fastest:.2f}x the fastest)")
        for name, (_, reason) in self.failures.items():
            out.setdefault(name, reason)
        return out


def _chain(graph, cluster, c, mesh, micro_batch, sharding, cache) -> tuple[Chain, Units]:
    """The per-layer strategies of a mesh for one micro-batch size and sharding level, and their units
    (cached). Sharding only takes options away (channel-split convolutions), so where the unsharded chain
    splits no convolution it is the sharded one too, and is not searched again."""
    dp, grid, tp, _ = mesh
    ctx = _context(cluster, c, dp, grid, tp, micro_batch, sharding=sharding)
    key = ("units", ctx)
    if key not in cache:
        plain = _chain(graph, cluster, c, mesh, micro_batch, 0, cache) if sharding else None
        if plain is not None and not _splits_convs(graph, plain[0]):
            cache[key] = plain
        else:
            chain = best_chain(graph, ctx, cache)
            cache[key] = (chain, Units.of(chain, legal_starts(graph, chain), graph.block_index))
    return cache[key]


@dataclass(frozen=True)
class _Floor:
    """What no chain of a mesh and micro-batch can go below, whatever its sharding level: the least
    chain time, the slowest layer's fastest option (a unit holds at least one layer) and the sum of
    the layers' least forward times (what checkpointing recomputes)."""

    time: float
    layer: float
    forward: float

    def bound(self, m: int, pp: int, ckpt: bool, scale: float = 1.0) -> float:
        """A lower bound of the step time of ``m`` micro-batches over ``pp`` stages, each micro-batch
        taking at least ``scale`` of this floor's."""
        total = (self.time + (self.forward if ckpt else 0.0)) * scale
        return (m - 1) * max(total / pp, self.layer * scale) + total


def _settings(c: Constraints, mesh, graph: ModelGraph) -> list[tuple[int, int, bool]]:
    """The ``(micro-batches, ZeRO level, checkpointing)`` the search tries on ``mesh`` (no checkpointed
    pipeline stages where ``rules.checkpointed_stages_refusal`` says so)."""
    dp, grid, _, pp = mesh
    levels = c.sharding if dp * math.prod(grid) > 1 else (0,)
    ckpts = c.checkpointing
    if pp > 1 and rules.checkpointed_stages_refusal(graph):
        ckpts = tuple(k for k in ckpts if not k)
    return [(m, z, ckpt) for m in micro_batch_counts(c.global_batch // dp, pp, c) for z in levels for ckpt in ckpts]


def _layer_floor(graph, layer, cluster, c, mesh, micro_batch, cache) -> float:
    """The least time of ``layer`` over its strategies at ``micro_batch``: no candidate of the mesh with
    that many samples per replica is faster (its micro-batches, whatever their count, pass the layer)."""
    dp, grid, tp, _ = mesh
    ctx = _context(cluster, c, dp, grid, tp, micro_batch)
    return min(o.time for o in _options(layer, graph, ctx, cache))


def _floor(graph, cluster, c, mesh, micro_batch, cache) -> _Floor:
    dp, grid, tp, _ = mesh
    key = ("floor", mesh, micro_batch)
    if key not in cache:
        chain, _ = _chain(graph, cluster, c, mesh, micro_batch, 0, cache)
        ctx = _context(cluster, c, dp, grid, tp, micro_batch)
        kinds = [(_options(layer, graph, ctx, cache), count) for layer, count in _distinct(graph, cache)]
        cache[key] = _Floor(sum(chain.options[i].time + chain.redistribution[i] for i in range(len(chain.options))),
                            max(min(o.time for o in opts) for opts, _ in kinds),
                            sum(count * min(o.forward for o in opts) for opts, count in kinds))
    return cache[key]


def _distinct(graph, cache) -> list[tuple]:
    """``(layer, count)`` for each kind of layer of the graph (one signature), priced alike."""
    if "distinct" not in cache:
        kinds: dict = {}
        for layer in graph.layers:
            first, count = kinds.get(layer.signature, (layer, 0))
            kinds[layer.signature] = (first, count + 1)
        cache["distinct"] = list(kinds.values())
    return cache["distinct"]


def _splits_convs(graph: ModelGraph, chain: Chain) -> bool:
    return any(o.strategy in ("column", "row") and layer.kind == "conv"
               for layer, o in zip(graph.layers, chain.options))


def _evaluate(graph, cluster, c, mesh, m, z, ckpt, cache, limit, beat: float) -> Candidate:
    """The candidate priced, or not if the bound of its own per-layer times (checked before the cut
    search) cannot beat ``beat``."""
    dp, grid, tp, pp = mesh
    micro_batch = c.global_batch // (dp * m)
    if z and ("units", _context(cluster, c, dp, grid, tp, micro_batch, sharding=z)) not in cache:
        bound = _floor(graph, cluster, c, mesh, micro_batch, cache).bound(m, pp, ckpt)
        if bound >= beat:  # not worth solving the sharded chain
            return Candidate(mesh, m, z, ckpt, bound=bound)
    chain, units = _chain(graph, cluster, c, mesh, micro_batch, z, cache)
    idle = rules.idle_tp_refusal(graph, tp, [o.strategy for o in chain.options])
    if idle:
        return Candidate(mesh, m, z, ckpt, reason=f"{idle} (here no split saves more time than it costs)")
    if len(units) < pp:
        return Candidate(mesh, m, z, ckpt, reason=f"pp={pp}: the model has only {len(units)} places to start a "
                                                  "stage")
    setting = _setting(cluster, c, mesh, m, z, ckpt)
    state = units.state_memory(setting)
    if state > limit:
        return Candidate(mesh, m, z, ckpt, memory=state, reason=_state_too_big(state, setting, mesh, limit))
    total = units.total_time(setting)
    bound = (m - 1) * max(total / pp, max(units.time)) + total
    if bound >= beat:
        return Candidate(mesh, m, z, ckpt, bound=bound)
    return _candidate(graph, cluster, c, mesh, m, z, ckpt, (chain, units), StageCosts(units, setting), limit)


def family(mesh) -> str:
    """The family of a mesh ``(dp, grid, tp, pp)``: the kinds of parallelism it uses, in ``FAMILY_ORDER``, e.g.
    ``dp x spatial``."""
    dp, grid, tp, pp = mesh
    sizes = {"dp": dp, "spatial": math.prod(grid), "tp": tp, "pp": pp}
    return " x ".join(name for name in FAMILY_ORDER if sizes[name] > 1) or ONE_DEVICE


def _candidate(graph, cluster, c, mesh, m, z, ckpt, units, costs, limit) -> Candidate:
    chain, unit_table = units
    if mesh[3] == 1:
        cuts = ()
    else:
        index = best_cuts(costs, limit)
        if index is None:
            whole = costs.memory(0, len(costs.units), 0).total / mesh[3]
            return Candidate(mesh, m, z, ckpt, memory=whole, reason=_too_big(costs, mesh, m, z, ckpt, limit))
        cuts = tuple(unit_table.starts[u] for u in index)
    step, memory, comm = price(graph, cluster, c, mesh, m, z, ckpt, chain, cuts, unit_table)
    peak = max(mem.total for mem in memory)
    if peak > limit:
        return Candidate(mesh, m, z, ckpt, memory=peak, reason=_too_big(costs, mesh, m, z, ckpt, limit, memory))
    plan = _plan(graph, cluster, c, mesh, m, z, ckpt, chain, cuts, step, memory, comm)
    return Candidate(mesh, m, z, ckpt, step, peak, plan)


def _state_too_big(state: float, setting: StageSetting, mesh, limit) -> str:
    dp, grid, tp, pp = mesh
    return (f"dp={dp} spatial={'x'.join(map(str, grid))} tp={tp} pp={pp} zero={setting.sharding}: parameters, "
            f"gradients and optimizer state alone need {state / 2**30:.3g} GiB per device "
            f"> {limit / 2**30:.3g} GiB")


def _too_big(costs, mesh, m, z, ckpt, limit, memory=None) -> str:
    memory = memory or [costs.memory(0, len(costs.units), 0)]
    worst = max(memory, key=lambda mem: mem.total)
    parts = ", ".join(f"{k} {v / 2**30:.3g}" for k, v in worst.as_dict().items() if k != "total" and v)
    dp, grid, tp, pp = mesh
    return (f"dp={dp} spatial={'x'.join(map(str, grid))} tp={tp} pp={pp} m={m} zero={z}"
            f"{' ckpt' if ckpt else ''} needs {worst.total / 2**30:.3g} GiB per device ({parts}) "
            f"> {limit / 2**30:.3g} GiB")


def prediction_of(c: Constraints, chain: Chain, step: float, memory: list[cost.Memory], comm: dict,
                  m: int) -> Prediction:
    worst = max(memory, key=lambda mem: mem.total)
    comm = dict(comm)
    compute = comm.pop("compute")
    return Prediction(step, compute, worst.as_dict(), comm, c.global_batch / step if step else 0.0)


def _plan(graph, cluster, c, mesh, m, z, ckpt, chain, cuts, step, memory, comm) -> Plan:
    dp, grid, tp, pp = mesh
    layers = tuple((graph.layers[i].name, o.strategy) for i, o in enumerate(chain.options)
                   if o.strategy != "replicate")
    return Plan(dp=dp, spatial=grid, tp=tp, pp=pp, global_batch=c.global_batch, micro_batches=m, sharding=z,
                checkpointing=ckpt, stages=tuple(graph.layers[b].name for b in cuts), layers=layers,
                optimizer=c.optimizer, dtype=c.dtype, input_shape=(c.global_batch,) + graph.input_shape[1:],
                model=graph.name, cluster=cluster.name, prediction=prediction_of(c, chain, step, memory, comm, m))


def _no_mesh_message(world: int, graph: ModelGraph, c: Constraints) -> str:
    fixed = any(v is not None for v in (c.dp, c.spatial, c.tp, c.pp))
    kinds = f"as {' or '.join(c.families)}" if c.families else "as dp x spatial x tp x pp"
    return (f"no way to arrange {world} device{'s' if world > 1 else ''} {kinds} with global batch "
            f"{c.global_batch}{' and the degrees you fixed' if fixed else ''}; use a global batch divisible by "
            f"more of the device count's factors{', or fix fewer degrees' if fixed else ''}")

"""Per-layer tensor-parallel strategies of one mesh, exactly: dynamic programming along the layers, each layer
alone (whole at its edges) or in a region the rules split together (``rules.regions``), layers that share a
parameter split alike, and with tp > 1 some layer split. Layers of one signature (the repeated blocks of a
network) are priced once (``Caches``)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass, field

from hybridpar.dims import ParallelDims
from hybridpar.ir import rules
from hybridpar.ir.graph import ModelGraph
from hybridpar.plan import cost
from hybridpar.plan.cluster import ClusterSpec
from hybridpar.plan.options import MeshContext, Option, R, S, layer_options, redistribution, strategies
from hybridpar.plan.space import Constraints


@dataclass
class Caches:
    """What the search prices once, one dict per kind of key (a GPT's 96 blocks share their signatures, and the
    meshes of one search share their per-layer contexts)."""

    chains: dict = field(default_factory=dict)  # (ctx, allowed) -> Chain
    segmentations: dict = field(default_factory=dict)  # (tp, spatial, sharded, allowed) -> (segments, kinds)
    segments: dict = field(default_factory=dict)  # (ctx, signatures, regions, limits) -> best without / with split
    regions: dict = field(default_factory=dict)  # (tp, spatial, sharded) -> rules.regions
    standalone: dict = field(default_factory=dict)  # (signature, ctx) -> ways to run a layer whole at its edges
    region_picks: dict = field(default_factory=dict)  # (ctx, signatures, strategies) -> a region's picks
    contexts: dict = field(default_factory=dict)  # (ctx, uses) -> the context a layer's options depend on
    options: dict = field(default_factory=dict)  # (signature, ctx) -> layer_options
    units: dict = field(default_factory=dict)  # ctx -> (Chain, Units)
    floors: dict = field(default_factory=dict)  # (dims, micro_batch) -> _Floor
    distinct: list | None = None  # (layer, count) per signature


def context(cluster: ClusterSpec, c: Constraints, dims: ParallelDims, micro_batch: int, *,
            sequence_parallel: bool = False, sharding: int = 0) -> MeshContext:
    """What a layer's options depend on, for a mesh and a micro-batch size."""
    s, tp = dims.num_spatial, dims.tp
    return MeshContext(cluster, c.dtype, dims.spatial, tp, micro_batch, cost.Group.of(cluster, s, tp),
                       cost.Group.of(cluster, tp, 1), cost.Group.of(cluster, dims.dp * s, tp), c.overlap_halo,
                       sequence_parallel and tp > 1, sharding > 0 and dims.dp * s > 1)


@dataclass(frozen=True)
class Chain:
    """The per-layer choice for one mesh: an option per layer, the time of the layout changes the runtime
    makes at each layer (``options.redistribution``), and the tp layout of each layer's output as its readers
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


def best_chain(graph: ModelGraph, ctx: MeshContext, cache: Caches | None = None, allowed=None) -> Chain:
    """Per-layer tp strategies of least time (then least memory), exact over the assignments the rules allow:
    dynamic programming along the layers, each layer either alone (whole at its edges: replicate, a column
    layer that gathers, a row layer that slices) or in a region (``rules.regions``: layers split together,
    whole at the region's edges). With tp > 1, the best assignment that splits some layer (if any does; one
    that splits none would have every tp rank repeat all the work: ``rules.idle_tp_refusal``). Layers that
    share a parameter split it alike (``rules.check_shared``): each way to split the shared ones is solved,
    and the best kept. ``allowed`` (``{layer index: strategies}``) restricts the choice."""
    cache = Caches() if cache is None else cache
    ctx = _chain_context(graph, ctx, cache)
    choices = _tied_choices(graph, ctx) if allowed is None and ctx.tp > 1 else [None]
    if choices != [None] and choices != [{}]:
        chains = [best_chain(graph, ctx, cache, choice) for choice in choices]
        return min(chains, key=lambda c: (c.total_time, c.memory))
    limits = None if allowed is None else tuple(sorted((i, tuple(sorted(s))) for i, s in allowed.items()))
    if (ctx, limits) in cache.chains:
        return cache.chains[ctx, limits]
    regions = [r for r in _regions(graph, ctx, cache)
               if allowed is None or all(s in allowed.get(i, (s,)) for i, s in zip(r.layers, r.strategies))]
    # the layers split into segments that no region crosses, each kind of segment (one sequence of signatures,
    # as the 96 blocks of a GPT repeat theirs) solved once without and with a split layer among them; with
    # tp > 1 some layer must split (else every tp rank repeats all the work), in the segment where it costs least
    segments_key = (ctx.tp, math.prod(ctx.grid) > 1, ctx.sharded, limits)
    if segments_key not in cache.segmentations:
        cache.segmentations[segments_key] = _segments(graph, regions, allowed)
    segments, kinds = cache.segmentations[segments_key]
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
    chain = Chain(tuple(o for o, _, _ in picks), tuple(m for _, m, _ in picks), tuple(lay for _, _, lay in picks))
    cache.chains[ctx, limits] = chain
    return chain


def _chain_context(graph, ctx: MeshContext, cache: Caches) -> MeshContext:
    """``ctx`` without what no layer of the graph reads (``_narrowed``): meshes that differ only in dp (and pp)
    share their chains for a micro-batch size."""
    if (ctx, "chain") not in cache.contexts:
        kinds = {layer.kind for layer in graph.layers}
        cache.contexts[ctx, "chain"] = _narrowed(ctx, "conv" in kinds, "batch_norm" in kinds)
    return cache.contexts[ctx, "chain"]


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


def _segment(graph, ctx: MeshContext, cache: Caches, start: int, stop: int, regions: list, allowed) -> list:
    """The best ``((time, memory), picks)`` of layers ``[start, stop)`` without (``[0]``) and with (``[1]``) a
    split layer among them: dynamic programming over each layer alone or a region from it."""
    layers = graph.layers[start:stop]
    limits = None if allowed is None else tuple(allowed.get(i, None) for i in range(start, stop))
    key = (ctx, tuple(layer.signature for layer in layers),
           tuple((r.start - start, r.stop - start, r.strategies) for r in regions), limits)
    if key in cache.segments:
        return cache.segments[key]
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
    cache.segments[key] = out
    return out


def _regions(graph, ctx: MeshContext, cache: Caches) -> list:
    key = (ctx.tp, math.prod(ctx.grid) > 1, ctx.sharded)
    if key not in cache.regions:
        cache.regions[key] = rules.regions(graph, ctx.tp, spatial=key[1], sharded=ctx.sharded) if ctx.tp > 1 else []
    return cache.regions[key]


def _standalone(graph, layer, ctx: MeshContext, cache: Caches) -> list[tuple[str, tuple[Option, float, str]]]:
    """``(strategy, (option, redistribution, layout after))`` of each way the layer runs whole at its edges
    (priced once per signature, as ``options_of``)."""
    key = (layer.signature, ctx)
    if key not in cache.standalone:
        options = {o.strategy: o for o in options_of(layer, graph, ctx, cache)}
        names = rules.standalone(layer, ctx.tp, spatial=math.prod(ctx.grid) > 1, sharded=ctx.sharded)
        cache.standalone[key] = [(name, (options[name], redistribution(layer, options[name], name == "column",
                                                                       name == "row" and layer.kind != "embedding",
                                                                       ctx.tp_group), R))
                                 for name in names]
    return cache.standalone[key]


def _region_picks(graph, region, ctx: MeshContext, cache: Caches) -> tuple[tuple, float, float]:
    """The members' ``(option, redistribution, layout after)``, and their time and memory."""
    key = (ctx, tuple(graph.layers[i].signature for i in region.layers), region.strategies)
    if key not in cache.region_picks:
        picks = []
        for i, name in zip(region.layers, region.strategies):
            layer = graph.layers[i]
            option = next(o for o in options_of(layer, graph, ctx, cache) if o.strategy == name)
            picks.append((option, redistribution(layer, option, False, False, ctx.tp_group), R if name == "row" else S))
        cache.region_picks[key] = (tuple(picks), sum(o.time + m for o, m, _ in picks),
                                   sum(o.params + o.saved for o, _, _ in picks))
    return cache.region_picks[key]


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


def _narrowed(ctx: MeshContext, convs: bool, batch_norms: bool) -> MeshContext:
    """``ctx`` without what only convolutions read (the sharding level: ``rules.tp_refusal``) where there are
    none, and without what only batch norms read (the dp group they talk over) where there are none."""
    return dataclasses.replace(ctx, sharded=ctx.sharded and convs, norm_group=ctx.norm_group if batch_norms else _ANY)


def options_of(layer, graph, ctx, cache: Caches) -> tuple[Option, ...]:
    """Options of a layer, priced once per signature (the 96 blocks of a GPT share theirs), for every
    sharding level but for convolutions (only their options depend on it) and for every dp degree but
    for batch norms (only they talk over dp)."""
    uses = (layer.kind == "conv", layer.kind == "batch_norm")
    if (ctx, uses) not in cache.contexts:
        cache.contexts[ctx, uses] = _narrowed(ctx, *uses)
    ctx = cache.contexts[ctx, uses]
    key = (layer.signature, ctx)
    if key not in cache.options:
        cache.options[key] = layer_options(layer, graph, ctx)
    return cache.options[key]

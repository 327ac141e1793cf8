"""Whole candidates priced: a mesh and a setting, its chain of per-layer strategies, its pipeline cuts, its step
time, memory per device and exposed communication (``price``, which ``validate`` calls too), or why it does not
fit; lower bounds that let the search skip what cannot win; the ``Plan`` of a candidate."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hybridpar.dims import ParallelDims
from hybridpar.ir import rules
from hybridpar.ir.graph import ModelGraph
from hybridpar.ir.types import Plan, Prediction
from hybridpar.plan import cost
from hybridpar.plan.chains import Caches, Chain, best_chain, context, options_of
from hybridpar.plan.cluster import ClusterSpec
from hybridpar.plan.options import MeshContext, R
from hybridpar.plan.space import Constraints, Setting, micro_batch_counts
from hybridpar.plan.stages import StageCosts, StageSetting, Units, best_cuts


@dataclass(frozen=True)
class Candidate:
    """One point of the search space, with its verdict: ``plan`` if it fits; ``reason`` if not (and the
    memory it needs); neither if it was not priced because ``bound`` (a lower bound of its step time)
    could not win."""

    dims: ParallelDims
    setting: Setting
    step_time: float = math.inf
    memory: float = math.inf
    plan: Plan | None = None
    reason: str = ""
    bound: float = 0.0


@dataclass(frozen=True)
class Problem:
    """What one search prices: the model's graph, the cluster and the constraints, and what it priced once."""

    graph: ModelGraph
    cluster: ClusterSpec
    c: Constraints
    cache: Caches = field(default_factory=Caches, compare=False)

    @property
    def limit(self) -> float:
        return self.cluster.device_memory

    def context(self, dims: ParallelDims, micro_batch: int, sharding: int = 0) -> MeshContext:
        return context(self.cluster, self.c, dims, micro_batch, sharding=sharding)

    def stage_setting(self, dims: ParallelDims, setting: Setting, schedule: str = "1f1b",
                      num_stages: int = 0) -> StageSetting:
        cluster, s = self.cluster, dims.num_spatial
        return StageSetting(cluster, num_stages or dims.pp, setting.micro_batches, setting.sharding,
                            setting.checkpointing, self.c.optimizer, cost.Group.of(cluster, dims.dp * s, dims.tp),
                            cost.Group.of(cluster, dims.pp, dims.dp * s * dims.tp).link, schedule)


def _legal_starts(graph: ModelGraph, chain: Chain) -> list[int]:
    """Layers a stage may start at (``rules.legal_starts``) where ``chain`` leaves what crosses whole over tp."""
    return rules.legal_starts(graph, lambda i: chain.layouts[i] != R)


def price(p: Problem, dims: ParallelDims, setting: Setting, chain: Chain, cuts: tuple[int, ...], *,
          units: Units | None = None, schedule: str = "1f1b") -> tuple[float, list[cost.Memory], dict]:
    """Step time, memory per pipeline rank and exposed communication by kind (with ``compute``, all on the
    slowest stage) of one fully specified candidate; ``cuts`` are the layers that start stages 2..S (``S =
    pp``, or a multiple of it under interleaved 1F1B, where rank ``r`` holds stages ``r, r + pp, ...``)."""
    units = units or Units.of(chain, _legal_starts(p.graph, chain), p.graph.block_index)
    starts = list(units.starts)
    costs = StageCosts(units, p.stage_setting(dims, setting, schedule, len(cuts) + 1))
    index = [starts.index(b) for b in cuts]
    bounds = list(zip([0] + index, index + [len(units)]))
    times = [costs.stage_time(a, b) for a, b in bounds]
    pp, m = dims.pp, setting.micro_batches
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


def _chain(p: Problem, dims: ParallelDims, micro_batch: int, sharding: int) -> tuple[Chain, Units]:
    """The per-layer strategies of a mesh for one micro-batch size and sharding level, and their units
    (cached). Sharding only takes options away (channel-split convolutions), so where the unsharded chain
    splits no convolution it is the sharded one too, and is not searched again."""
    ctx = p.context(dims, micro_batch, sharding)
    if ctx not in p.cache.units:
        plain = _chain(p, dims, micro_batch, 0) if sharding else None
        if plain is not None and not _splits_convs(p.graph, plain[0]):
            p.cache.units[ctx] = plain
        else:
            chain = best_chain(p.graph, ctx, p.cache)
            p.cache.units[ctx] = (chain, Units.of(chain, _legal_starts(p.graph, chain), p.graph.block_index))
    return p.cache.units[ctx]


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


def settings_of(c: Constraints, dims: ParallelDims, graph: ModelGraph) -> list[Setting]:
    """The settings the search tries on a mesh (no checkpointed pipeline stages where
    ``rules.checkpointed_stages_refusal`` says so)."""
    levels = c.sharding if dims.dp * dims.num_spatial > 1 else (0,)
    ckpts = c.checkpointing
    if dims.pp > 1 and rules.checkpointed_stages_refusal(graph):
        ckpts = tuple(k for k in ckpts if not k)
    return [Setting(m, z, ckpt) for m in micro_batch_counts(c.global_batch // dims.dp, dims.pp, c)
            for z in levels for ckpt in ckpts]


def layer_floor(p: Problem, layer, dims: ParallelDims, micro_batch: int) -> float:
    """The least time of ``layer`` over its strategies at ``micro_batch``: no candidate of the mesh with
    that many samples per replica is faster (its micro-batches, whatever their count, pass the layer)."""
    return min(o.time for o in options_of(layer, p.graph, p.context(dims, micro_batch), p.cache))


def mesh_floor(p: Problem, dims: ParallelDims, micro_batch: int) -> _Floor:
    key = (dims, micro_batch)
    if key not in p.cache.floors:
        chain, _ = _chain(p, dims, micro_batch, 0)
        ctx = p.context(dims, micro_batch)
        kinds = [(options_of(layer, p.graph, ctx, p.cache), count) for layer, count in _distinct(p)]
        p.cache.floors[key] = _Floor(sum(map(chain.layer_time, range(len(chain.options)))),
                                     max(min(o.time for o in opts) for opts, _ in kinds),
                                     sum(count * min(o.forward for o in opts) for opts, count in kinds))
    return p.cache.floors[key]


def _distinct(p: Problem) -> list[tuple]:
    """``(layer, count)`` for each kind of layer of the graph (one signature), priced alike."""
    if p.cache.distinct is None:
        kinds: dict = {}
        for layer in p.graph.layers:
            first, count = kinds.get(layer.signature, (layer, 0))
            kinds[layer.signature] = (first, count + 1)
        p.cache.distinct = list(kinds.values())
    return p.cache.distinct


def _splits_convs(graph: ModelGraph, chain: Chain) -> bool:
    return any(o.strategy in ("column", "row") and layer.kind == "conv"
               for layer, o in zip(graph.layers, chain.options))


def evaluate(p: Problem, dims: ParallelDims, setting: Setting, beat: float) -> Candidate:
    """The candidate priced, or not if the bound of its own per-layer times (checked before the cut
    search) cannot beat ``beat``."""
    m, z, pp = setting.micro_batches, setting.sharding, dims.pp
    micro_batch = p.c.global_batch // (dims.dp * m)
    if z and p.context(dims, micro_batch, z) not in p.cache.units:
        bound = mesh_floor(p, dims, micro_batch).bound(m, pp, setting.checkpointing)
        if bound >= beat:  # not worth solving the sharded chain
            return Candidate(dims, setting, bound=bound)
    chain, units = _chain(p, dims, micro_batch, z)
    idle = rules.idle_tp_refusal(p.graph, dims.tp, [o.strategy for o in chain.options])
    if idle:
        return Candidate(dims, setting, reason=f"{idle} (here no split saves more time than it costs)")
    if len(units) < pp:
        return Candidate(dims, setting, reason=f"pp={pp}: the model has only {len(units)} places to start a stage")
    stage_setting = p.stage_setting(dims, setting)
    state = units.state_memory(stage_setting)
    if state > p.limit:
        return Candidate(dims, setting, memory=state, reason=_state_too_big(state, dims, setting, p.limit))
    total = units.total_time(stage_setting)
    bound = (m - 1) * max(total / pp, max(units.time)) + total
    if bound >= beat:
        return Candidate(dims, setting, bound=bound)
    return _candidate(p, dims, setting, chain, units, StageCosts(units, stage_setting))


def _candidate(p: Problem, dims: ParallelDims, setting: Setting, chain: Chain, units: Units,
               costs: StageCosts) -> Candidate:
    if dims.pp == 1:
        cuts = ()
    else:
        index = best_cuts(costs, p.limit)
        if index is None:
            whole = costs.memory(0, len(costs.units), 0).total / dims.pp
            return Candidate(dims, setting, memory=whole, reason=_too_big(costs, dims, setting, p.limit))
        cuts = tuple(units.starts[u] for u in index)
    step, memory, comm = price(p, dims, setting, chain, cuts, units=units)
    peak = max(mem.total for mem in memory)
    if peak > p.limit:
        return Candidate(dims, setting, memory=peak, reason=_too_big(costs, dims, setting, p.limit, memory))
    plan = _plan(p, dims, setting, chain, cuts, prediction_of(p.c, step, memory, comm))
    return Candidate(dims, setting, step, peak, plan)


def _describe(dims: ParallelDims) -> str:
    return f"dp={dims.dp} spatial={'x'.join(map(str, dims.spatial))} tp={dims.tp} pp={dims.pp}"


def _state_too_big(state: float, dims: ParallelDims, setting: Setting, limit: float) -> str:
    return (f"{_describe(dims)} zero={setting.sharding}: parameters, gradients and optimizer state alone need "
            f"{state / 2**30:.3g} GiB per device > {limit / 2**30:.3g} GiB")


def _too_big(costs, dims: ParallelDims, setting: Setting, limit: float, memory=None) -> str:
    memory = memory or [costs.memory(0, len(costs.units), 0)]
    worst = max(memory, key=lambda mem: mem.total)
    parts = ", ".join(f"{k} {v / 2**30:.3g}" for k, v in worst.as_dict().items() if k != "total" and v)
    return (f"{_describe(dims)} m={setting.micro_batches} zero={setting.sharding}"
            f"{' ckpt' if setting.checkpointing else ''} needs {worst.total / 2**30:.3g} GiB per device ({parts}) "
            f"> {limit / 2**30:.3g} GiB")


def prediction_of(c: Constraints, step: float, memory: list[cost.Memory], comm: dict) -> Prediction:
    """The plan's prediction: its step time, the worst rank's memory, exposed communication by kind."""
    worst = max(memory, key=lambda mem: mem.total)
    comm = dict(comm)
    compute = comm.pop("compute")
    return Prediction(step, compute, worst.as_dict(), comm, c.global_batch / step if step else 0.0)


def _plan(p: Problem, dims: ParallelDims, setting: Setting, chain: Chain, cuts: tuple[int, ...],
          prediction: Prediction) -> Plan:
    graph, c = p.graph, p.c
    layers = tuple((graph.layers[i].name, o.strategy) for i, o in enumerate(chain.options)
                   if o.strategy != "replicate")
    return Plan(dp=dims.dp, spatial=dims.spatial, tp=dims.tp, pp=dims.pp, global_batch=c.global_batch,
                micro_batches=setting.micro_batches, sharding=setting.sharding, checkpointing=setting.checkpointing,
                stages=tuple(graph.layers[b].name for b in cuts), layers=layers, optimizer=c.optimizer, dtype=c.dtype,
                input_shape=(c.global_batch,) + graph.input_shape[1:], model=graph.name, cluster=p.cluster.name,
                prediction=prediction)

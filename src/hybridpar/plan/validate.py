"""A plan checked against its model and cluster, and priced: the same code for a hand-written plan
and for one the search found. Every error names the layer, stage or degree at fault and the fix."""

from __future__ import annotations

import math
from dataclasses import replace

from hybridpar.errors import PlanError
from hybridpar.plan import rules
from hybridpar.plan.chains import Caches, Chain, context, options_of
from hybridpar.plan.cluster import ClusterSpec
from hybridpar.plan.graph import ModelGraph
from hybridpar.plan.options import R, S, check_grid, redistribution
from hybridpar.plan.pricing import Problem, legal_starts, prediction_of, price
from hybridpar.plan.space import Constraints, Setting
from hybridpar.plan.types import SCHEDULES, SHARDING_NAMES, Plan


def chain_of(graph: ModelGraph, ctx, strategies: dict[str, str], cache: Caches | None = None) -> Chain:
    """The chain that runs each layer with ``strategies[name]`` (default ``replicate``), with the layout changes
    between layers that those strategies need; a ``PlanError`` if the rules refuse them (``rules.check_assignment``,
    ``rules.check_shared``): the runtime's own checks."""
    cache = Caches() if cache is None else cache
    split = any(s != "replicate" for s in strategies.values())
    if split and ctx.tp == 1:
        raise PlanError(f"the plan splits layers over tp ({strategies}) but tp=1; set tp, or drop layers")
    found = rules.check_assignment(graph, strategies, ctx.tp, spatial=math.prod(ctx.grid) > 1,
                                   sharded=ctx.sharded) if split else {}
    rules.check_shared(graph, strategies)
    options, paid, layouts = [], [], []
    for i, layer in enumerate(graph.layers):
        wanted = strategies.get(layer.name, "replicate")
        option = next(o for o in options_of(layer, graph, ctx, cache) if o.strategy == wanted)
        gather, sliced, out = found.get(i, (False, False, None))
        options.append(option)
        paid.append(redistribution(layer, option, gather, sliced, ctx.tp_group))
        layouts.append(R if out is None else S)
    return Chain(tuple(options), tuple(paid), tuple(layouts))


def validate(plan: Plan, graph: ModelGraph, cluster: ClusterSpec, *, overlap_halo: bool = True) -> Plan:
    """``plan`` with its prediction, if it fits ``graph`` on ``cluster``; a ``PlanError`` naming what does not."""
    _check_degrees(plan, cluster)
    plan.check_uneven()
    check_grid(graph, plan.grid if graph.spatial_ndim else ())
    for name, _ in plan.layers:
        graph.index_of(name)
    c = Constraints(global_batch=plan.global_batch, dtype=plan.dtype, optimizer=plan.optimizer,
                    overlap_halo=overlap_halo)
    micro_batch = plan.global_batch // (plan.dp * plan.micro_batches)
    ctx = context(cluster, c, plan.dims, micro_batch, sequence_parallel=plan.sequence_parallel, sharding=plan.sharding)
    chain = chain_of(graph, ctx, dict(plan.layers))
    cuts = _cuts(plan, graph, chain)
    setting = Setting(plan.micro_batches, plan.sharding, plan.checkpointing)
    step, memory, comm = price(Problem(graph, cluster, c), plan.dims, setting, chain, cuts, schedule=plan.schedule)
    for stage, mem in enumerate(memory):
        if mem.total > cluster.device_memory:
            first = graph.layers[([0] + list(cuts))[stage]].name
            raise PlanError(f"stage {stage} (from layer {first!r}) needs {mem.total / 2**30:.3g} GiB per device "
                            f"({_breakdown(mem)}) > {cluster.device_memory / 2**30:.3g} GiB of {cluster.name}; "
                            "use more sharding, checkpointing, more micro-batches or more stages")
    return replace(plan, prediction=prediction_of(c, step, memory, comm))


def _check_degrees(plan: Plan, cluster: ClusterSpec) -> None:
    dims = plan.dims  # checks each degree
    if dims.world_size != cluster.num_devices:
        raise PlanError(f"{dims.describe()} = {dims.world_size} devices, but the cluster has {cluster.num_devices}; "
                        "change the degrees so that they multiply to the device count")
    if plan.global_batch < 1 or plan.global_batch % (plan.dp * plan.micro_batches):
        raise PlanError(f"global_batch = {plan.global_batch} does not split into dp={plan.dp} replicas of "
                        f"{plan.micro_batches} micro-batches; use a multiple of {plan.dp * plan.micro_batches}")
    if plan.micro_batches < 1 or (plan.pp == 1 and plan.micro_batches != 1):
        raise PlanError(f"micro_batches = {plan.micro_batches}: use 1 without pipeline stages (pp=1), "
                        "and at least 1 with them")
    if plan.sharding not in SHARDING_NAMES:
        raise PlanError(f"sharding = {plan.sharding!r}: use 0 (DDP), 1, 2 or 3 (FSDP)")
    check_stage_count(plan.schedule, len(plan.stages), plan.pp)


def check_stage_count(schedule: str, boundaries: int, pp: int) -> None:
    """The plan's ``schedule`` is known and its ``boundaries`` stage boundaries make the stages it runs:
    ``pp`` of them, or under interleaved 1F1B a multiple of ``pp``, at least ``2 pp``."""
    if schedule not in SCHEDULES:
        raise PlanError(f"schedule = {schedule!r}: use one of {', '.join(SCHEDULES)}")
    stages = boundaries + 1
    if schedule == "interleaved-1f1b" and pp > 1:
        if stages % pp or stages < 2 * pp:
            raise PlanError(f"interleaved-1f1b with pp={pp} needs a multiple of {pp} stages, at least {2 * pp}, "
                            f"but the plan's {boundaries} stage boundaries make {stages}")
    elif stages != pp:
        raise PlanError(f"pp={pp} needs {pp - 1} stage boundaries (the first layer of each stage after the first), "
                        f"but the plan lists {boundaries}; interleaved-1f1b runs several stages per rank")


def _cuts(plan: Plan, graph: ModelGraph, chain: Chain) -> tuple[int, ...]:
    index = {layer.name: layer.index for layer in graph.layers}
    legal = set(legal_starts(graph, chain)) - {0}
    cuts = []
    for name in plan.stages:
        if name not in index:
            raise PlanError(f"stage boundary {name!r} is not a layer of the model")
        if index[name] not in legal:
            allowed = [graph.layers[i].name for i in sorted(legal)]
            raise PlanError(f"a stage cannot start at layer {name!r}: more than one tensor (or a tp-split one) "
                            f"crosses there; stages can start at {some(allowed)}")
        cuts.append(index[name])
    if cuts != sorted(set(cuts)):
        raise PlanError(f"stage boundaries {list(plan.stages)} must be distinct and in the model's order")
    return tuple(cuts)


def _breakdown(mem) -> str:
    return ", ".join(f"{k} {v / 2**30:.3g}" for k, v in mem.as_dict().items() if k != "total" and v)


def some(names: list[str], limit: int = 8) -> str:
    head = ", ".join(names[:limit])
    return head + (f", ... ({len(names)} in all)" if len(names) > limit else "")


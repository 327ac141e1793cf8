"""A plan checked against its model and cluster, and priced: the same code for a hand-written plan and for one the
search found. The model's rules are the IR's one check (``hybridpar.ir.check``: what the runtime runs); then the
cluster's (the device count, the batch each device takes, memory). Every error names the layer, stage or degree at
fault and the fix."""

from __future__ import annotations

import math
from dataclasses import replace

from hybridpar.errors import PlanError
from hybridpar.ir.check import check, check_strategies
from hybridpar.ir.graph import ModelGraph
from hybridpar.ir.types import Plan
from hybridpar.plan.chains import Caches, Chain, context, options_of
from hybridpar.plan.cluster import ClusterSpec
from hybridpar.plan.options import R, S, redistribution
from hybridpar.plan.pricing import Problem, prediction_of, price
from hybridpar.plan.space import Constraints, Setting


def chain_of(graph: ModelGraph, ctx, strategies: dict[str, str], cache: Caches | None = None) -> Chain:
    """The chain that runs each layer with ``strategies[name]`` (default ``replicate``), with the layout changes
    between layers those strategies need; a ``PlanError`` where the IR's rules refuse them
    (``ir.check.check_strategies``, as the runtime's check does)."""
    cache = Caches() if cache is None else cache
    if ctx.tp == 1 and any(s != "replicate" for s in strategies.values()):
        raise PlanError(f"the plan splits layers over tp ({strategies}) but tp=1; set tp, or drop layers")
    splits = check_strategies(strategies, graph, ctx.tp, sequence_parallel=ctx.sequence_parallel,
                              spatial=math.prod(ctx.grid) > 1, sharded=ctx.sharded) if ctx.tp > 1 else {}
    options, paid, layouts = [], [], []
    for layer in graph.layers:
        split = splits.get(layer.name)
        wanted = split.strategy if split is not None else "replicate"
        option = next(o for o in options_of(layer, graph, ctx, cache) if o.strategy == wanted)
        gather, sliced = (split.gather_output, split.slice_input) if split is not None else (False, False)
        options.append(option)
        paid.append(redistribution(layer, option, gather, sliced, ctx.tp_group))
        layouts.append(S if split is not None and split.leaves_split else R)
    return Chain(tuple(options), tuple(paid), tuple(layouts))


def validate(plan: Plan, graph: ModelGraph, cluster: ClusterSpec, *, overlap_halo: bool = True) -> Plan:
    """``plan`` with its prediction, if it runs on ``graph`` (``ir.check``) and fits ``cluster``; a ``PlanError``
    naming what does not."""
    _check_cluster(plan, cluster)
    checked = check(plan, graph)
    c = Constraints(global_batch=plan.global_batch, dtype=plan.dtype, optimizer=plan.optimizer,
                    overlap_halo=overlap_halo)
    micro_batch = plan.global_batch // (plan.dp * plan.micro_batches)
    ctx = context(cluster, c, plan.dims, micro_batch, sequence_parallel=plan.sequence_parallel, sharding=plan.sharding)
    chain = chain_of(graph, ctx, dict(plan.layers))
    cuts = checked.cuts
    setting = Setting(plan.micro_batches, plan.sharding, plan.checkpointing)
    step, memory, comm = price(Problem(graph, cluster, c), plan.dims, setting, chain, cuts, schedule=plan.schedule)
    for stage, mem in enumerate(memory):
        if mem.total > cluster.device_memory:
            first = graph.layers[([0] + list(cuts))[stage]].name
            raise PlanError(f"stage {stage} (from layer {first!r}) needs {mem.total / 2**30:.3g} GiB per device "
                            f"({_breakdown(mem)}) > {cluster.device_memory / 2**30:.3g} GiB of {cluster.name}; "
                            "use more sharding, checkpointing, more micro-batches or more stages")
    return replace(plan, prediction=prediction_of(c, step, memory, comm))


def _check_cluster(plan: Plan, cluster: ClusterSpec) -> None:
    """The plan's degrees against the cluster's devices, and its batch: the one it is priced for."""
    dims = plan.dims  # checks each degree
    if dims.world_size != cluster.num_devices:
        raise PlanError(f"{dims.describe()} = {dims.world_size} devices, but the cluster has {cluster.num_devices}; "
                        "change the degrees so that they multiply to the device count")
    if plan.global_batch < 1 or plan.global_batch % (plan.dp * plan.micro_batches):
        raise PlanError(f"global_batch = {plan.global_batch} does not split into dp={plan.dp} replicas of "
                        f"{plan.micro_batches} micro-batches; use a multiple of {plan.dp * plan.micro_batches}")


def _breakdown(mem) -> str:
    return ", ".join(f"{k} {v / 2**30:.3g}" for k, v in mem.as_dict().items() if k != "total" and v)

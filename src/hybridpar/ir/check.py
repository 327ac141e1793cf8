"""``check(plan, graph)``: every rule of a plan against a model's graph, in one place and in one order, pure (no
torch, no process group). The planner's ``validate`` calls it before pricing, the runtime's ``check_plan`` before
anything is built, and the search's plans pass it (the catalogue and property tests hold that); no other code
decides whether a plan runs.

The rules, in order: the plan's own fields (sharding level, micro-batches, sequence parallelism, uneven shares and
slabs, stages and schedule, the batch); the spatial grid against every layer a slab meets (``rules.check_grid``);
tensor-parallel strategies, each split followed through every view to every reader, shared parameters split alike
and sequence parallelism (``check_strategies``); pipeline stages where the model can be cut with nothing split
crossing, the blocks and state each stage holds, the micro-batches the schedule takes, checkpointed stages.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from hybridpar.errors import PlanError
from hybridpar.ir import rules
from hybridpar.ir.graph import ModelGraph
from hybridpar.ir.rules import TP_STRATEGIES, Split
from hybridpar.ir.types import SHARDING_NAMES, Plan


@dataclass(frozen=True)
class Checked:
    """What ``check`` found: the graph it checked, the tensor-parallel split of each layer that does not
    replicate, the layers that start pipeline stages 2.. (``cuts``), the block names of each stage (one group of
    every block without a pipeline) and the stages that hold a copy of each parameter and buffer."""

    graph: ModelGraph
    splits: dict[str, Split]
    cuts: tuple[int, ...]
    groups: tuple[tuple[str, ...], ...]
    holders: dict[str, tuple[int, ...]]  # the stages that hold a copy of each state-dict entry
    micro_graph: ModelGraph | None = None  # a pipeline's graph for one micro-batch (the shapes its stages exchange)

    @property
    def split_layers(self) -> frozenset[int]:
        return split_layers(self.graph, self.splits)


def check(plan: Plan, graph: ModelGraph) -> Checked:
    """Every rule of ``plan`` against ``graph`` (the module doc), or a ``PlanError`` naming the first that fails,
    its place and the fix: the same answer on every rank, before any communication."""
    _check_fields(plan, graph)
    spatial = math.prod(plan.spatial) > 1
    sharded = plan.sharding > 0 and math.prod(plan.spatial) * plan.dp > 1
    if spatial:
        rules.check_grid(graph, plan.grid)
    splits = check_strategies(dict(plan.layers), graph, plan.tp, sequence_parallel=plan.sequence_parallel,
                              spatial=spatial, sharded=sharded) if plan.tp > 1 else {}
    idle = rules.idle_tp_refusal(graph, plan.tp, [s.strategy for s in splits.values()])
    if idle:
        raise PlanError(f"{idle}; list the layers to split (hybridpar.parallel.tensor.pair_strategies finds them), "
                        "or use dp instead")
    cuts, groups = (), (tuple(graph.blocks),)
    if plan.pp > 1:
        cuts = rules.stage_starts(graph, plan.stages, split_layers(graph, splits).__contains__)
        groups = tuple(tuple(g) for g in rules.stage_groups(graph, cuts))
        rules.check_micro_batches(plan.micro_batches, len(groups), plan.pp, plan.schedule)
        _check_stages(plan, graph)
    holders = rules.holding_stages(graph.state, [list(g) for g in groups], plan.pp)
    return Checked(graph, splits, cuts, groups, holders)


def _check_fields(plan: Plan, graph: ModelGraph) -> None:
    """The plan's own fields, against the model's layers, each other and the batch."""
    for name, _ in plan.layers:
        graph.index_of(name)
    if plan.sharding not in SHARDING_NAMES:
        raise PlanError(f"sharding = {plan.sharding!r}: use 0 (DDP), 1, 2 or 3 (FSDP)")
    if plan.micro_batches < 1 or (plan.pp == 1 and plan.micro_batches != 1):
        raise PlanError(f"micro_batches = {plan.micro_batches}: use 1 without pipeline stages (pp=1), and at least "
                        "1 with them")
    if plan.sequence_parallel and plan.tp == 1:
        raise PlanError("sequence_parallel = true needs tp > 1: it splits along the sequence what the "
                        "tensor-parallel ranks would otherwise each hold whole")
    if plan.tp == 1 and plan.layers and any(s != "replicate" for _, s in plan.layers):
        raise PlanError(f"the plan splits layers over tp ({dict(plan.layers)}) but tp=1; set tp, or drop layers")
    if plan.pp == 1 and plan.stages:
        raise PlanError(f"the plan lists stage boundaries {list(plan.stages)} but pp=1; set pp or drop stages")
    plan.check_uneven()
    rules.check_stage_count(plan.schedule, len(plan.stages), plan.pp)
    batch = step_batch(plan, graph.batch)
    if not plan.shares and batch % (plan.dp * plan.micro_batches):
        raise PlanError(f"a global batch of {batch} does not split into dp={plan.dp} replicas of "
                        f"micro_batches={plan.micro_batches} equal micro-batches; use a batch that is a multiple of "
                        f"{plan.dp * plan.micro_batches}")


def _check_stages(plan: Plan, graph: ModelGraph) -> None:
    """What pipeline stages need of the model besides where they are cut."""
    if plan.checkpointing and rules.checkpointed_stages_refusal(graph):
        raise PlanError(rules.checkpointed_stages_refusal(graph))
    refused = rules.pipeline_norm_refusal(graph, plan.micro_batches)
    if refused:
        raise PlanError(refused)
    if math.prod(plan.spatial) > 1 and not graph.is_chain:
        raise PlanError(f"pipeline stages with spatial={plan.spatial} need a model whose forward applies its "
                        f"blocks one after another to each other's output ({graph.name} passes them other "
                        "values too); use spatial or pipeline parallelism, not both")


def split_layers(graph: ModelGraph, splits: Mapping[str, Split]) -> frozenset[int]:
    """The layers whose output leaves split over tp (a shard layer's, a column layer's that is not gathered)."""
    return frozenset(graph.index_of(name) for name, s in splits.items() if s.leaves_split)


def step_batch(plan: Plan, example_batch: int) -> int:
    """The samples of one step: the plan's global batch, or (a plan without one) the example input's."""
    return example_batch if plan.global_batch <= 1 else plan.global_batch


def replica_batch(plan: Plan, example_batch: int) -> int:
    """The samples of one replica per step (even shares)."""
    return step_batch(plan, example_batch) // plan.dp


def check_strategies(strategies: Mapping[str, str], graph: ModelGraph, tp: int, *, sequence_parallel: bool = False,
                     spatial: bool = False, sharded: bool = False) -> dict[str, Split]:
    """The tensor-parallel rules (``rules.check_assignment``, ``rules.check_shared``: names, strategies, module
    types, divisibility, heads, and the split followed through views to every reader); with
    ``sequence_parallel``, that the replicated layers can run on sequence shards (``rules.sequence_splits``)."""
    for name, strategy in strategies.items():
        graph.index_of(name)
        if strategy not in TP_STRATEGIES:
            raise PlanError(f"layer {name!r}: tensor-parallel strategy {strategy!r}; use one of "
                            f"{', '.join(TP_STRATEGIES)} (or leave the layer out to replicate it)")
    found = rules.check_assignment(graph, strategies, tp, spatial=spatial, sharded=sharded)
    rules.check_shared(graph, strategies)
    splits = {}
    for i, (gather, sliced, _) in found.items():
        layer = graph.layers[i]
        kind = layer.kind if layer.kind in rules.SPLITTABLE and layer.exact else "op"
        written = any(graph.layers[c].inplace for c in graph.consumers[i])
        splits[layer.name] = Split(strategies[layer.name], gather, sliced, kind=kind, clone_output=written)
    wanted = [strategies.get(layer.name, "replicate") for layer in graph.layers]
    return rules.sequence_splits(graph, wanted, splits) if sequence_parallel else splits


__all__ = ["Checked", "check", "check_strategies", "replica_batch", "split_layers", "step_batch"]

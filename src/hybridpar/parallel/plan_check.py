"""``check_plan``: every check of a plan against a model that needs no process group, identical on every rank and
made before any communication, by the rules the planner reads (``hybridpar.plan.rules``): mesh sizes, layer
names and strategies, divisibility, heads, splits followed to every reader, shared parameters, the spatial
grid, pipeline cuts and what crosses them (each stage dry-run on the meta device), batch sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from hybridpar.errors import PlanError
from hybridpar.mesh import AXES
from hybridpar.parallel import pipeline
from hybridpar.parallel.tensor import check_strategies
from hybridpar.plan import check_grid, rules
from hybridpar.plan.analysis import graph_of, input_dtype_of
from hybridpar.plan.graph import ModelGraph
from hybridpar.plan.types import SHARDING_NAMES, Plan


@dataclass(frozen=True)
class Checked:
    """What ``check_plan`` found: the model's graph (and, for a pipeline, its graph for one micro-batch, whose
    shapes the stages exchange), the tensor-parallel splits, the block names of each pipeline stage."""

    graph: ModelGraph
    splits: dict
    groups: list
    micro_graph: ModelGraph | None = None


def check_plan(model: nn.Module, plan: Plan, example_input: torch.Tensor | None = None,
               graph: ModelGraph | None = None) -> Checked:
    """Every check of ``plan`` against ``model`` that needs no process group, identical on every rank (``model``
    may live on the meta device; ``graph``: its layer graph, if the caller has analysed it already): the
    rules the planner reads (``hybridpar.plan.rules``), or a ``PlanError``."""
    if plan.sharding not in SHARDING_NAMES:
        raise PlanError(f"sharding = {plan.sharding!r}: use 0 (DDP), 1, 2 or 3 (FSDP)")
    if plan.pp == 1 and plan.micro_batches != 1:
        raise PlanError(f"micro_batches = {plan.micro_batches}: use 1 without pipeline stages (pp=1)")
    if plan.sequence_parallel and plan.tp == 1:
        raise PlanError("sequence_parallel = true needs tp > 1: it splits along the sequence what the "
                        "tensor-parallel ranks would otherwise each hold whole")
    if plan.tp == 1 and plan.layers and any(s != "replicate" for _, s in plan.layers):
        raise PlanError(f"the plan splits layers over tp ({dict(plan.layers)}) but tp=1; set tp, or drop layers")
    plan.check_uneven()
    example = _example(model, plan, example_input)  # its shape and dtype: every rank analyses the same zeros
    example = torch.zeros(example.shape, dtype=example.dtype, device="meta")
    graph = graph or graph_of(model, example, dtype=_dtype_name(model))
    spatial, sharded = math.prod(plan.spatial) > 1, plan.sharding > 0 and math.prod(plan.spatial) * plan.dp > 1
    if spatial:
        check_grid(graph, plan.grid)  # the spatial runtime's rules, before its first exchange
    splits = check_strategies(dict(plan.layers), graph, plan.tp, sequence_parallel=plan.sequence_parallel,
                              spatial=spatial, sharded=sharded) if plan.tp > 1 else {}
    idle = rules.idle_tp_refusal(graph, plan.tp, [s.strategy for s in splits.values()])
    if idle:
        raise PlanError(f"{idle}; list the layers to split (hybridpar.parallel.tensor.pair_strategies finds them), "
                        "or use dp instead")
    groups = _stage_groups(model, graph, plan)
    holding_stages(model.state_dict(), groups, plan.pp)  # every parameter and buffer in a block
    _check_cuts_whole(graph, plan, splits)
    micro = None
    if plan.pp > 1 and plan.checkpointing and rules.checkpointed_stages_refusal(graph):
        raise PlanError(rules.checkpointed_stages_refusal(graph))
    if plan.pp > 1:
        if spatial and not graph.is_chain:
            raise PlanError(f"pipeline stages with spatial={plan.spatial} need a model whose forward applies its "
                            f"blocks one after another to each other's output ({graph.name} passes them other "
                            "values too); use spatial or pipeline parallelism, not both")
        micro = _micro_graph(model, plan, graph, example, groups)
    return Checked(graph, splits, groups, micro)


def _check_cuts_whole(graph: ModelGraph, plan: Plan, splits: dict) -> None:
    """What crosses a pipeline cut is whole over tp (a stage receives the global shapes of the analysis)."""
    split = {graph.index_of(name) for name, s in splits.items()
             if s.strategy == "shard" or (s.strategy == "column" and not s.gather_output)}
    sources = rules.crossing_sources(graph) if split and graph.blocks else {}
    for start in plan.stages:
        block = graph.block_index[graph.index_of(start)]
        inside = sorted(sources.get(block, frozenset()) & split)
        if inside:
            raise PlanError(f"a stage cannot start at {start!r}: {graph.layers[inside[0]].name!r} leaves its output "
                            "split over tp there; cut outside the layers that split together")


def _micro_graph(model: nn.Module, plan: Plan, graph: ModelGraph, example, groups: list[list[str]]) -> ModelGraph:
    """The graph of one micro-batch: the shapes the pipeline stages exchange and stand in for; each stage is
    run on the meta device, as it will run, so that a forward the stages cannot run fails here."""
    size = replica_batch(plan, graph.input_shape[0]) // plan.micro_batches
    piece = torch.zeros((size,) + tuple(example.shape[1:]), dtype=example.dtype, device="meta")
    micro = graph_of(model, piece, dtype=_dtype_name(model))
    pipeline.check_stages(model, micro, groups)
    return micro


def check_mesh(plan: Plan, mesh: DeviceMesh) -> None:
    names = tuple(mesh.mesh_dim_names or ())
    if names != AXES:
        raise PlanError(f"mesh axes {names}: hybridpar.parallelize takes a mesh with axes {AXES} "
                        "(hybridpar.mesh.build_mesh builds it)")
    sizes = dict(zip(names, mesh.shape))
    wanted = plan.dims.sizes()
    if sizes != wanted:
        raise PlanError(f"the mesh has {sizes} ranks per axis, but the plan ({plan.describe()}) needs {wanted}; "
                        "build the mesh from the plan's degrees (hybridpar.mesh.build_mesh(plan.dims, world_size))")


def _example(model: nn.Module, plan: Plan, example_input: torch.Tensor | None):
    if example_input is not None:
        return example_input
    if not plan.input_shape:
        raise PlanError("the plan has no input_shape; pass example_input= (one batch of the model's input)")
    return torch.zeros(plan.input_shape, dtype=input_dtype_of(model))


def _dtype_name(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return str(param.dtype).removeprefix("torch.") if param is not None else "float32"


def _stage_groups(model: nn.Module, graph: ModelGraph, plan: Plan) -> list[list[str]]:
    if plan.pp == 1:
        if plan.stages:
            raise PlanError(f"the plan lists stage boundaries {list(plan.stages)} but pp=1; set pp or drop stages")
        return [list(graph.blocks)]
    batch = replica_batch(plan, graph.input_shape[0])
    if batch % plan.micro_batches:
        raise PlanError(f"a replica's batch of {batch} does not split into micro_batches={plan.micro_batches} "
                        "equal micro-batches; use a batch that is a multiple of micro_batches")
    groups = pipeline.stage_units(graph, plan.stages, plan.pp, plan.schedule)
    pipeline.check_micro_batches(plan.micro_batches, len(groups), plan.pp, plan.schedule)
    return groups


def replica_batch(plan: Plan, example_batch: int) -> int:
    """The samples of one replica per step: of the plan's global batch, or of the example input's."""
    return (example_batch if plan.global_batch <= 1 else plan.global_batch) // plan.dp


def holding_stages(names, groups: list[list[str]], pp: int) -> dict[str, int]:
    """The pipeline stage that holds each state-dict entry (pp rank: the stage modulo ``pp``)."""
    if pp == 1:
        return dict.fromkeys(names, 0)
    stage_of = {unit: i for i, group in enumerate(groups) for unit in group}
    out = {}
    for name in names:
        unit = next((u for u in stage_of if name.startswith(u + ".")), None)
        if unit is None:
            raise PlanError(f"{name!r} belongs to none of the model's blocks; hybridpar.parallelize needs every "
                            "parameter and buffer of a pipelined model inside a block (a child module)")
        out[name] = stage_of[unit]
    return out

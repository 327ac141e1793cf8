"""``check_plan``: every check of a plan against a model that needs no process group, identical on every rank and
made before any communication: the rules (``hybridpar.ir.check``: layer names and strategies, divisibility,
heads, splits followed to every reader, shared parameters, the spatial grid, pipeline cuts and what crosses them,
batch sizes), then each pipeline stage dry-run on the meta device; and the mesh against the plan (``check_mesh``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from hybridpar.errors import PlanError
from hybridpar.ir.analysis import graph_of, input_dtype_of
from hybridpar.ir.check import Checked, check, replica_batch
from hybridpar.ir.graph import ModelGraph
from hybridpar.ir.types import Plan
from hybridpar.mesh import AXES
from hybridpar.parallel import pipeline


def check_plan(model: nn.Module, plan: Plan, example_input: torch.Tensor | None = None,
               graph: ModelGraph | None = None) -> Checked:
    """Every check of ``plan`` against ``model`` that needs no process group, identical on every rank (``model``
    may live on the meta device; ``graph``: its layer graph, if the caller has analysed it already): the rules
    (``hybridpar.ir.check``), then each pipeline stage run on the meta device as it will run; or a ``PlanError``."""
    example = _example(model, plan, example_input)  # its shape and dtype: every rank analyses the same zeros
    example = torch.zeros(example.shape, dtype=example.dtype, device="meta")
    graph = graph or graph_of(model, example, dtype=_dtype_name(model))
    checked = check(plan, graph)
    if plan.pp > 1:
        checked = replace(checked, micro_graph=_micro_graph(model, plan, graph, checked.groups))
    return checked


def _micro_graph(model: nn.Module, plan: Plan, graph: ModelGraph, groups) -> ModelGraph:
    """The graph of one micro-batch (``ModelGraph.at_batch``, no second trace): the shapes the pipeline stages
    exchange and stand in for; each stage is run on the meta device, as it will run, so that a forward the stages
    cannot run fails here, and what each sends is what it was found to send."""
    micro = graph.at_batch(replica_batch(plan, graph.batch) // plan.micro_batches)
    return pipeline.check_stages(model, micro, [list(g) for g in groups])


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

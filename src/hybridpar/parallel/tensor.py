"""Tensor parallelism from a model's structure: Megatron's column / row pairs found in the layer graph and
applied with PyTorch's DTensor (``parallelize_module``), convolutions with ``parallel.channels``.

``pair_strategies(graph)`` finds, without a per-model table, every layer (``nn.Linear`` or a conv) whose
output reaches exactly one other such layer through pointwise layers only (activations, dropout): the
first is split by its outputs (``column``), the second by its inputs (``row``), and nothing is exchanged
between them. ``tensor_parallel(model, strategies, mesh)`` applies a ``{layer name: strategy}`` mapping
(the pairs, or a plan's ``layers``) over a 1-D tp mesh: linear layers become ``ColwiseParallel`` /
``RowwiseParallel`` DTensor modules, convolutions filter- / channel-parallel ones. Every layer is
checked before anything is split or exchanged, with errors naming the layer.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hybridpar.errors import PlanError
from hybridpar.parallel.channels import CONVS, channel_parallel, filter_parallel
from hybridpar.plan.graph import ModelGraph

SPLITTABLE = frozenset({"linear", "conv"})
PASS_THROUGH = frozenset({"pointwise"})  # layers a column-split activation crosses unchanged


def pair_strategies(graph: ModelGraph) -> dict[str, str]:
    """``{layer name: "column" or "row"}`` for every column / row pair of the graph (see the module doc)."""
    consumers: dict[int, list[int]] = {}
    for layer in graph.layers:
        for producer in layer.inputs:
            consumers.setdefault(producer, []).append(layer.index)
    strategies: dict[str, str] = {}
    for layer in graph.layers:
        if layer.kind not in SPLITTABLE or layer.name in strategies:
            continue
        partner = _partner(graph, consumers, layer.index)
        if partner is not None:
            strategies[layer.name] = "column"
            strategies[graph.layers[partner].name] = "row"
    return strategies


def _partner(graph: ModelGraph, consumers: dict[int, list[int]], index: int) -> int | None:
    """The one splittable layer of the same kind that the output of layer ``index`` reaches through
    single-consumer pointwise layers, if it reads nothing else."""
    kind = graph.layers[index].kind
    current = index
    while True:
        after = consumers.get(current, [])
        if len(after) != 1:
            return None
        nxt = graph.layers[after[0]]
        if nxt.inputs != (current,):
            return None
        if nxt.kind == kind:
            return nxt.index
        if nxt.kind not in PASS_THROUGH:
            return None
        current = nxt.index


def tensor_parallel(model: nn.Module, strategies: Mapping[str, str], mesh: DeviceMesh) -> nn.Module:
    """Split the layers named in ``strategies`` over the 1-D ``mesh`` (in place; returns ``model``)."""
    parts = mesh.size()
    styles, convs = {}, {}
    for name, strategy in strategies.items():
        module = _layer(model, name)
        if strategy not in ("column", "row"):
            raise PlanError(f"layer {name!r}: tensor-parallel strategy {strategy!r}; use 'column' or 'row' "
                            "(or leave the layer out to replicate it)")
        if isinstance(module, nn.Linear):
            features = module.out_features if strategy == "column" else module.in_features
            _check_divides(name, "out_features" if strategy == "column" else "in_features", features, parts)
            styles[name] = ColwiseParallel() if strategy == "column" else RowwiseParallel()
        elif type(module) in CONVS:
            convs[name] = (module, strategy)
        else:
            raise PlanError(f"layer {name!r} ({type(module).__name__}) cannot be split {strategy}-wise; tensor "
                            "parallelism splits nn.Linear and Conv1d/2d/3d layers")
    split = {"column": filter_parallel, "row": channel_parallel}
    replaced = {name: split[strategy](module, mesh.get_group(), name) for name, (module, strategy) in convs.items()}
    for name, module in replaced.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, module)
    return parallelize_module(model, mesh, styles) if styles else model


def _layer(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise PlanError(f"layer {name!r} is not in the model ({type(model).__name__}); use module paths as "
                        "model.named_modules() gives them, e.g. 'blocks.0.mlp.fc'") from None


def _check_divides(name: str, field: str, value: int, parts: int) -> None:
    if value % parts:
        raise PlanError(f"layer {name!r}: {field}={value} does not split into {parts} equal parts; use a "
                        f"tensor-parallel degree that divides {value}, or replicate the layer")

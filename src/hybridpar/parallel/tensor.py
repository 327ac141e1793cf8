"""Tensor parallelism from a model's structure: Megatron's column / row splits found in the layer graph and
applied with PyTorch's DTensor (``parallelize_module``), convolutions with ``parallel.channels``.

A layer's strategy (the plan's ``layers``) says what it reads and what it leaves, over the ``tp`` ranks:

==========  ====================  ======================================================================
strategy    reads -> leaves       what runs
==========  ====================  ======================================================================
replicate   whole -> whole        the whole layer on every rank
column      whole -> split        this rank's output features / filters (Linear, conv, Embedding)
row         split -> whole        this rank's input features / channels, partial outputs summed (an
                                  Embedding: this rank's rows of the vocabulary, whole ids in)
shard       split -> split        a pointwise layer, pooling, concatenation, softmax or attention on this
                                  rank's heads, as it comes
==========  ====================  ======================================================================

What is exact is decided by ``hybridpar.ir.rules``, which the planner reads too: a split is followed from
the layer that makes it through every view to each reader (a column layer's features become attention
heads after a reshape; a rotary table of one value per head broadcasts over them), and the runtime makes two
layout changes: a column layer gathers its output for readers that read it whole, a row layer slices a
whole input. ``pair_strategies(graph, tp=...)`` splits, without a per-model table, every region the rules
find (a Megatron MLP, attention with its query / key / value projections and rotary products, a gated MLP,
a filter- then channel-parallel conv pair), the embeddings by vocabulary and the output layer by columns; a
table of overrides sets what the rules miss. ``tensor_parallel(model, strategies, mesh, graph)`` checks
everything before anything is split or exchanged (errors name the layer), then applies the strategies.
Layers that share a parameter (a head tied to the token embedding) split it alike and keep one parameter.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from hybridpar.errors import PlanError
from hybridpar.ir import rules
from hybridpar.ir.check import check_strategies
from hybridpar.ir.graph import ModelGraph
from hybridpar.ir.rules import TP_STRATEGIES, Split
from hybridpar.parallel.channels import channel_parallel, filter_parallel


def pair_strategies(graph: ModelGraph, *, tp: int, overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{layer name: strategy}`` by the rules of the module doc, for splits into ``tp`` parts that divide
    evenly (others replicate). ``overrides`` (``{pattern: strategy}``, shell-style patterns of layer names,
    the first match wins) set the layers the rules do not know, or differ on:
    ``{"blocks.*.moe.up": "column", "head": "replicate"}``."""
    strategies = _found(graph, tp)
    overrides = dict(overrides or {})
    for pattern, strategy in overrides.items():
        if strategy not in TP_STRATEGIES:
            raise PlanError(f"tensor-parallel override {pattern!r}: strategy {strategy!r}; use one of "
                            f"{', '.join(TP_STRATEGIES)}")
    used = set()
    for layer in graph.layers:
        pattern = next((p for p in overrides if fnmatch.fnmatchcase(layer.name, p)), None)
        if pattern is not None:
            used.add(pattern)
            strategies[layer.name] = overrides[pattern]
    for pattern in overrides:
        if pattern not in used:
            raise PlanError(f"tensor-parallel override {pattern!r} matches no layer of {graph.name}; layers are "
                            f"named as hybridpar.plan.graph_of gives them, e.g. {graph.layers[-1].name!r}")
    return {name: s for name, s in strategies.items() if s != "replicate"}


def _found(graph: ModelGraph, tp: int) -> dict[str, str]:
    """The regions in order (a region that overlaps one taken is left out), then the embeddings by rows and the
    output layer by columns where they stand alone; where layers that share a parameter would split it
    unalike, the regions they were in replicate, and they split alone alike where each can (a head tied to the
    embedding: the vocabulary split, Megatron's way), else replicate."""
    strategies: dict[str, str] = {}
    region_of: dict[str, list[str]] = {}
    for region in rules.regions(graph, tp) if tp > 1 else ():
        names = [graph.layers[i].name for i in region.layers]
        if not any(name in strategies for name in names):
            strategies.update(zip(names, region.strategies))
            region_of.update((name, names) for name in names)
    for layer in graph.layers:
        if layer.name in strategies or tp == 1:
            continue
        alone = rules.standalone(layer, tp)
        if layer.kind == "embedding" and "row" in alone:
            strategies[layer.name] = "row"
        elif layer.kind == "linear" and not graph.consumers[layer.index] and "column" in alone:
            strategies[layer.name] = "column"
    for names in graph.shared:
        users = [layer for layer in graph.layers if set(layer.params) & set(names)]
        if len({rules.weight_split(u, strategies.get(u.name, "replicate")) for u in users}) > 1:
            for user in users:
                for name in region_of.get(user.name, [user.name]):
                    strategies.pop(name, None)
            alike = {u.name: next((s for s in rules.standalone(u, tp) if rules.weight_split(u, s) == "dim0"), None)
                     for u in users}
            if all(alike.values()) and not any(u.name in strategies for u in users):
                strategies.update(alike)
    return strategies


def tensor_parallel(model: nn.Module, strategies: Mapping[str, str], mesh: DeviceMesh, graph: ModelGraph, *,
                    sequence_parallel: bool = False) -> nn.Module:
    """Split the layers named in ``strategies`` over the 1-D ``mesh`` (in place; returns ``model``);
    ``graph`` is ``model``'s layer graph. Everything is checked first (``check_strategies``)."""
    splits = check_strategies(strategies, graph, mesh.size(), sequence_parallel=sequence_parallel)
    return apply_splits(model, splits, mesh, graph.shared)


def apply_splits(model: nn.Module, splits: Mapping[str, Split], mesh: DeviceMesh,
                 shared: tuple[tuple[str, ...], ...] = ()) -> nn.Module:
    """Split the modules named in ``splits`` (checked by ``check_strategies``) that ``model`` holds (a pipeline
    stage holds some of them); then the names of each ``shared`` parameter that the model holds point at one
    split parameter again (DTensor splits each module's parameter on its own)."""
    styles, convs = {}, {}
    for name, split in splits.items():
        module = _held(model, name)
        if module is None or split.kind == "op":
            continue
        if split.kind == "norm":
            styles[name] = SequenceParallel(sequence_dim=split.input_seq, use_local_output=True)
        elif split.kind == "conv":
            convs[name] = (module, split)
        else:
            styles[name] = _style(split)
    group = mesh.get_group()
    for name, (module, split) in convs.items():
        parent, _, child = name.rpartition(".")
        if split.strategy == "column":
            conv = filter_parallel(module, group, name, gather_output=split.gather_output)
        else:
            conv = channel_parallel(module, group, name, slice_input=split.slice_input)
        setattr(model.get_submodule(parent) if parent else model, child, conv)
    if styles:
        parallelize_module(model, mesh, styles)
    for name, split in splits.items():
        module = _held(model, name) if split.clone_output and name in styles else None
        if module is not None:  # DTensor hands back a view of its local tensor, which autograd forbids writing into
            module.register_forward_hook(lambda m, args, out: out.clone())
    for names in shared:
        _tie(model, names)
    return model


def _tie(model: nn.Module, names: tuple[str, ...]) -> None:
    """Every name of one parameter (``names``: a weight tied to another layer's, a bias registered on a head and on
    its decoder) points at one tensor again: the split one, where DTensor split it under one of its names (the
    users that split it split it alike: ``rules.check_shared``), so that a name the split did not reach (a module
    the forward never calls, a parent that registers its child's bias) does not keep the whole tensor beside it."""
    held = [n for n in names if _has_parameter(model, n)]
    if not held:
        return
    tensors = [model.get_parameter(n) for n in held]
    one = next((t for t in tensors if isinstance(t, DTensor)), tensors[0])
    for name in held:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        owner.register_parameter(leaf, one)


def _has_parameter(model: nn.Module, name: str) -> bool:
    """Whether ``model`` holds the parameter ``name``."""
    parent, _, leaf = name.rpartition(".")
    owner = _held(model, parent) if parent else model
    return owner is not None and leaf in owner._parameters


def _held(model: nn.Module, name: str) -> nn.Module | None:
    """The module called ``name``, unless ``model`` (a pipeline stage) does not hold it: a stage's stand-in for a
    block of another stage holds nothing, whatever it answers when the model's code reads it."""
    module = model
    for part in name.split("."):
        module = module._modules.get(part)
        if module is None or getattr(module, "stands_in", False):
            return None
    return module


def _style(split: Split):
    if split.strategy == "column":
        whole = Replicate() if split.output_seq is None else Shard(split.output_seq)
        return ColwiseParallel(input_layouts=Replicate() if split.input_seq is None else Shard(split.input_seq),
                               output_layouts=whole if split.gather_output else Shard(-1))
    whole_in = split.slice_input or split.kind == "embedding"
    return RowwiseParallel(input_layouts=Replicate() if whole_in else Shard(-1),
                           output_layouts=Replicate() if split.output_seq is None else Shard(split.output_seq))



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

What is exact is decided by ``hybridpar.plan.rules``, which the planner reads too: a split is followed from
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
from dataclasses import dataclass, replace

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

from hybridpar.errors import PlanError
from hybridpar.parallel.channels import channel_parallel, filter_parallel
from hybridpar.plan import rules
from hybridpar.plan.graph import INPUT, ModelGraph
from hybridpar.plan.rules import LAYOUTS, TP_STRATEGIES, WHOLE


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
    unalike, they replicate, and so do the regions they were in."""
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
    return strategies


@dataclass(frozen=True)
class Split:
    """What ``apply_splits`` does to one module: its strategy, and the layout changes at its edges."""

    strategy: str
    gather_output: bool = False  # a column layer whose readers need its output whole
    slice_input: bool = False  # a row layer fed a whole tensor
    kind: str = "linear"  # linear, embedding, conv, norm (sequence parallelism), or op (nothing to split)
    input_seq: int | None = None  # sequence parallelism: the input arrives split along this dim
    output_seq: int | None = None  # sequence parallelism: the output leaves split along this dim


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
    for names in shared:
        _tie(model, names)
    return model


def _tie(model: nn.Module, names: tuple[str, ...]) -> None:
    held = [n for n in names if _has_parameter(model, n)]
    for name in held[1:]:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        owner.register_parameter(leaf, model.get_parameter(held[0]))


def _has_parameter(model: nn.Module, name: str) -> bool:
    try:
        model.get_parameter(name)
    except AttributeError:
        return False
    return True


def _held(model: nn.Module, name: str) -> nn.Module | None:
    """The module called ``name``, unless ``model`` (a pipeline stage) does not hold it."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return None
    return None if getattr(module, "stands_in", False) else module


def _style(split: Split):
    if split.strategy == "column":
        whole = Replicate() if split.output_seq is None else Shard(split.output_seq)
        return ColwiseParallel(input_layouts=Replicate() if split.input_seq is None else Shard(split.input_seq),
                               output_layouts=whole if split.gather_output else Shard(-1))
    whole_in = split.slice_input or split.kind == "embedding"
    return RowwiseParallel(input_layouts=Replicate() if whole_in else Shard(-1),
                           output_layouts=Replicate() if split.output_seq is None else Shard(split.output_seq))


def check_strategies(strategies: Mapping[str, str], graph: ModelGraph, tp: int, *, sequence_parallel: bool = False,
                     spatial: bool = False, sharded: bool = False) -> dict[str, Split]:
    """Every check ``tensor_parallel`` makes, with no communication (the same answer on every rank): the rules
    the planner reads too (``rules.check_assignment``, ``rules.check_shared``: names, strategies, module
    types, divisibility, heads, and the split followed through views to every reader); with
    ``sequence_parallel``, that the replicated layers can run on sequence shards (``_sequence_splits``)."""
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
        splits[layer.name] = Split(strategies[layer.name], gather, sliced, kind=kind)
    wanted = [strategies.get(layer.name, "replicate") for layer in graph.layers]
    return _sequence_splits(graph, wanted, splits) if sequence_parallel else splits


def _sequence_splits(graph: ModelGraph, wanted: list[str], splits: dict[str, Split]) -> dict[str, Split]:
    """Sequence parallelism (Korthikanti et al. 2022): every tensor that the plan keeps whole over tp is
    split along its sequence dim (``-2`` of ``(B, T, d)``) instead; column layers gather the sequence
    (all-gather), row layers and embeddings scatter their summed output along it (reduce-scatter), norms
    run as DTensor ``SequenceParallel``. So every replicated layer must work token by token, the model input
    may feed only row-split embeddings, and the model's output must come gathered from a column layer."""
    out = dict(splits)
    for layer, strategy in zip(graph.layers, wanted):
        readers = graph.consumers[layer.index]
        if strategy == "replicate":
            if layer.kind not in rules.TOKEN_WISE or not readers:
                why = "it is the model's output" if not readers else f"it is not token-wise ({layer.kind})"
                raise PlanError(f"layer {layer.name!r} ({layer.op}) is replicated, so sequence parallelism would "
                                f"run it on a sequence shard, but {why}; split it, or turn sequence_parallel off")
            if layer.is_module and layer.num_params:
                out[layer.name] = Split("replicate", kind="norm", input_seq=len(layer.in_shape) - 2)
            continue
        split = out.get(layer.name)
        if strategy == "shard" or split is None:
            continue  # heads, activations: feature-split tensors, as without sequence parallelism
        if INPUT in layer.inputs and not (split.kind == "embedding" and strategy == "row"):
            raise PlanError(f"layer {layer.name!r} reads the model input; with sequence_parallel only "
                            "embeddings split by rows may (their output leaves split along the sequence)")
        if split.kind not in ("linear", "embedding") or (split.slice_input and split.kind == "linear"):
            raise PlanError(f"layer {layer.name!r} ({layer.op}, {strategy}): sequence parallelism splits Linear "
                            "and Embedding layers fed split features; turn sequence_parallel off")
        fields = {}
        if strategy == "column" and INPUT not in layer.inputs and layer.inputs:
            fields["input_seq"] = len(layer.in_shape) - 2
        if LAYOUTS[strategy][1] == WHOLE or split.gather_output:
            fields["output_seq"] = len(layer.out_shape) - 2 if readers else None
        out[layer.name] = replace(split, **fields)
    return out

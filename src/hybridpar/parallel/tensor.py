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
shard       split -> split        a pointwise layer, pooling, or attention on this rank's heads, as it comes
==========  ====================  ======================================================================

``pair_strategies(graph, tp=...)`` finds, without a per-model table: every ``nn.Linear`` or conv whose output
reaches exactly one layer of the same kind through pointwise layers (column, shard..., row); attention
whose query, key and value come from Linear layers that only it reads and whose output reaches one
Linear (column q/k/v, shard, row); the embeddings (row: vocabulary split); and the Linear that produces
the model's output (column, gathered); a table of overrides sets what the rules miss.
``tensor_parallel(model, strategies, mesh, graph)`` checks every layer and every edge between two layers
before anything is split or exchanged (errors name the layer),
then applies the strategies: where a split output meets a layer that reads it whole, the column layer
gathers its output; where a whole output meets a row layer, the row layer takes its slice.

A *fused* projection (one Linear whose output holds q, k and v) splits exactly only if its rows are grouped
by head (Megatron's layout, ``hybridpar.models.gpt``); its attention module says so with a class attribute
``qkv_head_major = True``. Attention modules must infer their head count from the tensor (``view(B, T, -1,
hs)``), as a rank holds ``heads / tp`` of them.
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
from hybridpar.parallel.channels import CONVS, channel_parallel, filter_parallel
from hybridpar.plan.graph import INPUT, Layer, ModelGraph
from hybridpar.plan.layers import TOKEN_WISE
from hybridpar.plan.types import TP_STRATEGIES

WHOLE, SPLIT = "whole", "split"
LAYOUTS = {"replicate": (WHOLE, WHOLE), "column": (WHOLE, SPLIT), "row": (SPLIT, WHOLE), "shard": (SPLIT, SPLIT)}
SPLITTABLE = frozenset({"linear", "conv"})
PASS_THROUGH = frozenset({"pointwise"})  # layers a column-split activation crosses unchanged
SHARD_KINDS = frozenset({"pointwise", "pool", "upsample", "attention"})  # exact on a channel / head split


def pair_strategies(graph: ModelGraph, *, tp: int, model: nn.Module | None = None,
                    overrides: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{layer name: strategy}`` by the rules of the module doc, for splits into ``tp`` parts that divide
    evenly (others replicate). A fused q/k/v projection is split only if ``model`` says it is head-major.
    ``overrides`` (``{pattern: strategy}``, shell-style patterns of layer names, the first match wins) set the
    layers the rules do not know, or differ on: ``{"blocks.*.moe.up": "column", "head": "replicate"}``."""
    strategies = _found(graph, tp, model)
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


def _found(graph: ModelGraph, tp: int, model: nn.Module | None) -> dict[str, str]:
    strategies: dict[str, str] = {}
    for layer in graph.layers:
        if layer.name in strategies:
            continue
        if layer.kind == "attention":
            strategies.update(_attention_split(graph, layer, tp, model))
        elif layer.kind in SPLITTABLE and layer.channels[1] % tp == 0:
            found = _chain_to(graph, layer.index, layer.kind)
            if found is not None:
                strategies.update(_pair(graph, [layer.index], *found))
    for layer in graph.layers:
        if layer.name in strategies:
            continue
        if layer.kind == "embedding" and layer.channels[0] % tp == 0:
            strategies[layer.name] = "row"
        elif layer.kind == "linear" and not graph.consumers[layer.index] and layer.channels[1] % tp == 0:
            strategies[layer.name] = "column"
    return strategies


def _pair(graph: ModelGraph, columns: list[int], between: list[int], row: int) -> dict[str, str]:
    names = {graph.layers[i].name: "column" for i in columns}
    names.update({graph.layers[i].name: "shard" for i in between})
    names[graph.layers[row].name] = "row"
    return names


def _chain_to(graph: ModelGraph, index: int, kind: str) -> tuple[list[int], int] | None:
    """``(pointwise layers crossed, the layer of ``kind`` reached)`` from the output of layer ``index``
    through single-consumer pointwise layers, each reading nothing else; ``None`` if there is none."""
    current, between = index, []
    while True:
        after = graph.consumers[current]
        if len(after) != 1:
            return None
        nxt = graph.layers[after[0]]
        if nxt.inputs != (current,):
            return None
        if nxt.kind == kind:
            return between, nxt.index
        if nxt.kind not in PASS_THROUGH:
            return None
        between.append(nxt.index)
        current = nxt.index


def _attention_split(graph: ModelGraph, attention: Layer, tp: int, model: nn.Module | None) -> dict[str, str]:
    producers = sorted(set(attention.inputs))
    layers = [graph.layers[p] for p in producers if p != INPUT]
    if (attention.heads % tp or len(layers) != len(producers)
            or any(p.kind != "linear" or graph.consumers[p.index] != (attention.index,) for p in layers)
            or len({p.inputs for p in layers}) != 1):
        return {}
    if len(layers) == 1 and not (model is not None and _head_major(model, attention)):
        return {}
    found = _chain_to(graph, attention.index, "linear")
    if found is None:
        return {}
    between, row = found
    return _pair(graph, producers, [attention.index, *between], row)


def _head_major(model: nn.Module, attention: Layer) -> bool:
    try:
        module = model.get_submodule(attention.owner)
    except AttributeError:
        return False
    return bool(getattr(module, "qkv_head_major", False))


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
    splits = check_strategies(model, strategies, graph, mesh.size(), sequence_parallel=sequence_parallel)
    return apply_splits(model, splits, mesh)


def apply_splits(model: nn.Module, splits: Mapping[str, Split], mesh: DeviceMesh) -> nn.Module:
    """Split the modules named in ``splits`` (checked by ``check_strategies``) that ``model`` holds: a
    pipeline stage holds some of them, and ``nn.Identity`` in place of the others."""
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
    return parallelize_module(model, mesh, styles) if styles else model


def _held(model: nn.Module, name: str) -> nn.Module | None:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return None
    return None if isinstance(module, nn.Identity) else module


def _style(split: Split):
    if split.strategy == "column":
        whole = Replicate() if split.output_seq is None else Shard(split.output_seq)
        return ColwiseParallel(input_layouts=Replicate() if split.input_seq is None else Shard(split.input_seq),
                               output_layouts=whole if split.gather_output else Shard(-1))
    whole_in = split.slice_input or split.kind == "embedding"
    return RowwiseParallel(input_layouts=Replicate() if whole_in else Shard(-1),
                           output_layouts=Replicate() if split.output_seq is None else Shard(split.output_seq))


def check_strategies(model: nn.Module, strategies: Mapping[str, str], graph: ModelGraph, tp: int, *,
                     sequence_parallel: bool = False) -> dict[str, Split]:
    """Every check ``tensor_parallel`` makes, with no communication (the same answer on every rank):
    names, strategies, module types, divisibility, heads, and the layouts at every edge; with
    ``sequence_parallel``, that the replicated layers can run on sequence shards (``_sequence_splits``)."""
    by_name = {layer.name: layer for layer in graph.layers}
    for name, strategy in strategies.items():
        if name not in by_name:
            raise PlanError(f"layer {name!r} is not in the model ({type(model).__name__}); use layer names as "
                            f"hybridpar.plan.graph_of gives them (module paths, e.g. 'blocks.0.mlp.fc')")
        if strategy not in TP_STRATEGIES:
            raise PlanError(f"layer {name!r}: tensor-parallel strategy {strategy!r}; use one of "
                            f"{', '.join(TP_STRATEGIES)} (or leave the layer out to replicate it)")
    wanted = [strategies.get(layer.name, "replicate") for layer in graph.layers]
    splits = {}
    for layer, strategy in zip(graph.layers, wanted):
        if strategy == "replicate":
            continue
        module = _module(model, layer)
        _check_layer(model, graph, layer, module, strategy, tp)
        edges = _edges(graph, layer, wanted)
        if module is not None:
            splits[layer.name] = Split(strategy, *edges, kind=_kind(module))
    return _sequence_splits(model, graph, wanted, splits) if sequence_parallel else splits


def _sequence_splits(model: nn.Module, graph: ModelGraph, wanted: list[str],
                     splits: dict[str, Split]) -> dict[str, Split]:
    """Sequence parallelism (Korthikanti et al. 2022): every tensor that the plan keeps whole over tp is
    split along its sequence dim (``-2`` of ``(B, T, d)``) instead; column layers gather the sequence
    (all-gather), row layers and embeddings scatter their summed output along it (reduce-scatter), norms
    run as DTensor ``SequenceParallel``. So every replicated layer must work token by token, the model input
    may feed only row-split embeddings, and the model's output must come gathered from a column layer."""
    out = dict(splits)
    for layer, strategy in zip(graph.layers, wanted):
        module = _module(model, layer)
        readers = graph.consumers[layer.index]
        if strategy == "replicate":
            if layer.kind not in TOKEN_WISE or not readers:
                why = "it is the model's output" if not readers else f"it is not token-wise ({layer.kind})"
                raise PlanError(f"layer {layer.name!r} ({layer.op}) is replicated, so sequence parallelism would "
                                f"run it on a sequence shard, but {why}; split it, or turn sequence_parallel off")
            if module is not None and any(True for _ in module.parameters(recurse=False)):
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


def _kind(module: nn.Module | None) -> str:
    """What ``apply_splits`` makes of a module: exact types only (a subclass may compute otherwise)."""
    if type(module) in CONVS:
        return "conv"
    return {nn.Linear: "linear", nn.Embedding: "embedding"}.get(type(module), "op")


def _module(model: nn.Module, layer: Layer) -> nn.Module | None:
    """The module a layer is; ``None`` for an operation called in a forward (``'add#0'``)."""
    return model.get_submodule(layer.name) if layer.is_module else None


def _check_layer(model: nn.Module, graph: ModelGraph, layer: Layer, module: nn.Module | None, strategy: str,
                 tp: int) -> None:
    name = layer.name
    if strategy == "shard":
        if layer.kind not in SHARD_KINDS:
            raise PlanError(f"layer {name!r} ({layer.op}) cannot run 'shard' on a feature-split input; shard "
                            "runs pointwise layers, pooling and attention heads (replicate the layer instead)")
        if layer.kind == "attention":
            _check_attention(model, graph, layer, tp)
        return
    if _kind(module) == "op":
        raise PlanError(f"layer {name!r} ({layer.op}) cannot be split {strategy}-wise; tensor parallelism splits "
                        "nn.Linear, nn.Embedding and Conv1d/2d/3d layers")
    if isinstance(module, CONVS) and module.groups != 1:
        raise PlanError(f"layer {name!r}: a conv with groups={module.groups} cannot be split by channels (each "
                        "group already sees only its own channels); replicate it")
    if isinstance(module, nn.Embedding):
        field, size = ("num_embeddings", module.num_embeddings) if strategy == "row" else \
            ("embedding_dim", module.embedding_dim)
    elif isinstance(module, nn.Linear):
        field, size = ("out_features", module.out_features) if strategy == "column" else \
            ("in_features", module.in_features)
    else:
        field, size = ("out_channels", module.out_channels) if strategy == "column" else \
            ("in_channels", module.in_channels)
    if size % tp:
        raise PlanError(f"layer {name!r}: {field}={size} does not split into {tp} equal parts; use a "
                        f"tensor-parallel degree that divides {size}, or replicate the layer")


def _check_attention(model: nn.Module, graph: ModelGraph, layer: Layer, tp: int) -> None:
    if layer.heads % tp:
        raise PlanError(f"layer {layer.name!r}: {layer.heads} attention heads do not split into {tp}; use a "
                        f"tensor-parallel degree that divides {layer.heads}, or replicate the attention")
    producers = set(layer.inputs) - {INPUT}
    if len(producers) == 1 and not _head_major(model, layer):
        fused = graph.layers[producers.pop()].name
        raise PlanError(f"layer {layer.name!r} reads query, key and value from one fused projection "
                        f"{fused!r}, which splits by heads only if its rows are grouped by head; give the "
                        "attention module qkv_head_major = True if they are (Megatron's layout), split it "
                        "into three nn.Linear layers, or replicate the attention")


def _edges(graph: ModelGraph, layer: Layer, wanted: list[str]) -> tuple[bool, bool]:
    """``(gather_output, slice_input)`` of ``layer``, after checking that the layout each reader of it needs
    is one the runtime makes: a column layer gathers its output for readers that need it whole; a row
    layer slices a whole input; anything else must match."""
    strategy = wanted[layer.index]
    sliced = False
    if LAYOUTS[strategy][0] == SPLIT:
        whole = [p for p in layer.inputs if p == INPUT or LAYOUTS[wanted[p]][1] == WHOLE
                 or (wanted[p] == "column" and _edges_gather(graph, p, wanted))]
        if whole and (strategy != "row" or len(set(layer.inputs)) > 1):
            source = "the model input" if whole[0] == INPUT else repr(graph.layers[whole[0]].name)
            raise PlanError(f"layer {layer.name!r} ({strategy}) needs its input split over tp, but "
                            f"{source} gives it whole; make {source} a column or shard layer, or "
                            f"{layer.name!r} replicate")
        sliced = bool(whole)
    readers = graph.consumers[layer.index]
    needs = {LAYOUTS[wanted[c]][0] for c in readers} if readers else {WHOLE}
    gather = False
    if LAYOUTS[strategy][1] == SPLIT and WHOLE in needs:
        if strategy != "column" or len(needs) > 1:
            reader = next((repr(graph.layers[c].name) for c in readers if LAYOUTS[wanted[c]][0] == WHOLE),
                          "the model's output")
            raise PlanError(f"layer {layer.name!r} ({strategy}) leaves its output split over tp, but {reader} "
                            f"reads it whole; make {reader} shard or row, or {layer.name!r} a column layer whose "
                            "readers all read it whole")
        gather = True
    return gather, sliced


def _edges_gather(graph: ModelGraph, index: int, wanted: list[str]) -> bool:
    """Whether the column layer ``index`` gathers its output (some reader of it needs it whole)."""
    readers = graph.consumers[index]
    return not readers or any(LAYOUTS[wanted[c]][0] == WHOLE for c in readers)

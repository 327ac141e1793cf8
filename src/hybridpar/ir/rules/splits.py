"""Tensor parallelism: which layers split column-, row- or shard-wise (``tp_refusal``), how a split travels through
views to its readers and which layout changes the runtime makes (``check_assignment``: a column layer gathers its
output, a row layer slices its input), and what shares a parameter (``check_shared``, ``weight_split``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridpar.errors import PlanError
from hybridpar.ir.rules.slabs import SOFTMAX
from hybridpar.ir.rules.views import local_view_shape

TP_STRATEGIES = ("replicate", "column", "row", "shard")
SPLITTABLE = frozenset({"linear", "embedding", "conv"})  # column / row: exact nn.Linear, nn.Embedding, ConvNd
SHARD_KINDS = frozenset({"pointwise", "pool", "upsample", "attention", "cat"})  # run as they come on a split
SHARD_OPS = SOFTMAX  # operations of kind "other" that run on a split along another dim
TOKEN_WISE = frozenset({"pointwise", "layer_norm"})  # on sequence shards under sequence parallelism
FIELDS = {("linear", "column"): "out_features", ("linear", "row"): "in_features",
          ("embedding", "column"): "embedding_dim", ("embedding", "row"): "num_embeddings",
          ("conv", "column"): "out_channels", ("conv", "row"): "in_channels"}


def splits_dim(layer) -> int:
    """The dim of the output a column split divides, and of the input a row split divides: the features
    (last) of a Linear or Embedding, the channels (1) of a conv."""
    return 1 if layer.kind == "conv" else len(layer.out_shape) - 1


def tp_refusal(layer, strategy: str, tp: int, *, spatial: bool = False, sharded: bool = False) -> str | None:
    """Why ``layer`` cannot run ``strategy`` over ``tp`` ranks by itself (whatever its neighbours do): its kind,
    its type, its sizes; a conv whose parameters FSDP / ZeRO shard (``sharded``), a dense layer of a
    spatially split model (``spatial``). ``None`` if it can."""
    name = f"layer {layer.name!r}"
    if strategy not in TP_STRATEGIES:
        return f"{name}: tensor-parallel strategy {strategy!r}; use one of {', '.join(TP_STRATEGIES)}"
    if strategy == "replicate":
        return None
    if strategy == "shard":
        if layer.kind in SHARD_KINDS and not (layer.kind == "attention" and layer.is_module) \
                or (layer.kind == "other" and layer.op in SHARD_OPS):
            return None
        return (f"{name} ({layer.op}) cannot run 'shard' on a feature-split input; shard runs pointwise layers, "
                "pooling, concatenation, softmax and attention heads (replicate the layer instead)")
    if layer.kind not in SPLITTABLE or not layer.exact:
        return (f"{name} ({layer.op}) cannot be split {strategy}-wise; tensor parallelism splits nn.Linear, "
                "nn.Embedding and Conv1d/2d/3d layers (of exactly those types)")
    if layer.kind == "conv" and sharded:
        return (f"{name} ({layer.op}) cannot run {strategy!r}: FSDP / ZeRO (sharding > 0) does not run "
                "channel-split convolutions; use sharding 0, or replicate the layer")
    if layer.kind in ("linear", "embedding") and spatial:
        return (f"{name} ({layer.op}) cannot run {strategy!r}: a spatially split model keeps its dense layers "
                "whole (it combines with filter / channel splits of convolutions); replicate the layer")
    if layer.repeated:
        return (f"{name} ({layer.op}): the forward calls this module more than once, and one split of its weight "
                "would have to suit every call; replicate it")
    if layer.kind == "conv" and layer.shared:
        return (f"{name}: a conv that shares its parameters (a module registered twice, a tied weight) cannot be "
                "split by channels, as its shards would be tensors of their own; replicate it")
    if layer.kind == "conv" and layer.groups != 1:
        return (f"{name}: a conv with groups={layer.groups} cannot be split by channels (each group already sees "
                "only its own channels); replicate it")
    cin, cout = layer.channels
    size = cout if strategy == "column" else cin
    if layer.kind == "embedding":
        size = cin if strategy == "row" else cout
    if size % tp:
        return (f"{name}: {FIELDS[layer.kind, strategy]}={size} does not split into {tp} equal parts; use a "
                f"tensor-parallel degree that divides {size}, or replicate the layer")
    return None


WHOLE, SPLIT = "whole", "split"
LAYOUTS = {"replicate": (WHOLE, WHOLE), "column": (WHOLE, SPLIT), "row": (SPLIT, WHOLE), "shard": (SPLIT, SPLIT)}


def gathers(graph, index: int, wanted) -> bool:
    """Whether the column layer ``index`` gathers its output: some reader of it (or the model's output) reads
    it whole. Its other readers then get it whole too: a row layer slices it, a shard layer cannot take it."""
    readers = graph.consumers[index]
    return not readers or any(LAYOUTS[wanted(c)][0] == WHOLE for c in readers)


def check_assignment(graph, strategies, tp: int, *, spatial: bool = False, sharded: bool = False,
                     only=None) -> dict[int, tuple[bool, bool, int | None]]:
    """Every layer's ``strategies[name]`` (default ``replicate``) checked over ``tp`` ranks, and the split
    followed from each split output through the views to every reader: ``{layer index: (gather_output,
    slice_input, the dim of its output that is split or None)}`` for the layers that do not replicate, or a
    ``PlanError`` naming the first layer and edge that is not exact. ``only`` (layer indices) limits the check
    to those layers and their readers (the others replicate). The runtime makes two layout changes: a column
    layer gathers its output when its readers read it whole, a row layer slices a whole input."""
    wanted = {graph.index_of(n): s for n, s in strategies.items() if s != "replicate"}

    def strategy_of(i: int) -> str:
        return wanted.get(i, "replicate")

    first = wanted if only is None else set(only)
    for i in first:
        _check_heads(graph.layers[i], strategy_of(i), tp)
    split: dict[int, int] = {}  # layer -> split dim of its output
    out = {}
    for i in sorted(set(first) | {c for j in first for c in graph.consumers[j]}):
        layer, strategy = graph.layers[i], strategy_of(i)
        problem = tp_refusal(layer, strategy, tp, spatial=spatial, sharded=sharded)
        if problem:
            raise PlanError(problem)
        dims = [_read_split(graph, layer, r, split, tp) for r in layer.reads]
        for read, dim in zip(layer.reads, dims):
            if dim is not None and LAYOUTS[strategy][0] == WHOLE:
                source = graph.layers[read.source].name
                raise PlanError(f"layer {source!r} ({strategy_of(read.source)}) leaves its output split over tp, but "
                              f"{layer.name!r} reads it whole; make {layer.name!r} shard or row, or {source!r} a "
                              "column layer whose readers all read it whole")
        gather = strategy == "column" and gathers(graph, i, strategy_of)  # then its row readers slice it
        result, sliced = _layer_split(graph, layer, strategy, dims)
        if strategy != "replicate":
            out[i] = (gather, sliced, None if gather else result)
        if result is not None and not gather:
            split[i] = result
            if not graph.consumers[i]:
                raise PlanError(f"layer {layer.name!r} ({strategy}) leaves its output split over tp, but it is the "
                              "model's output; make it a column layer (which gathers its output), or replicate it")
    return out


def _check_heads(layer, strategy: str, tp: int) -> None:
    """Attention on this rank's heads needs a whole number of query heads and of key / value heads per rank."""
    if strategy == "shard" and layer.kind == "attention" and (layer.heads % tp or layer.kv_heads % tp):
        what = f"{layer.heads} attention heads" if layer.heads == layer.kv_heads else \
            f"{layer.heads} query heads and {layer.kv_heads} key/value heads"
        raise PlanError(f"layer {layer.name!r}: {what} do not split into {tp}; use a tensor-parallel degree that "
                        f"divides {math.gcd(layer.heads, layer.kv_heads)}, or replicate the attention")


def _read_split(graph, layer, read, split: dict[int, int], tp: int) -> int | None:
    """The dim of ``read`` that holds the split of its source's output (``None``: the read is whole)."""
    if read.source < 0 or read.source not in split or read.output != 0:
        return None
    at = split[read.source]
    carried = [j for j, d in enumerate(read.dims) if d == at]
    if carried and read.blocks[carried[0]] % tp == 0:
        _check_views(graph, layer, read, at, tp)
        return carried[0]
    source = graph.layers[read.source].name
    how = (f"as a dim of size {read.shape[carried[0]]} in blocks of {read.blocks[carried[0]]}, which do not split "
           f"into {tp}" if carried else "through a view that cuts that dim or mixes it into another")
    raise PlanError(f"layer {layer.name!r} reads {source!r}'s output, split over tp along its dim {at}, {how}; "
                    f"use a tensor-parallel degree that divides it, or replicate {source!r}")


def _check_views(graph, layer, read, at: int, tp: int) -> None:
    """Each view on the way from the split output to ``layer`` (``read.views``) given sizes literally must give on a
    rank's part what it gives on the whole, split alike: a view whose sizes fix the split dim's size (``view(b, -1,
    heads, d)`` with the head count from the config) would read a rank's features as other positions."""
    for view in read.views:
        if at is None:
            return
        after = view.where.index(at) if at in view.where else None
        if view.sizes is not None and after is not None:
            local_in = tuple(n // tp if d == at else n for d, n in enumerate(view.in_shape))
            expected = tuple(n // tp if j == after else n for j, n in enumerate(view.out_shape))
            got = local_view_shape(view.op, view.sizes, local_in)
            if got != expected:
                source = graph.layers[read.source].name
                given = ", ".join("_" if v is None else str(v) for v in view.sizes)
                where = f"the forward of {view.module!r}" if view.module else "the model's forward"
                gives = f"gives {got}" if got is not None else "does not fit it"
                raise PlanError(
                    f"layer {layer.name!r} reads {source!r}'s output, split over tp={tp}, through {view.op}({given}) "
                    f"in {where}: on a rank's part {local_in} it {gives}, not {expected}, since its sizes fix the "
                    f"size of the split dim {after} at {view.out_shape[after]}; give that size as -1 (or compute "
                    f"it from the tensor's shape), or replicate {source!r}")
        at = after


def _layer_split(graph, layer, strategy: str, dims: list) -> tuple[int | None, bool]:
    """``(the split dim of the layer's output or None, whether it slices its input)``, given where each of its
    reads is split (``dims``, aligned with ``layer.reads``); a ``PlanError`` if the layer cannot take them so."""
    if strategy == "replicate":
        return None, False
    if strategy == "column":
        return splits_dim(layer), False
    if strategy == "row":
        return None, _row_slices(layer, dims)
    return _shard_split(graph, layer, dims), False


def _row_slices(layer, dims: list) -> bool:
    """Whether a row layer slices its input (fed whole); its split input must be split along what it contracts."""
    if layer.kind == "embedding":
        return False  # token ids in, whole: this rank's rows of the vocabulary
    produced = [r for r in layer.reads if r.source >= -1]
    split = [(r, d) for r, d in zip(layer.reads, dims) if d is not None]
    if not split:
        if len(produced) != 1:
            raise PlanError(f"layer {layer.name!r} (row) needs its input split over tp, but it reads {len(produced)} "
                          "tensors whole; make its input a column or shard layer")
        return True
    read, dim = split[0]
    if dim != (1 if layer.kind == "conv" else len(read.shape) - 1):
        raise PlanError(f"layer {layer.name!r} (row) reads its input split along dim {dim}, not along the "
                      f"{'channels' if layer.kind == 'conv' else 'features'} it contracts; replicate it")
    return False


def _shard_split(graph, layer, dims: list) -> int:
    """The output dim a shard layer leaves split: every split input along one dim of the output, every whole
    input of size 1 there (broadcast), and an operation that works on each slice along it alone."""
    name = f"layer {layer.name!r}"
    n = len(layer.out_shape)
    at = {d + n - len(r.shape) for r, d in zip(layer.reads, dims) if d is not None}
    if not at:
        raise PlanError(f"{name} (shard) needs its input split over tp, but {_whole_source(graph, layer)} gives it "
                      f"whole; make that a column or shard layer, or {layer.name!r} replicate")
    if layer.kind == "attention":
        return _attention_split(layer, dims)
    if len(at) != 1:
        raise PlanError(f"{name} ({layer.op}) combines inputs split along different dims; replicate it")
    dim = at.pop()
    if layer.kind in ("pool", "upsample") and dim != 1:
        raise PlanError(f"{name} ({layer.op}) reads its input split along dim {dim}, not the channels; replicate it")
    for read, d in zip(layer.reads, dims):
        if d is not None or math.prod(read.shape) == 0:
            continue
        if layer.kind == "cat":
            raise PlanError(f"{name} (cat) joins a split tensor with a whole one; replicate it")
        _check_broadcast(layer, read, dim, n)
    if layer.kind == "cat" or layer.op in SOFTMAX:
        along = layer.arg(1, layer.arg("dim", 0 if layer.kind == "cat" else None))
        if along is None or along % n == dim:
            raise PlanError(f"{name} ({layer.op}) works along dim {along if along is not None else '(implicit)'}, "
                            f"which is {'split over tp' if along is not None else 'not known to be another'} than "
                            f"the split dim {dim}; replicate it")
    return dim


def _check_broadcast(layer, read, dim: int, n: int) -> None:
    at = dim - (n - len(read.shape))
    if at >= 0 and read.shape[at] != 1:
        raise PlanError(f"layer {layer.name!r} ({layer.op}) combines its split input with a whole tensor of shape "
                      f"{read.shape} that is not size 1 along the split dim {dim}; replicate it, or split that "
                      "tensor's source too")


def _attention_split(layer, dims: list) -> int:
    """Attention on this rank's heads: query, key and value split along their heads (dim -3), each rank a whole
    number of query heads and of key / value heads; anything else it reads (a mask) the same for every head."""
    n = len(layer.out_shape)
    heads = n - 3
    qkv = list(zip(layer.reads[:3], dims[:3]))
    if len(qkv) != 3 or any(d is None or d + n - len(r.shape) != heads for r, d in qkv):
        raise PlanError(f"layer {layer.name!r} needs its query, key and value split by heads; the split reaches it "
                      "along another dim or not on all three (replicate the attention)")
    for read, d in zip(layer.reads[3:], dims[3:]):
        if d is None:
            _check_broadcast(layer, read, heads, n)
    return heads


def _whole_source(graph, layer) -> str:
    read = next((r for r in layer.reads if r.source >= -1), None)
    if read is None or read.source == -1:
        return "the model input"
    return repr(graph.layers[read.source].name)


def idle_tp_refusal(graph, tp: int, strategies) -> str | None:
    """Why a plan with ``tp`` ranks whose ``strategies`` split no layer is not worth running: every tp rank
    would repeat all the work (the planner does not propose it, ``check_plan`` refuses it)."""
    if tp > 1 and all(s == "replicate" for s in strategies):
        return f"tp={tp} splits no layer of {graph.name}, so each of the {tp} tp ranks would repeat all the work"
    return None


def weight_split(layer, strategy: str) -> str:
    """How ``strategy`` splits the weight of ``layer``: ``whole``, ``dim0`` (a Linear's or conv's output rows, an
    Embedding's vocabulary) or ``dim1`` (their inputs, an Embedding's features). Layers that share a
    parameter must split it alike (``check_shared``)."""
    if strategy in ("replicate", "shard") or layer.kind not in SPLITTABLE:
        return "whole"
    rows = "column" if layer.kind != "embedding" else "row"
    return "dim0" if strategy == rows else "dim1"


def check_shared(graph, strategies) -> None:
    """Layers that use one parameter (tied weights, a module registered twice) split it alike over tp: both
    whole, or both along the same dim (an Embedding by rows and the Linear head by columns: Megatron's shared
    vocabulary split), so that one split parameter serves both and sums both gradients. (A conv that shares
    a parameter is not split at all: ``tp_refusal``.)"""
    for names in graph.shared:
        users = [layer for layer in graph.layers if set(layer.params) & set(names)]
        splits = {layer.name: weight_split(layer, strategies.get(layer.name, "replicate")) for layer in users}
        if len(set(splits.values())) > 1:
            uses = " and ".join(f"layer {n!r} ({strategies.get(n, 'replicate')})" for n in splits)
            raise PlanError(f"{uses} share the parameter {names[0]!r}{_aliases(names)} but would split it "
                            "differently; split them alike (an embedding by rows with its head by columns, as "
                            "Megatron splits a tied vocabulary) or replicate all of them")


def _aliases(names) -> str:
    return f" (also {', '.join(repr(n) for n in names[1:])})" if len(names) > 1 else ""


@dataclass(frozen=True)
class Split:
    """What ``apply_splits`` does to one module: its strategy, and the layout changes at its edges."""

    strategy: str
    gather_output: bool = False  # a column layer whose readers need its output whole
    slice_input: bool = False  # a row layer fed a whole tensor
    kind: str = "linear"  # linear, embedding, conv, norm (sequence parallelism), or op (nothing to split)
    input_seq: int | None = None  # sequence parallelism: the input arrives split along this dim
    output_seq: int | None = None  # sequence parallelism: the output leaves split along this dim
    clone_output: bool = False  # a reader writes into the output in place: DTensor's local view of it is copied

    @property
    def leaves_split(self) -> bool:
        """Whether the layer's output leaves split over tp: a shard layer's, a column layer's that is not gathered."""
        return self.strategy == "shard" or (self.strategy == "column" and not self.gather_output)

"""The rules of what runs exactly, in one place: the analysis, the search, ``validate``, ``check_plan`` and the
runtime all read them (pure Python: no torch).

- **Views** (``alias_dims``): where a view, reshape, transpose or index moves each dim of a tensor, so that a
  split of one layer's output (a column layer's features, the heads they hold) can be followed to every
  layer that reads it.
- **Spatial** (``spatial_refusals``, ``SPATIAL_MODULES``): which modules the spatial runtime converts, and which
  functions are exact on slabs of a split volume (everything else mixes positions and is refused).
- **Tensor parallelism** (``tp_*``, ``check_assignment``, ``regions``): which layers split column-, row- or
  shard-wise, how a split travels through views to its readers, which layout changes the runtime makes
  (a column layer gathers its output, a row layer slices its input), what shares a parameter.
- **Pipelines** (``stage_interfaces``): which tensors cross a stage boundary, and where a cut is impossible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridpar.errors import PlanError

# --- views: where each dim of a tensor goes ----------------------------------------------------------

SAME_DIMS = frozenset("contiguous clone to type float double half bfloat16 detach detach_ requires_grad_ "
                      "type_as cpu cuda".split())
RESHAPES = frozenset("view view_as reshape reshape_as flatten unflatten".split())
TRANSPOSES = frozenset("T H mT mH".split())  # properties: all dims reversed (T, H), the last two swapped (mT, mH)
ALIASES = SAME_DIMS | RESHAPES | TRANSPOSES | frozenset(
    """transpose swapaxes swapdims t permute movedim unsqueeze squeeze expand expand_as __getitem__ narrow select
    split split_with_sizes chunk unbind data""".split())
# tensors that take only the shape, dtype and device of their input: constants, not layers
SHAPE_ONLY = frozenset("""new_ones new_zeros new_empty new_full zeros_like ones_like empty_like full_like rand_like
    randn_like randint_like""".split())


def _arg(args: tuple, kwargs: dict, index: int, name: str, default=None):
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _norm(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def alias_dims(name: str, args: tuple, kwargs: dict, src: tuple, in_shape: tuple[int, ...],
               out_shape: tuple[int, ...]) -> tuple:
    """``src`` holds, for each dim of the input (``args[0]``), what that dim carries (or ``None``); the result
    says the same of each dim of one output of the view ``name``: the carried thing moves with whole contiguous
    blocks of its dim (a reshape moves it to the outermost output dim of its group), and is lost (``None``)
    where the view cuts a dim into pieces or mixes it into an inner position."""
    n, m = len(in_shape), len(out_shape)
    if name in SAME_DIMS or name == "data":
        return tuple(src) if n == m else (None,) * m
    if name in RESHAPES:
        return _regroup(src, in_shape, out_shape)
    if name in ("T", "H") or (name == "t" and n == 2):
        return tuple(reversed(src))
    if name in ("transpose", "swapaxes", "swapdims", "mT", "mH"):
        a, b = ((_norm(d, n) for d in (_arg(args, kwargs, 1, "dim0", 0), _arg(args, kwargs, 2, "dim1", 1)))
                if name not in ("mT", "mH") else (n - 2, n - 1))
        out = list(src)
        out[a], out[b] = out[b], out[a]
        return tuple(out)
    if name == "permute":
        order = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:] or kwargs.get("dims")
        return tuple(src[_norm(d, n)] for d in order)
    if name == "movedim":
        source, dest = _arg(args, kwargs, 1, "source"), _arg(args, kwargs, 2, "destination")
        source, dest = ([source], [dest]) if isinstance(source, int) else (list(source), list(dest))
        order = [None] * m
        for s, d in zip(source, dest):
            order[_norm(d, m)] = _norm(s, n)
        rest = iter(i for i in range(n) if i not in {_norm(s, n) for s in source})
        return tuple(src[o if o is not None else next(rest)] for o in order)
    if name == "unsqueeze":
        at = _norm(_arg(args, kwargs, 1, "dim"), m)
        return tuple(src[:at]) + (None,) + tuple(src[at:])
    if name == "squeeze":
        dims = _arg(args, kwargs, 1, "dim")
        drop = set(range(n)) if dims is None else {_norm(d, n) for d in (dims if isinstance(dims, (tuple, list))
                                                                         else [dims])}
        return tuple(s for i, s in enumerate(src) if not (i in drop and in_shape[i] == 1))
    if name in ("expand", "expand_as"):
        lead = m - n
        return (None,) * lead + tuple(s if in_shape[i] == out_shape[lead + i] else None for i, s in enumerate(src))
    if name == "__getitem__":
        return _indexed(src, in_shape, args[1] if len(args) > 1 else (), m)
    if name in ("narrow", "split", "split_with_sizes", "chunk", "select", "unbind"):
        default = {"narrow": None, "select": None}.get(name, 0)
        index = {"narrow": 1, "select": 1, "split": 2, "split_with_sizes": 2, "chunk": 2, "unbind": 1}[name]
        dim = _norm(_arg(args, kwargs, index, "dim", default), n)
        if name in ("select", "unbind"):
            return tuple(s for i, s in enumerate(src) if i != dim)
        return tuple(None if i == dim and out_shape[i] != in_shape[i] else s for i, s in enumerate(src))
    return (None,) * m


def _regroup(src: tuple, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> tuple:
    """A reshape: dims of equal size map one to one; a group of dims whose sizes multiply alike maps its
    outermost input dim onto its outermost output dim (whole blocks of one are whole blocks of the other,
    when the split count divides both), every other dim of the group carries nothing."""
    out = [None] * len(out_shape)
    i = j = 0
    while i < len(in_shape) and j < len(out_shape):
        if in_shape[i] == out_shape[j]:
            out[j] = src[i]
            i, j = i + 1, j + 1
        elif in_shape[i] == 1:
            i += 1
        elif out_shape[j] == 1:
            j += 1
        else:
            first, pi, pj = (i, j), in_shape[i], out_shape[j]
            i, j = i + 1, j + 1
            while pi != pj and i <= len(in_shape) and j <= len(out_shape):
                if pi < pj and i < len(in_shape):
                    pi, i = pi * in_shape[i], i + 1
                elif j < len(out_shape):
                    pj, j = pj * out_shape[j], j + 1
                else:
                    break
            out[first[1]] = src[first[0]]
    return tuple(out)


def _indexed(src: tuple, in_shape: tuple[int, ...], index, m: int) -> tuple:
    index = index if isinstance(index, tuple) else (index,)
    if any(not isinstance(i, (int, slice, type(None), type(Ellipsis))) for i in index):
        return (None,) * m  # advanced (tensor or list) indexing
    consumed = sum(1 for i in index if isinstance(i, (int, slice)))
    out, dim = [], 0
    for i in index:
        if i is Ellipsis:
            for _ in range(len(in_shape) - consumed):
                out.append(src[dim])
                dim += 1
        elif i is None:
            out.append(None)
        elif isinstance(i, int):
            dim += 1
        else:
            whole = i.step in (None, 1) and (i.start or 0) == 0 and (i.stop is None or i.stop >= in_shape[dim])
            out.append(src[dim] if whole else None)
            dim += 1
    out.extend(src[dim:])
    return tuple(out)


# --- spatial parallelism: what runs on slabs of a split volume ----------------------------------------

# torch.nn classes the spatial runtime converts (hybridpar.spatial.layers); a subclass that keeps the class's
# forward is converted alike, one that overrides it is checked function by function
SPATIAL_MODULES = frozenset("""Conv1d Conv2d Conv3d ConvTranspose1d ConvTranspose2d ConvTranspose3d MaxPool1d MaxPool2d
    MaxPool3d AvgPool1d AvgPool2d AvgPool3d AdaptiveAvgPool1d AdaptiveAvgPool2d AdaptiveAvgPool3d AdaptiveMaxPool1d
    AdaptiveMaxPool2d AdaptiveMaxPool3d BatchNorm1d BatchNorm2d BatchNorm3d InstanceNorm1d InstanceNorm2d
    InstanceNorm3d GroupNorm Upsample Flatten Dropout Dropout1d Dropout2d Dropout3d""".split())
GATHERING_MODULES = frozenset("""Flatten AdaptiveAvgPool1d AdaptiveAvgPool2d AdaptiveAvgPool3d AdaptiveMaxPool1d
    AdaptiveMaxPool2d AdaptiveMaxPool3d""".split())  # their output is whole (the same) on every rank


def spatial_base(cls: type) -> type | None:
    """The torch.nn class of ``SPATIAL_MODULES`` that the spatial runtime converts ``cls`` as: that class, or
    a subclass of it that keeps its ``forward``; ``None`` for any other class."""
    for base in cls.__mro__:
        if base.__name__ in SPATIAL_MODULES and base.__module__.startswith("torch.nn.modules"):
            return base if cls.forward is base.forward else None
    return None


POINTWISE = frozenset(
    """add sub mul div true_divide neg pow rsub abs sqrt rsqrt exp log log1p expm1 square clamp clip clamp_min
    clamp_max maximum minimum where sigmoid tanh relu relu6 leaky_relu elu selu celu gelu silu mish softplus
    softsign hardtanh hardswish hardsigmoid prelu rrelu logsigmoid sin cos erf reciprocal sign floor ceil round
    add_ sub_ mul_ div_ neg_ pow_ abs_ sqrt_ exp_ clamp_ relu_ leaky_relu_ elu_ selu_ celu_ hardtanh_ sigmoid_
    tanh_ silu_ mish_ gelu_ hardswish_ hardsigmoid_ threshold threshold_ eq ne lt le gt ge logical_not logical_and
    logical_or masked_fill masked_fill_
    __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__ __rtruediv__
    __itruediv__ __neg__ __pow__ __rpow__ __abs__ __eq__ __ne__ __lt__ __le__ __gt__ __ge__ __and__ __or__
    __invert__ dropout alpha_dropout feature_alpha_dropout as_tensor""".split()
) | SAME_DIMS
CONCAT = frozenset({"cat", "concat", "concatenate"})
SOFTMAX = frozenset({"softmax", "log_softmax"})
DROPOUT = frozenset({"dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d"})
ATTENTION = frozenset({"scaled_dot_product_attention"})

LOCAL_ONLY = ("spatial parallelism needs operators that see only nearby positions (convolutions, pooling, "
              "normalisation); {what} mixes all positions of the volume, so leave spatial at 1 and use data, "
              "tensor or pipeline parallelism (the planner does), or, for a dense head, put nn.Flatten() before it "
              "(it gathers the slabs exactly)")
HINTS = {
    "interpolate": "use an nn.Upsample module",
    "pad": "put the padding in the convolution (padding=, padding_mode=)",
    "mean": "use nn.AdaptiveAvgPool(1) for global pooling, or a hybridpar.spatial loss",
    "sum": "use nn.AdaptiveAvgPool(1) for global pooling, or a hybridpar.spatial loss",
    "amax": "use nn.AdaptiveMaxPool(1) for global pooling",
}
MIXING = frozenset(RESHAPES | TRANSPOSES | {"permute", "transpose", "swapaxes", "swapdims", "movedim", "t", "unfold",
                                            "roll", "matmul", "bmm", "einsum"})
DEFAULT_HINT = "use the nn module for it (Conv, Pool, Upsample, Norm, Flatten), which hybridpar converts exactly"


def spatial_refusals(name: str, args: tuple, kwargs: dict, is_split, shapes, ndim: int, where: str):
    """Why the function ``name``, called in the forward of ``where`` with a spatially split ``(N, C, *spatial)``
    tensor of ``ndim`` dims among its arguments, would not compute on a slab what it computes on the whole
    volume: ``[(axis, message), ...]`` (``axis``: the spatial dim whose split breaks it, ``None``: any split);
    ``[]`` if it is exact. ``is_split(x)`` says whether an argument is split; ``shapes(x)`` gives a tensor
    argument's shape (``None`` for anything else)."""
    axes = range(ndim - 2)
    where = f"the forward of '{where}'"
    if name in POINTWISE:
        out = []
        for value in _leaves((args, kwargs)):
            shape = shapes(value)
            if shape is None or is_split(value):
                continue
            for axis in axes:
                dim = 2 + axis - (ndim - len(shape))
                if dim >= 0 and shape[dim] != 1:
                    out.append((axis, f"{name} in {where} combines a spatially split tensor with a whole tensor of "
                                      f"shape {tuple(shape)} along split dim {2 + axis}; make that tensor size 1 "
                                      "along the split dims, or compute it from the input"))
        return out
    if name in CONCAT and _norm(_arg(args, kwargs, 1, "dim", 0), ndim) in (0, 1):
        return []
    if name in SOFTMAX and _arg(args, kwargs, 1, "dim") is not None and _norm(_arg(args, kwargs, 1, "dim"), ndim) == 1:
        return []
    if name == "linear":
        return [(ndim - 3, f"linear on a spatially split tensor in {where} contracts its last dim, which is split; "
                           f"{LOCAL_ONLY.format(what='it')}")]
    if name == "__getitem__" and _channel_index(args[1] if len(args) > 1 else ()):
        return []
    if name == "pad":
        amounts = tuple(_arg(args, kwargs, 1, "pad", ()))
        hit = {axis for axis in axes if any(amounts[2 * (ndim - 1 - (2 + axis)) + k] for k in (0, 1)
                                             if 2 * (ndim - 1 - (2 + axis)) + k < len(amounts))}
        return [(axis, f"pad on a spatially split tensor in {where} pads its split dim {2 + axis}; {HINTS['pad']} "
                       "(padding of zero rows, or of the channels, is exact)") for axis in sorted(hit)]
    if name == "repeat":
        counts = args[1:]
        counts = tuple(counts[0] if len(counts) == 1 and isinstance(counts[0], (tuple, list)) else counts)
        if len(counts) != ndim:
            return [(None, f"repeat on a spatially split tensor in {where} adds dims to it; repeat it along its own "
                           "dims")]
        return [(axis, f"repeat on a spatially split tensor in {where} repeats its split dim {2 + axis}; repeat only "
                       "along the batch, the channels or dims that are not split")
                for axis in axes if counts[2 + axis] != 1]
    hint = LOCAL_ONLY.format(what=f"{name} (a patch embedding, a flatten into tokens, windows, a matrix product)") \
        if name in MIXING else HINTS.get(name, DEFAULT_HINT)
    return [(None, f"{name} on a spatially split tensor in {where} would compute on the slab, not the whole "
                   f"volume; {hint}")]


def replicated_refusal(name: str, training: bool, where: str) -> str | None:
    """Why ``name`` on tensors that every rank of a spatial group holds whole would differ between the ranks."""
    if name in DROPOUT and training:
        return (f"{name} in the forward of '{where}' would draw a different mask on each rank of the spatial group; "
                "use an nn.Dropout module, which hybridpar makes share its mask")
    return None


def _leaves(tree) -> list:
    if isinstance(tree, (tuple, list)):
        return [x for item in tree for x in _leaves(item)]
    if isinstance(tree, dict):
        return [x for item in tree.values() for x in _leaves(item)]
    return [tree]


def _channel_index(index) -> bool:
    index = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, slice) for i in index):
        return False
    return all(i == slice(None) for i in index[2:])


def first_refusal(refusals, grid: tuple[int, ...]) -> str | None:
    """The message of the first of ``[(axis, message), ...]`` that a split by ``grid`` breaks."""
    for axis, message in refusals:
        if any(p > 1 for p in grid) if axis is None else (axis < len(grid) and grid[axis] > 1):
            return message
    return None


# --- tensor parallelism ---------------------------------------------------------------------------------

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
        return carried[0]
    source = graph.layers[read.source].name
    how = (f"as a dim of size {read.shape[carried[0]]} in blocks of {read.blocks[carried[0]]}, which do not split "
           f"into {tp}" if carried else "through a view that cuts that dim or mixes it into another")
    raise PlanError(f"layer {layer.name!r} reads {source!r}'s output, split over tp along its dim {at}, {how}; "
                    f"use a tensor-parallel degree that divides it, or replicate {source!r}")


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
class Region:
    """Layers split together over tp: column layers whose split outputs reach row layers through shard
    layers only, whole at its edges (its inputs whole, its rows' outputs summed whole, nothing outside it
    reading a split tensor)."""

    layers: tuple[int, ...]  # in order, consecutive
    strategies: tuple[str, ...]

    @property
    def start(self) -> int:
        return self.layers[0]

    @property
    def stop(self) -> int:
        return self.layers[-1] + 1


def regions(graph, tp: int, *, spatial: bool = False, sharded: bool = False) -> list[Region]:
    """Every region of ``graph`` that splits exactly over ``tp`` ranks (``check_assignment``), found from each
    layer that could be a row layer by walking back through shard-able layers to column-able ones: a
    Megatron MLP (column, shard..., row), attention (its query, key and value projections, the rotary
    products and the attention on this rank's heads, the output projection), a gated MLP (gate and up
    columns, their product, down row), a filter-parallel conv and the channel-parallel conv after it.
    Regions may overlap (a conv is the row of one region and the column of the next): a plan takes some
    that do not."""
    options = dict(spatial=spatial, sharded=sharded)
    cones: list[dict[int, str]] = []
    for i, layer in enumerate(graph.layers):
        if layer.kind != "embedding" and tp_refusal(layer, "row", tp, **options) is None:
            cone = _cone(graph, i, tp, options)
            if cone is not None:
                cones.append(cone)
    found, seen = [], set()
    for cone in _merge(cones):
        members = tuple(sorted(cone))
        if members in seen or members != tuple(range(members[0], members[-1] + 1)):
            continue
        seen.add(members)
        try:
            check_assignment(graph, {graph.layers[i].name: cone[i] for i in members}, tp, only=members, **options)
        except PlanError:
            continue
        found.append(Region(members, tuple(cone[i] for i in members)))
    return sorted(found, key=lambda r: (r.start, r.stop))


def _cone(graph, row: int, tp: int, options: dict) -> dict[int, str] | None:
    members = {row: "row"}
    stack = [r.source for r in graph.layers[row].reads if r.source >= 0]
    if not stack:
        return None
    while stack:
        p = stack.pop()
        if p in members:
            continue
        layer = graph.layers[p]
        if tp_refusal(layer, "column", tp, **options) is None:
            members[p] = "column"
        elif tp_refusal(layer, "shard", tp, **options) is None:
            members[p] = "shard"
            stack.extend(r.source for r in _split_operands(layer) if r.source >= 0)
        else:
            return None
    return members


def _split_operands(layer) -> list:
    """The reads of a shard layer that must be split (the others broadcast whole): the query, key and value of
    attention, the operands of a pointwise operation as large as its output, and all of any other's."""
    if layer.kind == "attention":
        return list(layer.reads[:3])
    if layer.kind == "pointwise":
        size = math.prod(layer.out_shape)
        return [r for r in layer.reads if math.prod(r.shape) == size]
    return [r for r in layer.reads if math.prod(r.shape)]


def _merge(cones: list[dict[int, str]]) -> list[dict[int, str]]:
    """Cones that share a layer in the same role are one region (two rows fed by one column); a group whose
    cones give one layer two roles stays apart (alternatives: a conv that is one pair's row and the next's
    column)."""
    parent = list(range(len(cones)))

    def find(c: int) -> int:
        while parent[c] != c:
            parent[c] = parent[parent[c]]
            c = parent[c]
        return c

    owner: dict[tuple[int, str], int] = {}
    for c, cone in enumerate(cones):
        for item in cone.items():
            if item in owner:
                parent[find(c)] = find(owner[item])
            else:
                owner[item] = c
    groups: dict[int, list[int]] = {}
    for c in range(len(cones)):
        groups.setdefault(find(c), []).append(c)
    out = []
    for members in groups.values():
        merged: dict[int, str] = {}
        for c in members:
            merged.update(cones[c])
        roles = {(i, s) for c in members for i, s in cones[c].items()}
        out.extend([merged] if len(roles) == len(merged) else [cones[c] for c in members])
    return out


def standalone(layer, tp: int, *, spatial: bool = False, sharded: bool = False) -> tuple[str, ...]:
    """The strategies ``layer`` can run alone, whole at its edges: replicate; a column layer gathering its
    output (for every reader: a row reader then slices it); a row layer slicing its input (or an embedding
    split by vocabulary)."""
    out = ["replicate"]
    for strategy in ("column", "row"):
        if tp > 1 and tp_refusal(layer, strategy, tp, spatial=spatial, sharded=sharded) is None:
            if strategy == "row" and layer.kind != "embedding" and sum(r.source >= -1 for r in layer.reads) != 1:
                continue
            out.append(strategy)
    return tuple(out)


# --- pipelines: where a model can be cut, what crosses ------------------------------------------------------
#
# A pipeline stage runs the model's own forward, with the blocks of other stages skipped: a skipped block
# returns zeros of the shapes it returns in the analysis, and the values a held block is passed that its stage
# cannot compute (made by a block of an earlier stage, or by the model's own code from such values) are
# replaced by the ones the earlier stage sent. A value crosses every cut between the block (or model code)
# that makes it and the last block that reads it; stages relay it.


def _origins(graph) -> tuple[list[float], list[float]]:
    """For each layer, the first and the last block a stage must hold to compute it: its own block, or for a
    layer of the model's own code, the earliest and the latest block it depends on (``-1``: the model input,
    which only the first stage has; ``inf`` and ``-inf``: nothing, a constant every stage computes)."""
    lo: list[float] = []
    hi: list[float] = []
    for i, layer in enumerate(graph.layers):
        block = graph.block_index[i]
        if block is not None:
            lo.append(block)
            hi.append(block)
            continue
        deps = [(-1, -1) if p == -1 else (lo[p], hi[p]) for p in layer.inputs]
        lo.append(min((a for a, _ in deps), default=math.inf))
        hi.append(max((b for _, b in deps), default=-math.inf))
    return lo, hi


def passes(graph) -> list[tuple[int, int, int, float, float, bool]]:
    """``(value, block, source, first, latest, needs a gradient)`` for each tensor passed to a block call: the block
    it is passed to, the layer that made it, and the first and latest block a stage must hold to compute it
    (``_origins``). A stage that starts at block ``b`` must receive it where ``first < b <= block`` (and cannot
    compute it at all where ``first < b <= latest``). One tensor may be passed on (a dropout of zero returns its
    input): each pass counts with its own source."""
    if "_passes" in graph.__dict__:
        return graph.__dict__["_passes"]
    lo, hi = _origins(graph)
    out = []
    for call in graph.block_calls:
        for arg in call.args:
            if arg.source == -1:
                first, latest = -1, -1
            elif arg.source >= 0:
                first, latest = lo[arg.source], hi[arg.source]
            else:
                continue  # a constant or a parameter: every stage has it
            out.append((arg.value, call.block, arg.source, first, latest, arg.requires_grad))
    graph.__dict__["_passes"] = out
    return out


def _crossing(graph, b: int) -> list[tuple[int, int, int, float, float, bool]]:
    """The passes a stage starting at block ``b`` must receive (those of its own blocks and later ones)."""
    return [p for p in passes(graph) if p[3] < b <= p[1]]


def crossing_sources(graph) -> dict[int, frozenset[int]]:
    """``{block: the layers whose outputs (or views of them) cross a cut before it}`` (cached on the graph): a
    stage may start there only where each is whole over tp."""
    if "_sources" not in graph.__dict__:
        graph.__dict__["_sources"] = {b: frozenset(p[2] for p in _crossing(graph, b)) for b in graph.block_starts}
    return graph.__dict__["_sources"]


def stage_cut_refusal(graph, block: int) -> str | None:
    """Why the model cannot be cut before ``graph.blocks[block]`` (``None`` if it can)."""
    return _cut_table(graph).get(block, f"block {graph.blocks[block]!r} runs no layer")


def _cut_table(graph) -> dict[int, str | None]:
    """``{block: why a cut before it is impossible, or None}`` for every block after the first that runs a
    layer (cached on the graph): each cut is possible or not on its own, whatever the other cuts."""
    if "_cuts" in graph.__dict__:
        return graph.__dict__["_cuts"]
    starts = [b for b, first in graph.block_starts.items() if first > 0]
    table: dict[int, str | None] = dict.fromkeys(starts)

    def refuse(b: int, why: str) -> None:
        if table[b] is None:
            table[b] = why

    for call in graph.block_calls:
        what = _not_rebuilt(call.output)
        for b in starts if what else ():
            refuse(b, f"block {graph.blocks[call.block]!r} returns a {what}, which a stage that skips the block "
                      "cannot stand in for; make it return tensors (or tuples of them)")
    for outer in graph.block_calls:
        inner = next((c for c in graph.block_calls if c is not outer and outer.layers[0] <= c.layers[0]
                      and c.layers[1] <= outer.layers[1] and c.layers[0] < c.layers[1]), None)
        for b in starts if inner is not None else ():
            refuse(b, f"block {graph.blocks[outer.block]!r} calls block {graph.blocks[inner.block]!r} inside its own "
                      "forward, so a stage cannot hold one without the other")
    order = [c.block for c in graph.block_calls]
    for j, block in enumerate(order):
        later = max(order[:j], default=-1)
        for b in starts:
            if block < b <= later:
                refuse(b, f"block {graph.blocks[block]!r} runs again after {graph.blocks[later]!r}: the model does "
                          "not call its blocks one after another")
    for b in starts:
        crossing = _crossing(graph, b)
        grads = {value for value, _, _, _, _, grad in crossing if grad}
        if len(grads) > 1:
            refuse(b, f"{len(grads)} tensors that need a gradient cross there (a skip connection; a pipeline sends "
                      "one activation and its gradient)")
        if any(first < b <= latest for _, _, _, first, latest, _ in crossing):
            refuse(b, "the model's own code combines values from blocks on both sides of the cut; cut where its "
                      "forward passes one block's output to the next")
    lo, _ = _origins(graph)
    out = min((lo[i] for i in graph.outputs), default=math.inf)
    for b in starts:
        if b > out:
            refuse(b, f"the model's output is computed from {graph.blocks[int(out)] if out >= 0 else 'the input'!r} "
                      "outside the blocks, before the cut")
    graph.__dict__["_cuts"] = table
    return table


def checkpointed_stages_refusal(graph) -> str | None:
    """Why pipeline stages of this model cannot recompute their blocks in backward (activation checkpointing): a
    stage replaces what a block is passed by what the stage before sent, and a block the forward calls more
    than once could not be told apart from its own recomputation. ``None`` if they can."""
    if graph.is_chain:
        return None
    counts: dict[int, int] = {}
    for call in graph.block_calls:
        counts[call.block] = counts.get(call.block, 0) + 1
    again = next((b for b, n in counts.items() if n > 1), None)
    if again is None:
        return None
    return (f"block {graph.blocks[again]!r} runs {counts[again]} times in a forward, so pipeline stages cannot "
            "recompute it with activation checkpointing; turn checkpointing off, or use no pipeline")


def _not_rebuilt(structure) -> str | None:
    """The type a stage could not stand in for within a block's returned ``structure``, or ``None``."""
    kind, rest = structure[0], structure[1:]
    if kind == "other":
        return rest[0]
    if kind in ("tuple", "list"):
        return next((t for t in map(_not_rebuilt, rest[0]) if t), None)
    if kind == "dict":
        return next((t for t in (_not_rebuilt(v) for _, v in rest[0]) if t), None)
    return None


@dataclass(frozen=True)
class StageInterface:
    """The values a stage receives from the stage before it and sends to the next (``BlockArg.value`` ids, in
    order). The first stage takes the model input (and receives none); the last returns the model's output
    (and sends none)."""

    receives: tuple[int, ...]
    sends: tuple[int, ...]


def stage_interfaces(graph, groups: list[list[str]]) -> list[StageInterface]:
    """What crosses each cut between the stages holding the blocks ``groups`` (checked by ``_cut_table``)."""
    index = {name: i for i, name in enumerate(graph.blocks)}
    starts = [min(index[name] for name in group) for group in groups[1:]]
    receives: list[list[int]] = [[]]
    for b in starts:
        receives.append(sorted({p[0] for p in _crossing(graph, b)}))
    return [StageInterface(tuple(receives[s]), tuple(receives[s + 1]) if s + 1 < len(receives) else ())
            for s in range(len(receives))]

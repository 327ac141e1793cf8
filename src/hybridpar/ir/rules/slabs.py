"""Spatial parallelism: which modules the spatial runtime converts (``SPATIAL_MODULES``), and what every function does
to the slabs of a split volume (``spatial_rule``: the split followed through views and position-wise functions;
everything that mixes positions along a split dim is refused)."""

from __future__ import annotations

from hybridpar.ir.rules.views import (
    ALIASES,
    RESHAPES,
    SAME_DIMS,
    TRANSPOSES,
    alias_dims,
    call_arg,
    view_sizes,
    wrap_dim,
)

# torch.nn classes the spatial runtime converts (hybridpar.spatial.layers); a subclass that keeps the class's
# forward is converted alike, one that overrides it is checked function by function
SPATIAL_MODULES = frozenset("""Conv1d Conv2d Conv3d ConvTranspose1d ConvTranspose2d ConvTranspose3d MaxPool1d MaxPool2d
    MaxPool3d AvgPool1d AvgPool2d AvgPool3d AdaptiveAvgPool1d AdaptiveAvgPool2d AdaptiveAvgPool3d AdaptiveMaxPool1d
    AdaptiveMaxPool2d AdaptiveMaxPool3d BatchNorm1d BatchNorm2d BatchNorm3d InstanceNorm1d InstanceNorm2d
    InstanceNorm3d GroupNorm Upsample Flatten Dropout Dropout1d Dropout2d Dropout3d""".split())
GATHERING_MODULES = frozenset("""Flatten AdaptiveAvgPool1d AdaptiveAvgPool2d AdaptiveAvgPool3d AdaptiveMaxPool1d
    AdaptiveMaxPool2d AdaptiveMaxPool3d""".split())  # their output is whole (the same) on every rank
POSITION_WISE_MODULES = frozenset({"Dropout"})  # work value by value: on a split tensor wherever its split lies


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
ELSEWHERE = ("leave spatial at 1 and use data, tensor or pipeline parallelism, or, for a dense head, put nn.Flatten() "
             "before it (it gathers the slabs exactly)")
DEFAULT_HINT = "use the nn module for it (Conv, Pool, Upsample, Norm, Flatten), which hybridpar converts exactly"


REDUCTIONS = frozenset("mean sum amax amin max min std var prod logsumexp norm".split())
NORMS = frozenset({"layer_norm", "rms_norm"})  # over the last dims, each position alone


def spatial_rule(name: str, args: tuple, kwargs: dict, out_shape: tuple[int, ...], placement, shapes, where: str):
    """What the function ``name``, called in the forward of ``where`` with a spatially split tensor among its
    arguments, does to the split: ``(refusals, placement out)``. ``placement(x)`` is, for an argument split in
    slabs, the dim that carries each spatial axis (``None`` where none does), and ``None`` for any other argument;
    ``shapes(x)`` a tensor argument's shape, ``out_shape`` that of (the first of) its outputs. ``refusals`` is
    ``[(axis, message), ...]``: the spatial axis whose split the function would not compute on a slab as on the
    whole volume (``None``: any split); the placement out is that of the outputs (for an axis refused, ``None``).
    The split is followed through every view, as DTensor's sharding propagation does: a permute moves it (a
    channels-last norm is exact), a reshape keeps it where its dim stays the outermost of a group and is given as
    ``-1``, a view that moves it onto another axis or fixes its size is refused; position-wise functions
    (pointwise, norms and ``linear`` over unsplit dims, reductions and softmax along them) keep it; anything that
    mixes positions along a split dim is refused."""
    leaves = _leaves((args, kwargs))
    first = next(v for v in leaves if placement(v) is not None)
    place, shape = placement(first), shapes(first)
    n, axes = len(shape), range(len(place))
    where = f"the forward of '{where}'"
    split = {d: axis for axis, d in enumerate(place) if d is not None}

    def refuse(axis, what: str) -> tuple[int | None, str]:
        return axis, f"{name} on a spatially split tensor in {where} {what}"

    def along(dims) -> list[int]:  # the spatial axes whose dims are among ``dims`` (of the first argument)
        return sorted(split[d % n] for d in dims if d % n in split) if n else []

    if name in POINTWISE:
        out_n = max(len(shapes(v)) for v in leaves if shapes(v) is not None)
        out = tuple(None if d is None else d + out_n - n for d in place)
        refused = []
        for value in leaves:
            other = shapes(value)
            if other is None or value is first:
                continue
            lead = out_n - len(other)
            if placement(value) is not None:
                if tuple(None if d is None else d + out_n - len(other) for d in placement(value)) != out:
                    refused.append(refuse(None, "combines tensors split along different dims; split them alike"))
                continue
            for axis in axes:
                d = None if out[axis] is None else out[axis] - lead
                if d is not None and d >= 0 and other[d] != 1:
                    refused.append(refuse(axis, f"combines a spatially split tensor with a whole tensor of shape "
                                                f"{tuple(other)} along the split dim {out[axis]}; make that tensor "
                                                "size 1 along the split dims, or compute it from the input"))
        return refused, out
    if name in ALIASES:
        return _view_rule(name, args, kwargs, place, shape, out_shape, refuse)
    if name in CONCAT:
        dim = wrap_dim(call_arg(args, kwargs, 1, "dim", 0), n)
        parts = call_arg(args, kwargs, 0, "tensors", ())
        if dim in split or any(placement(t) != place for t in parts if shapes(t) is not None):
            return [refuse(None, "joins tensors along a split dim, or a split tensor with a whole one; concatenate "
                                 "along the batch, the channels or an unsplit dim")], None
        return [], place
    if name in SOFTMAX or name in REDUCTIONS:
        dims = call_arg(args, kwargs, 1, "dim")
        if dims is None:
            return [refuse(None, f"reduces over every dim, the split ones too; {HINTS.get(name, DEFAULT_HINT)}")], \
                None
        dims = [dims] if isinstance(dims, int) else list(dims)
        hit = along(dims)
        if name in SOFTMAX:
            return [refuse(a, f"works along the split dim {place[a]}") for a in hit], tuple(
                None if a in hit else d for a, d in enumerate(place))
        keep = call_arg(args, kwargs, 2, "keepdim", False) is True
        gone = sorted({d % n for d in dims})
        out = tuple(None if d is None or d in gone and not keep else d - (0 if keep else sum(g < d for g in gone))
                    for d in place)
        return [refuse(a, f"reduces along the split dim {place[a]}; {HINTS.get(name, DEFAULT_HINT)}") for a in hit], \
            tuple(None if a in hit else d for a, d in enumerate(out))
    if name in NORMS:
        normalized = call_arg(args, kwargs, 1, "normalized_shape", ())
        normalized = (normalized,) if isinstance(normalized, int) else tuple(normalized or ())
        hit = along(range(n - len(normalized), n))
        return [refuse(a, f"normalises over the split dim {place[a]}; normalise over unsplit dims, or use a norm "
                          "module hybridpar converts (BatchNorm, InstanceNorm, GroupNorm)") for a in hit], place
    if name in ("linear", "matmul"):
        other = args[1] if len(args) > 1 else kwargs.get("weight", kwargs.get("other"))
        hit = along([n - 1])
        if placement(other) is not None or (name == "matmul" and (n < 2 or first is not args[0])):
            return [refuse(None, f"mixes positions of the split volume; {LOCAL_ONLY.format(what='it')}")], None
        return [refuse(a, f"contracts its last dim, which is split; {LOCAL_ONLY.format(what='it')}") for a in hit], \
            place
    if name == "pad":
        amounts = tuple(call_arg(args, kwargs, 1, "pad", ()))
        padded = {n - 1 - k // 2 for k, v in enumerate(amounts) if v}
        return [refuse(a, f"pads its split dim {place[a]}; {HINTS['pad']} (padding of zero rows, or of the "
                          "channels, is exact)") for a in along(padded)], place
    if name == "repeat":
        counts = args[1:]
        counts = tuple(counts[0] if len(counts) == 1 and isinstance(counts[0], (tuple, list)) else counts)
        if len(counts) != n:
            return [refuse(None, "adds dims to it; repeat it along its own dims")], None
        return [refuse(a, f"repeats its split dim {place[a]}; repeat only along the batch, the channels or dims "
                          "that are not split") for a in along(d for d, c in enumerate(counts) if c != 1)], place
    hint = LOCAL_ONLY.format(what=f"{name} (a patch embedding, a flatten into tokens, windows, a matrix product)") \
        if name in MIXING else HINTS.get(name, DEFAULT_HINT)
    return [refuse(None, f"would compute on the slab, not the whole volume; {hint}")], None


def _view_rule(name, args, kwargs, place, shape, out_shape, refuse):
    """A view of a split tensor (``spatial_rule``): each spatial axis moves with the dim that carries it
    (``alias_dims``); one whose dim the view cuts or mixes into an inner position, or whose size it gives
    literally (a rank holds a slab of it), is refused."""
    where = alias_dims(name, args, kwargs, tuple(range(len(shape))), tuple(shape), tuple(out_shape))
    sizes = view_sizes(name, args, kwargs)
    refused, out = [], []
    for axis, d in enumerate(place):
        j = where.index(d) if d is not None and d in where else None
        if d is not None and j is None:
            refused.append(refuse(axis, f"moves the split dim {d} onto another dim or cuts it ({tuple(shape)} to "
                                        f"{tuple(out_shape)}); keep the split dim whole, and the outermost of the "
                                        f"dims a reshape joins, or {ELSEWHERE}"))
        elif j is not None and sizes is not None and sizes[j] not in (None, -1):
            refused.append(refuse(axis, f"gives the size of the split dim {j} literally ({sizes[j]} of "
                                        f"{tuple(out_shape)}), but a rank holds a slab of it; give that size as -1, "
                                        f"or {ELSEWHERE}"))
            j = None
        out.append(j)
    return refused, tuple(out)


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


def first_refusal(refusals, grid: tuple[int, ...]) -> str | None:
    """The message of the first of ``[(axis, message), ...]`` that a split by ``grid`` breaks."""
    for axis, message in refusals:
        if any(p > 1 for p in grid) if axis is None else (axis < len(grid) and grid[axis] > 1):
            return message
    return None

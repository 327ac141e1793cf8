"""Spatial parallelism: which modules the spatial runtime converts (``SPATIAL_MODULES``), and which functions are
exact on slabs of a split volume (``spatial_refusals``: everything else mixes positions and is refused)."""

from __future__ import annotations

from hybridpar.ir.rules.views import RESHAPES, SAME_DIMS, TRANSPOSES, call_arg, wrap_dim

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
    if name in CONCAT and wrap_dim(call_arg(args, kwargs, 1, "dim", 0), ndim) in (0, 1):
        return []
    softmax_dim = call_arg(args, kwargs, 1, "dim") if name in SOFTMAX else None
    if softmax_dim is not None and wrap_dim(softmax_dim, ndim) == 1:
        return []
    if name == "linear":
        return [(ndim - 3, f"linear on a spatially split tensor in {where} contracts its last dim, which is split; "
                           f"{LOCAL_ONLY.format(what='it')}")]
    if name == "__getitem__" and _channel_index(args[1] if len(args) > 1 else ()):
        return []
    if name == "pad":
        amounts = tuple(call_arg(args, kwargs, 1, "pad", ()))
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

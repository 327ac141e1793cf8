"""The safety net: every torch function a model calls on a partitioned tensor outside the converted
layers is checked during the (meta-device) trace, so code that would compute something else on a
slab than on the whole volume raises a ``UnsupportedModuleError`` naming the module and the fix.

Allowed on partitioned tensors: pointwise arithmetic and activations (with broadcasting that does
not stretch a split dim), concatenation along batch or channels, channel slicing, softmax over
channels, ``linear`` when the last dim is not split, and element-wise dropout.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from hybridpar.errors import UnsupportedModuleError

POINTWISE = frozenset(
    """add sub mul div true_divide neg pow rsub abs sqrt rsqrt exp log log1p expm1 square clamp clip
    clamp_min clamp_max maximum minimum where sigmoid tanh relu relu6 leaky_relu elu selu celu gelu silu
    mish softplus softsign hardtanh hardswish hardsigmoid prelu rrelu logsigmoid sin cos erf
    add_ sub_ mul_ div_ neg_ pow_ abs_ sqrt_ exp_ clamp_ relu_ leaky_relu_ elu_ selu_ celu_ hardtanh_
    sigmoid_ tanh_ silu_ mish_ gelu_ hardswish_ hardsigmoid_ threshold threshold_
    __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__
    __rtruediv__ __itruediv__ __neg__ __pow__ __rpow__ __abs__
    contiguous clone to float double half bfloat16 type type_as detach detach_ requires_grad_
    dropout alpha_dropout feature_alpha_dropout""".split()
)
CONCAT = frozenset({"cat", "concat", "concatenate"})
CHANNEL_SOFTMAX = frozenset({"softmax", "log_softmax"})
DROPOUT = frozenset({"dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d"})
HINTS = {
    "view": "use nn.Flatten() before the dense head (it gathers the slabs exactly)",
    "reshape": "use nn.Flatten() before the dense head (it gathers the slabs exactly)",
    "flatten": "use nn.Flatten() before the dense head (it gathers the slabs exactly)",
    "interpolate": "use an nn.Upsample module",
    "pad": "put the padding in the convolution (padding=, padding_mode=)",
    "mean": "use nn.AdaptiveAvgPool(1) for global pooling, or a hybridpar.spatial loss",
    "sum": "use nn.AdaptiveAvgPool(1) for global pooling, or a hybridpar.spatial loss",
    "amax": "use nn.AdaptiveMaxPool(1) for global pooling",
}
DEFAULT_HINT = "use the nn module for it (Conv, Pool, Upsample, Norm, Flatten), which hybridpar converts exactly"

PARTITIONED = "partitioned"
REPLICATED = "replicated"


class TraceState:
    """Status of each meta tensor seen in one trace (kept alive so ids stay unique)."""

    def __init__(self, grid_parts: tuple[int, ...], training: bool):
        self.grid_parts = grid_parts
        self.training = training
        self._status: dict[int, str] = {}
        self._alive: list[torch.Tensor] = []
        self.paths: list[str] = []
        self.suspended = 0

    def mark(self, obj, status: str | None) -> None:
        if status is None:
            return
        for t in tree_flatten(obj)[0]:
            if isinstance(t, torch.Tensor):
                self._status[id(t)] = status
                self._alive.append(t)

    def status(self, t) -> str | None:
        return self._status.get(id(t)) if isinstance(t, torch.Tensor) else None

    @property
    def path(self) -> str:
        return (self.paths[-1] if self.paths else "") or "<root>"


class Checker(TorchFunctionMode):
    """Checks and propagates partitioned / replicated status through unconverted code."""

    def __init__(self, state: TraceState):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.state.suspended:
            return out
        leaves = tree_flatten((args, kwargs))[0]
        statuses = {self.state.status(t) for t in leaves} - {None}
        if not statuses or not any(isinstance(t, torch.Tensor) for t in tree_flatten(out)[0]):
            return out
        name = getattr(func, "__name__", str(func))
        if PARTITIONED in statuses:
            self._check_partitioned(name, args, kwargs, leaves, out)
            self.state.mark(out, PARTITIONED)
        else:
            if name in DROPOUT and self.state.training:
                raise UnsupportedModuleError(
                    f"{name} in the forward of '{self.state.path}' would draw a different mask on each rank of "
                    "the spatial group; use an nn.Dropout module, which hybridpar makes share its mask"
                )
            self.state.mark(out, REPLICATED)
        return out

    def _check_partitioned(self, name, args, kwargs, leaves, out) -> None:
        parts = self.state.grid_parts
        split = [i for i, p in enumerate(parts) if p > 1]
        part_tensors = [t for t in leaves if self.state.status(t) == PARTITIONED]
        ndim = part_tensors[0].dim()
        if name in POINTWISE:
            for t in leaves:
                if isinstance(t, torch.Tensor) and self.state.status(t) != PARTITIONED:
                    self._check_broadcast(name, t, ndim, split)
            return
        if name in CONCAT:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            if dim % ndim in (0, 1):
                return
        if name in CHANNEL_SOFTMAX:
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if dim is not None and dim % ndim == 1:
                return
        if name == "linear" and (ndim - 3) not in split:
            return
        if name == "__getitem__" and self._channel_index(args[1]):
            return
        raise UnsupportedModuleError(
            f"{name} on a spatially split tensor in the forward of '{self.state.path}' would compute on the "
            f"slab, not the whole volume; {HINTS.get(name, DEFAULT_HINT)}"
        )

    def _check_broadcast(self, name, t, ndim, split) -> None:
        for axis in split:
            dim = 2 + axis - (ndim - t.dim())
            if dim >= 0 and t.shape[dim] != 1:
                raise UnsupportedModuleError(
                    f"{name} in the forward of '{self.state.path}' combines a spatially split tensor with a "
                    f"whole tensor of shape {tuple(t.shape)} along split dim {2 + axis}; make that tensor "
                    "size 1 along the split dims, or compute it from the input"
                )

    @staticmethod
    def _channel_index(index) -> bool:
        index = index if isinstance(index, tuple) else (index,)
        if not all(isinstance(i, slice) for i in index):
            return False
        return all(i == slice(None) for i in index[2:])

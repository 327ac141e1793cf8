"""The safety net: every torch function a model calls on a partitioned tensor outside the converted
layers is checked during the (meta-device) trace, so code that would compute something else on a
slab than on the whole volume raises a ``UnsupportedModuleError`` naming the module and the fix.

What is allowed on partitioned tensors is ``hybridpar.ir.rules.spatial_refusals`` (the planner's analysis
reads the same rules): pointwise arithmetic and activations (with broadcasting that does not stretch a split
dim), concatenation along batch or channels, channel slicing, softmax over channels, ``linear`` when the
last dim is not split, element-wise dropout, padding and repeats that leave the split dims alone, and
conversions that change nothing.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from hybridpar.errors import UnsupportedModuleError
from hybridpar.ir import rules

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
    """Checks and propagates partitioned / replicated status through unconverted code, by the rules the
    planner's analysis applies too (``hybridpar.ir.rules.spatial_refusals``)."""

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
            ndim = next(t.dim() for t in leaves if self.state.status(t) == PARTITIONED)
            refused = rules.first_refusal(rules.spatial_refusals(
                name, args, kwargs, lambda v: self.state.status(v) == PARTITIONED,
                lambda v: tuple(v.shape) if isinstance(v, torch.Tensor) else None, ndim, self.state.path),
                self.state.grid_parts)
            if refused:
                raise UnsupportedModuleError(refused)
            self.state.mark(out, PARTITIONED)
        else:
            refused = rules.replicated_refusal(name, self.state.training, self.state.path)
            if refused:
                raise UnsupportedModuleError(refused)
            self.state.mark(out, REPLICATED)
        return out

"""The safety net: every torch function a model calls on a partitioned tensor outside the converted layers is
checked during the (meta-device) trace, so code that would compute something else on a slab than on the whole
volume raises an ``UnsupportedModuleError`` naming the module and the fix.

What runs on slabs is ``hybridpar.ir.rules.spatial_rule``, applied as the model analysis applies it
(``hybridpar.ir.placements``): the split followed through every view (a permute moves it, a reshape keeps it where
its dim stays whole and is given as -1), position-wise functions (pointwise arithmetic and activations with
broadcasting that does not stretch a split dim, norms and ``linear`` over unsplit dims, reductions, softmax,
concatenation and slicing along unsplit dims), padding and repeats that leave the split dims alone.
"""

from __future__ import annotations

from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from hybridpar.errors import UnsupportedModuleError
from hybridpar.ir import rules
from hybridpar.ir.placements import PARTITIONED, REPLICATED, Placements

__all__ = ["PARTITIONED", "REPLICATED", "Checker", "TraceState"]


class TraceState:
    """Where the split lies in each meta tensor of one trace, and the module being run."""

    def __init__(self, grid_parts: tuple[int, ...], training: bool):
        self.grid_parts = grid_parts
        self.slabs = Placements(training)
        self.paths: list[str] = []
        self.suspended = 0

    def status(self, t) -> str | None:
        return self.slabs.status(t)

    def check(self, refusals) -> None:
        """Raise the first of ``refusals`` that this grid's split breaks."""
        refused = rules.first_refusal(refusals, self.grid_parts)
        if refused:
            raise UnsupportedModuleError(refused)

    @property
    def path(self) -> str:
        return (self.paths[-1] if self.paths else "") or "<root>"


class Checker(TorchFunctionMode):
    """Follows the split through unconverted code and refuses what would not run exactly on slabs, by the rules
    the model analysis applies too (``hybridpar.ir.rules.spatial_rule``)."""

    def __init__(self, state: TraceState):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.state.suspended or not tree_flatten(out)[0]:
            return out
        name = getattr(func, "__name__", str(func))
        if name == "__get__":  # a property (``x.T``, ``x.mT``): by its own name
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        self.state.check(self.state.slabs.function(name, args, kwargs, out, self.state.path))
        return out

"""What each call of a model's blocks receives and returns, recorded beside the tracer (``plan.trace``) as the
analysis runs the model: the interfaces of pipeline stages (``graph.BlockCall``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

from hybridpar.ir.graph import CONST, PARAM, BlockArg
from hybridpar.ir.placements import PARTITIONED
from hybridpar.ir.trace import Tracer


def structure(obj, from_input=lambda t: False) -> tuple:
    """What a forward or block returns, as nested tuples: ``("tensor", shape, dtype, requires_grad, computed from
    the model input)``, ``("tuple" | "list", items)``, ``("dict", ((key, item), ...))``, ``("value", v)`` for
    ``None``, numbers and strings, ``("other", type name)`` for anything else."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), str(obj.dtype).removeprefix("torch."), obj.requires_grad,
                from_input(obj))
    if isinstance(obj, (tuple, list)) and type(obj) in (tuple, list):
        return (type(obj).__name__, tuple(structure(x, from_input) for x in obj))
    if type(obj) is dict:
        return ("dict", tuple((k, structure(v, from_input)) for k, v in obj.items()))
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return ("value", obj)
    return ("other", type(obj).__name__)


@dataclass
class CallTrace:
    """One call of a block: what it receives, then (when it returns) what it returns and its layers' span."""

    block: str
    args: tuple[BlockArg, ...]
    first: int  # the index of its first layer
    output: tuple | None = None  # ``structure`` of what it returns
    returns: tuple[int, ...] = ()
    layers: tuple[int, int] = (0, 0)  # [first, stop) of its layers
    leaves: int = 0  # everything it is passed, flattened: its tensors and the rest (flags, None, sizes)


class BlockCalls:
    """Records the calls of the model's blocks: what each receives and returns."""

    def __init__(self, tracer: Tracer, names: list[str]):
        self.tracer, self.names = tracer, names
        self.order: list[str] = []  # blocks in the order of their first call
        self.calls: list[CallTrace] = []

    def enter(self, name: str, args, kwargs) -> None:
        with self.tracer.own():
            self._enter(name, args, kwargs)

    def _enter(self, name: str, args, kwargs) -> None:
        t = self.tracer
        leaves = tree_flatten((args, kwargs))[0]
        block_args = []
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                source = t.info[id(leaf)][0] if id(leaf) in t.info else (PARAM if id(leaf) in t.params else CONST)
                value = t.values.setdefault(id(leaf), len(t.values))
                t.alive.append(leaf)
                block_args.append(BlockArg(k, source, tuple(leaf.shape), str(leaf.dtype).removeprefix("torch."),
                                           leaf.requires_grad, value, t.slabs.status(leaf) == PARTITIONED,
                                           id(leaf) in t.from_input))
        if name not in self.order:
            self.order.append(name)
        self.calls.append(CallTrace(name, tuple(block_args), len(t.records), leaves=len(leaves)))

    def leave(self, name: str, out) -> None:
        with self.tracer.own():
            self._leave(name, out)

    def _leave(self, name: str, out) -> None:
        t = self.tracer
        call = next(c for c in reversed(self.calls) if c.block == name and c.output is None)
        call.output = structure(out, lambda x: id(x) in t.from_input)
        call.returns = tuple(t.values.setdefault(id(x), len(t.values)) for x in t._tensors(out))
        t.alive.extend(t._tensors(out))
        call.layers = (call.first, len(t.records))



"""Where the spatial split lies in each tensor of a forward, followed op by op (``rules.spatial_rule``): the model
analysis (``ir.trace``) and the spatial runtime's trace (``spatial.checks``) keep one of these each, so that both
decide alike what runs on slabs.

A tensor is *partitioned* (split in slabs: its ``placement`` gives the dim that carries each spatial axis; the
model input carries axis ``k`` at dim ``2 + k``), *whole* (every rank of the spatial group holds all of it: what a
global pooling or a flatten gathered, and what is computed from it alone) or neither (constants, parameters).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from hybridpar.ir import rules

PARTITIONED, REPLICATED = "partitioned", "replicated"


class Placements:
    """The placement of each tensor of one traced forward (kept alive, so that ids stay unique)."""

    def __init__(self, training: bool):
        self.training = training
        self._place: dict[int, tuple[int | None, ...]] = {}
        self._whole: set[int] = set()
        self._alive: list[torch.Tensor] = []

    @staticmethod
    def _tensors(obj) -> list[torch.Tensor]:
        return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]

    def split(self, x: torch.Tensor, num_axes: int) -> None:
        """``x`` (the model input, ``(N, C, *spatial)``) is split in slabs along its spatial dims."""
        self.mark(x, tuple(2 + k for k in range(num_axes)))

    def placement(self, t) -> tuple[int | None, ...] | None:
        return self._place.get(id(t)) if isinstance(t, torch.Tensor) else None

    def status(self, t) -> str | None:
        if not isinstance(t, torch.Tensor):
            return None
        return PARTITIONED if id(t) in self._place else REPLICATED if id(t) in self._whole else None

    def canonical(self, t) -> bool:
        """Whether ``t`` is split with its spatial axes where the modules the runtime converts take them."""
        place = self.placement(t)
        return place is not None and all(d in (None, 2 + k) for k, d in enumerate(place))

    def mark(self, out, placement: tuple[int | None, ...] | str | None) -> None:
        """The outputs ``out`` are split as ``placement``, whole (``REPLICATED``) or neither (``None``)."""
        for t in self._tensors(out):
            self._place.pop(id(t), None)
            self._whole.discard(id(t))
            if placement == REPLICATED:
                self._whole.add(id(t))
            elif placement is not None and any(d is not None for d in placement):
                self._place[id(t)] = tuple(placement)
            self._alive.append(t)

    def function(self, name: str, args, kwargs, out, where: str) -> list[tuple[int | None, str]]:
        """The spatial rule of the function ``name`` called in the forward of ``where`` (``[]`` for one that reads
        no split or whole tensor); its outputs are marked as the rule places them."""
        leaves = self._tensors((args, kwargs))
        outputs = self._tensors(out)
        if not outputs or not any(self.status(t) for t in leaves):
            return []
        if any(id(t) in self._place for t in leaves):
            refused, placement = rules.spatial_rule(name, args, kwargs, tuple(outputs[0].shape), self.placement,
                                                    lambda v: tuple(v.shape) if isinstance(v, torch.Tensor) else None,
                                                    where)
            self.mark(out, placement)
            return refused
        refused = rules.replicated_refusal(name, self.training, where)
        self.mark(out, REPLICATED)
        return [(None, refused)] if refused else []

    def module(self, module, x, out, where: str) -> list[tuple[int | None, str]]:
        """A module the spatial runtime converts read ``x`` and gave ``out``: split as its input was (whole after a
        module that gathers the slabs); it needs its input's spatial axes where it takes them (but for a module that
        works value by value, ``rules.POSITION_WISE_MODULES``)."""
        base = next((c.__name__ for c in type(module).__mro__ if c.__name__ in rules.SPATIAL_MODULES
                     and c.__module__.startswith("torch.nn.modules")), "")  # the torch.nn class it converts
        gathers = base in rules.GATHERING_MODULES
        status = self.status(x)
        if status == PARTITIONED and not self.canonical(x) and base not in rules.POSITION_WISE_MODULES:
            place = self.placement(x)
            self.mark(out, None)
            return [(k, f"layer '{where}' takes a volume whose spatial dims are 2 and on, but its input's split "
                        f"spatial dim {k} lies at dim {d}; move it back (permute) before the layer")
                    for k, d in enumerate(place) if d not in (None, 2 + k)]
        self.mark(out, REPLICATED if status == REPLICATED or (status and gathers) else self.placement(x))
        return []

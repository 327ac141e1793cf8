"""Running a model on the meta device (no memory), through data-dependent Python too.

``meta_copy(model)`` copies a model with every parameter and buffer on the meta device; the caller's model is
never changed. ``Values`` is a dispatch mode that keeps, beside each meta tensor that depends on no
parameter and is small (token ids, position ids, masks built from them, a rotary table from its buffer,
a batch norm's step counter), its real value on the CPU, computed op by op as the real run would compute
it. So a forward that branches on such values (``if (mask[:, -1] == 0).all():``, ``float(num_batches)``)
takes the branch the real run takes, and a large model or a large volume still costs no memory: parameters
and tensors over ``VALUE_LIMIT`` elements have no value. A branch on a value that depends on the weights
(a mixture-of-experts router, say) raises ``DataDependentError``, naming the operation.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.weak import WeakIdKeyDictionary

VALUE_LIMIT = 2**20  # elements: larger tensors (activations, volumes) keep no value
_META = torch.device("meta")
_SCALARS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
            torch.ops.aten.equal.default}


class DataDependentError(RuntimeError):
    """A forward used the value of a tensor that depends on the model's weights (or is too large to keep)."""


def meta_copy(model: nn.Module, values: Values | None = None, dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the meta device (floating ones in ``dtype``, if
    given); ``values`` (if given) keeps the real value of each small buffer. Process groups and meshes are
    shared, not copied."""
    memo = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in memo:
            continue
        kind = dtype if dtype is not None and t.is_floating_point() else t.dtype
        meta = torch.empty_like(t, device="meta", dtype=kind)
        if isinstance(t, nn.Parameter):
            meta = nn.Parameter(meta, requires_grad=t.requires_grad)
        elif values is not None and not t.is_meta and t.numel() <= VALUE_LIMIT:
            values.set(meta, t.detach().to("cpu", kind, copy=True))
        memo[id(t)] = meta
    for m in model.modules():
        memo.update((id(v), v) for v in vars(m).values() if _shared(v))
    return copy.deepcopy(model, memo)


def _shared(value) -> bool:
    return type(value).__name__ in ("ProcessGroup", "DeviceMesh")


class Values(TorchDispatchMode):
    """Real values of the small parameter-free tensors of a meta run (see the module doc). Enter it before
    (under) any other dispatch mode of the run, e.g. a ``FlopCounterMode``, so that they do not see its work."""

    def __init__(self):
        super().__init__()
        self._values = WeakIdKeyDictionary()

    def set(self, meta: torch.Tensor, value: torch.Tensor) -> None:
        self._values[meta] = value

    def get(self, meta: torch.Tensor) -> torch.Tensor | None:
        return self._values.get(meta)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if tensors and not any(t.is_meta for t in tensors):  # real tensors only (an index table a forward builds
            return func(*args, **kwargs)  # and caches): run once, as they are (again, for a value, would mutate twice)
        known = all(t in self._values or not t.is_meta for t in tensors)
        if func in _SCALARS:
            if not known:
                raise DataDependentError(f"{func.name()} of a tensor computed from the weights (or of more than "
                                         f"{VALUE_LIMIT} elements)")
            return func(*self._real(args), **self._real(kwargs))
        try:
            out = func(*args, **kwargs)
        except (NotImplementedError, RuntimeError) as err:
            if not known and isinstance(err, NotImplementedError):  # no meta kernel: a shape from values
                raise DataDependentError(f"{func.name()} gives a shape that depends on the values of a tensor "
                                         "computed from the weights (a mixture-of-experts router's choice)") from err
            if not known:  # an output shape that depends on values (nonzero, masked_select) is known from them
                raise
            real = func(*self._real(args), **self._real(kwargs))
            out = tree_map(lambda r: torch.empty_like(r, device="meta") if isinstance(r, torch.Tensor) else r, real)
            self._pair(out, real)
            return out
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if known and all(t.numel() <= VALUE_LIMIT for t in outputs):
            self._pair(out, func(*self._real(args), **self._real(kwargs)))
        elif func._schema.is_mutable:  # written from a tensor without a value: forget what it held
            for t in tensors:
                self._values.pop(t, None)
                if t._base is not None:
                    self._values.pop(t._base, None)
        return out

    def _real(self, tree):
        def real(x):
            if isinstance(x, torch.Tensor):
                return self._values[x] if x.is_meta else x
            return torch.device("cpu") if isinstance(x, torch.device) and x == _META else x

        return tree_map(real, tree)

    def _pair(self, out, real) -> None:
        for o, r in zip(tree_flatten(out)[0], tree_flatten(real)[0]):
            if isinstance(o, torch.Tensor) and o.is_meta and isinstance(r, torch.Tensor):
                self._values[o] = r

"""The tracer behind the model analysis (``hybridpar.ir.analysis``): a ``TorchFunctionMode`` that records
leaf modules and the tensor operations between them as layer records, follows views of their outputs dim by
dim (``rules.alias_dims``), counts what autograd saves, gives the spatial runtime's verdict on every operation
a split volume meets (``rules.spatial_rule``, ``ir.placements``), and records what each block call receives and returns.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from hybridpar.ir import rules
from hybridpar.ir.graph import CONST, INPUT, PARAM, Read, View
from hybridpar.ir.placements import PARTITIONED, Placements

ATTENTION_FUNCTIONS = rules.ATTENTION

MODULE_KINDS: tuple[tuple[tuple[type, ...], str], ...] = (
    ((nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d), "conv_transpose"),
    ((nn.Conv1d, nn.Conv2d, nn.Conv3d), "conv"),
    ((nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d,
      nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d), "global_pool"),
    ((nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d), "pool"),
    ((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm), "batch_norm"),
    ((nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.GroupNorm), "group_norm"),
    ((nn.LayerNorm, nn.RMSNorm), "layer_norm"),
    ((nn.Linear,), "linear"),
    ((nn.Embedding,), "embedding"),
    ((nn.Flatten,), "flatten"),
    ((nn.Upsample,), "upsample"),
    ((nn.MultiheadAttention,), "attention"),
)
WHOLE_MODULES = (nn.MultiheadAttention,)  # analysed as one layer though they have children


@dataclass
class LayerTrace:
    """One layer as the trace fills it in: when its call begins (what it reads), while it runs (what autograd saves,
    the functions a module calls) and when it ends (what it returns); ``analysis`` makes it a ``graph.Layer``."""

    name: str
    kind: str
    op: str
    inputs: tuple[int, ...]
    reads: tuple[Read, ...]
    module: nn.Module | None
    in_shapes: tuple[tuple[int, ...], ...]
    in_bytes: int
    args: tuple
    params: tuple[str, ...]
    flops0: float  # the flop counter's total when the call began
    spatial_in: bool
    path: str = ""
    saved: int = 0
    functions: set[str] = field(default_factory=set)
    heads: int = 0
    kv_heads: int = 0
    index: int = -1
    flops: float = 0.0
    out: tuple[int, ...] = ()
    outputs: int = 0
    out_bytes: int = 0
    dtype_bytes: int = 4


class Tracer(TorchFunctionMode):
    """Records leaf modules and the tensor operations between them as layers, and the spatial runtime's
    verdict on each operation a split volume meets."""

    def __init__(self, model: nn.Module, x: torch.Tensor, counter: FlopCounterMode, volume: bool):
        super().__init__()
        self.counter = counter
        self.info: dict[int, tuple[int, int, tuple, tuple]] = {}  # id -> (source, output, dims, blocks)
        self.alive: list[torch.Tensor] = []
        self._produce(x, INPUT)
        self.records: list[LayerTrace] = []
        self.module_stack: list[str] = []
        self.inside_leaf = 0
        self.converted = 0  # inside a module the spatial runtime converts: its operations are not checked
        self.current: LayerTrace | None = None
        self.saved: set[int] = set()
        self.params = {id(p): (name,) for name, p in model.named_parameters()}  # also views of them, and tensors
        # computed from them alone (``weight.t()``, ``log_scale.exp()``): what they are read as
        self.buffers = {id(b) for b in model.buffers()}
        self.counts: dict[str, int] = {}
        self.quiet = 0  # our own bookkeeping (numel, shapes) is not the model's
        self.from_input = {id(x)}  # the tensors computed from the model input (``spread``)
        self.slabs = Placements(model.training)  # where the spatial split lies in each tensor
        if volume:
            self.slabs.split(x, x.dim() - 2)
        self.module_records: dict[int, LayerTrace] = {}
        self.values: dict[int, int] = {}  # id of a tensor passed to a block -> its number (BlockArg.value)
        self.refusals: list[tuple[int | None, str]] = []
        self.training = model.training

    # --- tensors ---------------------------------------------------------------------------------
    @staticmethod
    def _tensors(obj) -> list[torch.Tensor]:
        return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]

    def _read(self, t: torch.Tensor) -> Read:
        shape = tuple(t.shape)
        if id(t) in self.info:
            source, output, dims, blocks, views = self.info[id(t)]
            return Read(source, shape, dims, blocks, output, views=views)
        if id(t) in self.params:
            return Read(PARAM, shape, params=self.params[id(t)])
        return Read(CONST, shape)

    def _produce(self, out, index: int) -> None:
        for k, t in enumerate(self._tensors(out)):
            self.info[id(t)] = (index, k, tuple(range(t.dim())), tuple(t.shape), ())
            self.alive.append(t)

    def _alias(self, name: str, args, kwargs, out) -> None:
        """A view's outputs carry what its input's dims carry, moved as ``rules.alias_dims`` says."""
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is None or id(source) not in self.info:
            return
        producer, output, dims, blocks, views = self.info[id(source)]
        in_shape = tuple(source.shape)
        sizes = rules.view_sizes(name, args, kwargs)
        module = self.module_stack[-1] if self.module_stack else ""
        for t in self._tensors(out):
            where = rules.alias_dims(name, args, kwargs, tuple(range(len(in_shape))), in_shape, tuple(t.shape))
            view = View(name, in_shape, tuple(t.shape), where, sizes, module)
            self.info[id(t)] = (producer, output, tuple(None if w is None else dims[w] for w in where),
                                tuple(0 if w is None or dims[w] is None else math.gcd(blocks[w], t.shape[j])
                                      for j, w in enumerate(where)), views + (view,))
            self.alive.append(t)

    def _from_params(self, args, kwargs, out) -> None:
        """A tensor computed from parameters alone (a view ``weight.t()``, ``log_scale.exp()``) is read as them."""
        names = tuple(dict.fromkeys(n for t in self._tensors((args, kwargs)) for n in self.params.get(id(t), ())))
        if names:
            for t in self._tensors(out):
                self.params[id(t)] = names
                self.alive.append(t)

    # --- spatial: the runtime's check, on every operation outside the modules it converts ----------
    def _spatial(self, name: str, args, kwargs, out) -> None:
        if self.converted:
            return
        where = self.module_stack[-1] if self.module_stack and self.module_stack[-1] else "<root>"
        self.refusals.extend(self.slabs.function(name, args, kwargs, out, where))

    # --- layers ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def own(self):
        """Our own bookkeeping (shapes, ids, statuses): not the model's, not traced."""
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1

    def begin(self, name: str, kind: str, op: str, args, kwargs, module: nn.Module | None = None,
              flops0: float | None = None, path: str = "") -> LayerTrace:
        with self.own():
            return self._begin(name, kind, op, args, kwargs, module, flops0, path)

    def _begin(self, name, kind, op, args, kwargs, module, flops0, path) -> LayerTrace:
        tensors = self._tensors((args, kwargs))
        reads = tuple(self._read(t) for t in tensors)
        inputs = tuple(dict.fromkeys(r.source for r in reads if r.source >= INPUT))
        record = LayerTrace(
            name=name, kind=kind, op=op, inputs=inputs, reads=reads, module=module,
            in_shapes=tuple(tuple(t.shape) for t in tensors), in_bytes=_bytes(tensors), args=_simple_args(args, kwargs),
            params=tuple(dict.fromkeys(name for r in reads if r.source == PARAM for name in r.params)),
            flops0=self.counter.get_total_flops() if flops0 is None else flops0,
            spatial_in=bool(tensors) and self.slabs.status(tensors[0]) == PARTITIONED, path=path,
        )
        self.current = record
        return record

    def end(self, record: LayerTrace, out, flops: float | None = None) -> None:
        with self.own():
            self._end(record, out, flops)

    def _end(self, record: LayerTrace, out, flops: float | None) -> None:
        tensors = self._tensors(out)
        record.index = len(self.records)
        record.flops = self.counter.get_total_flops() - record.flops0 if flops is None else flops
        record.out = tuple(tensors[0].shape) if tensors else ()
        record.outputs = len(tensors)
        record.out_bytes = _bytes(tensors)
        record.dtype_bytes = tensors[0].element_size() if tensors else 4
        self.records.append(record)
        self._produce(out, record.index)
        self.current = None

    def pack(self, t: torch.Tensor):
        if self.current is None or self.current.kind == "attention":  # counted by _attention_saved
            return t
        with self.own():
            base = t._base if t._base is not None else t
            if id(base) not in self.params and id(t) not in self.params and id(base) not in self.saved:
                self.saved.add(id(base))
                self.alive.append(base)
                self.current.saved += base.numel() * base.element_size()
        return t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name == "__get__":  # a property (``x.T``, ``x.mT``): by its own name
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name == "__getitem__" and len(args) == 2:
            args = (args[0], _listed(args[1]))
        if self.quiet:
            return func(*args, **kwargs)
        out = self._function(func, name, args, kwargs)
        with self.own():
            self.spread(args, kwargs, out)
        return out

    def spread(self, args, kwargs, out) -> None:
        """``out`` is computed from the model input where something ``(args, kwargs)`` holds is: its dim 0 is the
        batch where it has the batch's size (``ModelGraph.at_batch`` resizes it for a micro-batch)."""
        if any(id(t) in self.from_input for t in self._tensors((args, kwargs))):
            for t in self._tensors(out):
                self.from_input.add(id(t))
                self.alive.append(t)

    def _function(self, func, name: str, args, kwargs):
        if self.inside_leaf:
            out = func(*args, **kwargs)
            with self.own():
                if self.current is not None and self._tensors(out):
                    self.current.functions.add(name)
                self._spatial(name, args, kwargs, out)
            return out
        with self.own():
            produced = any(id(t) in self.info for t in self._tensors((args, kwargs)))
        if not produced or name in rules.SHAPE_ONLY:  # constants, or a tensor of the input's shape: not a layer
            out = func(*args, **kwargs)
            with self.own():
                self._spatial(name, args, kwargs, out)
                if not produced:
                    self._from_params(args, kwargs, out)
            return out
        if name in rules.ALIASES:
            out = func(*args, **kwargs)
            with self.own():
                self._alias(name, args, kwargs, out)
                self._spatial(name, args, kwargs, out)
            return out
        flops0 = self.counter.get_total_flops()
        kind = "attention" if name in ATTENTION_FUNCTIONS else (
            "pointwise" if name in rules.POINTWISE else "cat" if name in rules.CONCAT else "other")
        record = self.begin("", kind, name, args, kwargs, flops0=flops0)
        out = func(*args, **kwargs)
        if not self._tensors(out):
            self.current = None
            return out
        with self.own():
            self._spatial(name, args, kwargs, out)
            parent = self.module_stack[-1] if self.module_stack else ""
            k = self.counts[f"{parent}:{name}"] = self.counts.get(f"{parent}:{name}", -1) + 1
            record.name = f"{parent}:{name}#{k}" if parent else f"{name}#{k}"
            if kind == "attention":
                q, key = (list(args) + [kwargs.get("query"), kwargs.get("key")])[:2]
                record.heads, record.kv_heads = q.shape[-3], key.shape[-3]
                record.saved = self._attention_saved(args, kwargs, out)
        self.end(record, out, _attention_flops(args, kwargs) if kind == "attention" else None)
        return out

    def _attention_saved(self, args, kwargs, out) -> int:
        """What fused attention (flash, memory-efficient; CPU and GPU) keeps: q, k, v, the output and the
        log-sum-exp per query row, not the ``Lq x Lk`` matrix of the math path that the meta device runs."""
        total = 0
        for t in self._tensors((args[:3], kwargs)) + self._tensors(out):
            base = t._base if t._base is not None else t
            if id(base) not in self.saved:
                self.saved.add(id(base))
                self.alive.append(base)
                total += base.numel() * base.element_size()
        q = args[0]
        total += q.numel() // q.shape[-1] * 4
        return total


def _listed(index):
    """An index with its lists of ints (``x[:, [-1, 0]]``) as CPU tensors, which the meta device's values follow
    (PyTorch would make them meta tensors, whose values are lost: a forward that branches on the result could not
    be analysed)."""
    if isinstance(index, list) and index and all(isinstance(i, int) and not isinstance(i, bool) for i in index):
        return torch.tensor(index)
    if isinstance(index, tuple):
        return tuple(_listed(i) for i in index)
    return index


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _simple_args(args, kwargs) -> tuple:
    """The call's arguments other than tensors that the rules read (dims, sizes, amounts, indices), as
    ``(position or name, value)``; positions count the tensors too."""
    def simple(v) -> bool:
        if isinstance(v, (tuple, list)):
            return all(simple(x) for x in v)
        return v is None or isinstance(v, (bool, int, float, str, slice, type(Ellipsis)))

    out = [(i, tuple(v) if isinstance(v, list) else v) for i, v in enumerate(args) if simple(v)]
    out += [(k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items() if simple(v)]
    return tuple(out)


def _attention_flops(args, kwargs) -> float:
    q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")])[:3]
    *batch, lq, e = q.shape
    lk, ev = k.shape[-2], v.shape[-1]
    return 2.0 * math.prod(batch) * lq * lk * (e + ev)  # Q·Kᵀ and P·V; causal masks are not discounted


def module_kind(module: nn.Module) -> str | None:
    for classes, kind in MODULE_KINDS:
        if isinstance(module, classes):
            return kind
    if _is_norm(module):
        return "layer_norm"
    return None


def _is_norm(module: nn.Module) -> bool:
    """A normalisation over the last dim written outside torch (Llama's ``RMSNorm``): named so, with a weight
    (and a bias) of one value per feature."""
    name = type(module).__name__
    params = list(module.parameters(recurse=False))
    return name.endswith(("RMSNorm", "LayerNorm")) and bool(params) and all(p.dim() == 1 for p in params)


def is_leaf(module: nn.Module) -> bool:
    return isinstance(module, WHOLE_MODULES) or not any(True for _ in module.children())

"""Model analysis: one forward pass on the meta device gives the planner and the runtime the model's graph.

A *layer* is a leaf module (``Conv3d``, ``Linear``, ``LayerNorm``, ...) or a tensor operation called
between modules (the residual ``add``, ``scaled_dot_product_attention``, ``cat``). Views (``view``,
``transpose``, ``split``, ...) are not layers: a view of a layer's output is read as that output, with each
of its dims traced back to the output dim it holds whole blocks of (``Read.dims``), so that a split of the
output can be followed through the views (``hybridpar.plan.rules``). For each layer the trace records, for the
example batch:

- forward FLOPs (PyTorch's ``FlopCounterMode``; attention counted here as ``4·B·H·Lq·Lk·E``, since
  the counter misses the fused kernels of some backends) and the bytes the forward reads and writes;
- bytes of its output, of what autograd saves for backward (``saved_tensors_hooks``; a tensor saved
  twice counts once, parameters not at all) and of its parameters;
- its sliding windows (kernel, stride, padding, dilation per spatial dim), whence its halo widths;
- every tensor it reads (``reads``): which layer made it (or the input, a parameter, a constant), its
  shape, and where each of its dims comes from;
- whether it runs on slabs of a spatially split input, and what the spatial runtime would refuse
  (``spatial_refusals``, by the same rules as the runtime's check).

The graph also records the model's blocks in the order the forward calls them, what each call passes
and returns (``block_calls``: the interfaces of pipeline stages), and which parameters are one tensor under
several names or used by several layers (``shared``: tied embeddings, a module registered twice).

Nothing is allocated: parameters and activations live on the meta device (a copy: the caller's model is
never touched), with the real values of small parameter-free tensors kept beside them (``hybridpar.meta``),
so that data-dependent Python in a forward takes the branch the real run takes, and CosmoFlow at 512³ or a
175B-parameter GPT analyse in seconds on a laptop.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from hybridpar import meta
from hybridpar.errors import HybridparError, PlanError
from hybridpar.plan import rules
from hybridpar.spatial.geometry import Window

INPUT = -1  # source of the model input
PARAM = -2  # source of a parameter read by an operation
CONST = -3  # source of a tensor made of constants (no layer made it)
PARTITIONED, REPLICATED = "partitioned", "replicated"  # of a spatially split model's tensors

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
SPLITTABLE_TYPES = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)  # exact types tensor parallelism splits


@dataclass(frozen=True)
class Read:
    """One tensor a layer reads: made by layer ``source`` (output number ``output``), or ``INPUT``, ``PARAM``,
    ``CONST``. ``dims[d]`` is the dim of that output whose whole contiguous blocks dim ``d`` holds (``None``:
    none, e.g. a dim a view cut or made), ``blocks[d]`` the greatest common divisor of the sizes that dim had
    on the way (a split into ``n`` parts survives the views where ``n`` divides it)."""

    source: int
    shape: tuple[int, ...]
    dims: tuple[int | None, ...] = ()
    blocks: tuple[int, ...] = ()
    output: int = 0
    params: tuple[str, ...] = ()  # the parameters it is (a view of) or is computed from alone (source PARAM)


@dataclass(frozen=True)
class Layer:
    """One layer of the traced model, for the example batch (``batch`` samples)."""

    index: int
    name: str  # module path ("features.0") or "<parent path>:<function>#k" for a tensor operation
    kind: str  # conv, conv_transpose, pool, global_pool, batch_norm, group_norm, layer_norm, linear,
    #            embedding, flatten, upsample, attention, pointwise, cat, other
    op: str  # the module's class or the function's name
    inputs: tuple[int, ...]  # producer layer of each tensor read (INPUT: the model input), once each
    in_shape: tuple[int, ...]  # of the first tensor read
    out_shape: tuple[int, ...]
    dtype_bytes: int
    flops: float  # forward
    bytes_moved: float  # forward: tensors read + written, parameters included
    out_bytes: int
    saved_bytes: int  # activations autograd keeps for backward (first saver pays for a shared tensor)
    param_bytes: int
    num_params: int
    windows: tuple[Window, ...] = ()  # per spatial dim, for conv and pool layers
    boundary: str = "zeros"  # padding mode of a conv
    channels: tuple[int, int] = (0, 0)  # (in, out) features / channels of conv, linear, embedding
    heads: int = 0  # attention heads (of the query)
    kv_heads: int = 0  # attention heads of the key and value (fewer: grouped-query attention)
    spatial_in: bool = False  # its first input is an (N, C, *spatial) volume that may be split in slabs
    has_weight: bool = False
    reads: tuple[Read, ...] = field(default=(), compare=False)
    args: tuple[tuple, ...] = field(default=(), compare=False)  # the call's other arguments: ((position or name, value), ...)
    params: tuple[str, ...] = field(default=(), compare=False)  # names of the parameters it uses
    exact: bool = False  # a module of exactly one of the torch.nn types tensor parallelism splits
    groups: int = 1  # of a conv
    outputs: int = 1  # tensors it returns
    shared: bool = False  # uses a parameter that is shared (ModelGraph.shared)
    path: str = ""  # the module's path, for a layer that is a module ("" for an operation)
    repeated: bool = False  # a module the forward calls more than once (its later calls are "path#k")

    @cached_property
    def signature(self) -> tuple:
        """Everything that prices the layer: equal for the repeated blocks of a network."""
        return (self.kind, self.op, self.in_shape, self.out_shape, self.dtype_bytes, self.flops, self.bytes_moved,
                self.out_bytes, self.saved_bytes, self.param_bytes, self.windows, self.boundary, self.channels,
                self.heads, self.kv_heads, self.spatial_in, self.has_weight, self.exact, self.groups, self.shared,
                self.inputs == (self.index - 1,), self.inputs == () or all(p == INPUT for p in self.inputs))

    @property
    def is_module(self) -> bool:
        """Whether the layer is a module (``path``), not an operation called in a forward (``'add#0'``,
        ``'blocks.0.attn:scaled_dot_product_attention#0'``)."""
        return bool(self.path)

    @property
    def owner(self) -> str:
        """The path of the module the layer runs in: its own, or that of the module whose forward calls the
        operation (``''``: the model's own forward)."""
        if self.is_module:
            return self.path
        return self.name.partition(":")[0] if ":" in self.name else ""

    @property
    def halo(self) -> tuple[tuple[int, int], ...]:
        """Rows below and above each output slab that a window reads beyond the slab's own input rows
        (for a stride-1 window: the padding on each side)."""
        return tuple(_halo(w) for w in self.windows)

    def arg(self, key, default=None):
        """The call's argument at position ``key`` (counting the tensors too) or named ``key``."""
        return dict(self.args).get(key, default)


def _halo(w: Window) -> tuple[int, int]:
    reach = w.dilation * (w.kernel - 1)
    return (w.pad_left, max(0, reach - w.pad_left - (w.stride - 1)))


@dataclass(frozen=True)
class BlockArg:
    """One tensor a block call receives: its place among the call's flattened ``(args, kwargs)``, the layer that
    made it (``INPUT``, ``CONST``), and what it is."""

    leaf: int
    source: int
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    value: int  # the same number for the same tensor passed to several calls


@dataclass(frozen=True)
class BlockCall:
    """One call of a block (``ModelGraph.blocks[block]``): what it is passed and what it returns. ``output`` is
    the returned structure (``structure``); ``layers`` the range of layer indices the call ran."""

    block: int
    args: tuple[BlockArg, ...]
    output: tuple
    layers: tuple[int, int]
    returns: tuple[int, ...] = ()  # the values (``BlockArg.value``) of the tensors it returns


@dataclass(frozen=True)
class ModelGraph:
    """The layers of a model in execution order, for an example input of ``input_shape``."""

    layers: tuple[Layer, ...]
    input_shape: tuple[int, ...]
    input_bytes: int
    param_bytes: int
    num_params: int
    consumers: tuple[tuple[int, ...], ...] = field(repr=False, default=())
    name: str = ""  # the model's class
    blocks: tuple[str, ...] = ()  # the model's blocks in the order its forward first calls them; () if unknown
    block_calls: tuple[BlockCall, ...] = field(repr=False, default=())
    shared: tuple[tuple[str, ...], ...] = ()  # names of each parameter that is shared (see module doc)
    input_dtype: str = "float32"
    spatial_refusals: tuple[tuple[int | None, str], ...] = field(repr=False, default=())
    outputs: tuple[int, ...] = ()  # the layers that make the tensors the forward returns
    unused: tuple[str, ...] = ()  # parameters no layer of the forward uses (for the example input)
    output_values: tuple[int, ...] = ()  # their values (``BlockArg.value``), where a block returned them

    def index_of(self, name: str) -> int:
        """The index of the layer called ``name``, or a ``PlanError`` that lists some of the names."""
        index = self.__dict__.get("_names") or self.__dict__.setdefault(
            "_names", {layer.name: layer.index for layer in self.layers})
        if name not in index:
            raise PlanError(f"layer {name!r} is not in the model ({self.name}); use layer names as "
                            f"hybridpar.plan.graph_of gives them (module paths, e.g. {self.layers[-1].name!r})")
        return index[name]

    @property
    def batch(self) -> int:
        return self.input_shape[0]

    @property
    def flops(self) -> float:
        return sum(layer.flops for layer in self.layers)

    @property
    def spatial_ndim(self) -> int:
        """Spatial dims of the input volume (0 for a model that takes no volume)."""
        return len(self.input_shape) - 2 if self.layers and self.layers[0].spatial_in else 0

    @cached_property
    def skip_sources(self) -> frozenset[int]:
        """Layers whose output is read by a layer other than the next one."""
        return frozenset(i for i, users in enumerate(self.consumers) if any(u != i + 1 for u in users))

    @cached_property
    def isotropic(self) -> bool:
        """Every spatial dim alike (a cubic input, windows the same along each dim): permuting a spatial
        grid changes no cost."""
        if self.spatial_ndim < 2 or len(set(self.input_shape[2:])) != 1:
            return False
        return all(len(set(layer.windows)) <= 1 and len(set(layer.out_shape[2:])) <= 1
                   for layer in self.layers if layer.spatial_in)

    @cached_property
    def block_index(self) -> tuple[int | None, ...]:
        """For each layer, the index in ``blocks`` of the block it runs in (``None``: outside every block,
        e.g. an operation in the model's own forward)."""
        order = {name: i for i, name in enumerate(self.blocks)}
        out = []
        for layer in self.layers:
            path = layer.owner
            out.append(next((order[b] for b in self.blocks if path == b or path.startswith(b + ".")), None))
        return tuple(out)

    @cached_property
    def cut_points(self) -> tuple[int, ...]:
        """``i`` such that a pipeline cut after layer ``i`` sends exactly one tensor: the output of ``i``."""
        last_use: dict[int, int] = {}
        for i, layer in enumerate(self.layers):
            for p in layer.inputs:
                last_use[p] = i
        # live after i: producers p <= i with last use > i; count them with a sweep
        opens, closes = [0] * (len(self.layers) + 1), [0] * (len(self.layers) + 1)
        for p, last in last_use.items():  # the model input (INPUT) is live from the start
            opens[max(p, 0)] += 1
            closes[last] += 1
        points, live = [], 0
        for i in range(len(self.layers) - 1):
            live += opens[i] - closes[i]
            if live == 1 and last_use.get(i, -1) > i:
                points.append(i)
        return tuple(points)

    @cached_property
    def stage_starts(self) -> tuple[int, ...]:
        """Layers a pipeline stage can start at (after the first): the first layer of a block where the model
        can be cut (``rules.stage_cut_refusal``). A graph without ``blocks`` (built by hand) allows every cut
        point."""
        if not self.blocks:
            return tuple(i + 1 for i in self.cut_points)
        return tuple(first for b, first in self.block_starts.items()
                     if first > 0 and rules.stage_cut_refusal(self, b) is None)

    @cached_property
    def is_chain(self) -> bool:
        """Whether the forward is its blocks applied one after another, each to what the one before returned (the
        first to the model input), and returns what the last one returns, with nothing between them: then a
        pipeline stage takes the previous stage's output as its input, and skipped blocks pass it on."""
        calls = self.block_calls
        if not calls or any(b is None for b in self.block_index):
            return False
        previous = None
        for call in calls:
            tensors = [a for a in call.args if a.source not in (PARAM, CONST)]
            if len(tensors) != 1 or len(call.returns) != 1:
                return False
            if (tensors[0].source != INPUT) if previous is None else (tensors[0].value != previous):
                return False
            previous = call.returns[0]
        return self.output_values == (previous,)

    @cached_property
    def block_starts(self) -> dict[int, int]:
        """``{block index: its first layer}`` for the blocks that run a layer, in order."""
        out: dict[int, int] = {}
        for i, b in enumerate(self.block_index):
            if b is not None and b not in out:
                out[b] = i
        return out


def structure(obj) -> tuple:
    """What a forward or block returns, as nested tuples: ``("tensor", shape, dtype, requires_grad)``,
    ``("tuple" | "list", items)``, ``("dict", ((key, item), ...))``, ``("value", v)`` for ``None``, numbers and
    strings, ``("other", type name)`` for anything else."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), str(obj.dtype).removeprefix("torch."), obj.requires_grad)
    if isinstance(obj, (tuple, list)) and type(obj) in (tuple, list):
        return (type(obj).__name__, tuple(structure(x) for x in obj))
    if type(obj) is dict:
        return ("dict", tuple((k, structure(v)) for k, v in obj.items()))
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return ("value", obj)
    return ("other", type(obj).__name__)


class _Tracer(TorchFunctionMode):
    """Records leaf modules and the tensor operations between them as layers, and the spatial runtime's
    verdict on each operation a split volume meets."""

    def __init__(self, model: nn.Module, x: torch.Tensor, counter: FlopCounterMode, volume: bool):
        super().__init__()
        self.counter = counter
        self.info: dict[int, tuple[int, int, tuple, tuple]] = {}  # id -> (source, output, dims, blocks)
        self.alive: list[torch.Tensor] = []
        self._produce(x, INPUT)
        self.records: list[dict] = []
        self.module_stack: list[str] = []
        self.inside_leaf = 0
        self.converted = 0  # inside a module the spatial runtime converts: its operations are not checked
        self.current: dict | None = None
        self.saved: set[int] = set()
        self.params = {id(p): (name,) for name, p in model.named_parameters()}  # also views of them, and tensors
        # computed from them alone (``weight.t()``, ``log_scale.exp()``): what they are read as
        self.buffers = {id(b) for b in model.buffers()}
        self.counts: dict[str, int] = {}
        self.quiet = 0  # our own bookkeeping (numel, shapes) is not the model's
        self.status: dict[int, str] = {id(x): PARTITIONED} if volume else {}
        self.module_records: dict[int, dict] = {}
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
            source, output, dims, blocks = self.info[id(t)]
            return Read(source, shape, dims, blocks, output)
        if id(t) in self.params:
            return Read(PARAM, shape, params=self.params[id(t)])
        return Read(CONST, shape)

    def _produce(self, out, index: int) -> None:
        for k, t in enumerate(self._tensors(out)):
            self.info[id(t)] = (index, k, tuple(range(t.dim())), tuple(t.shape))
            self.alive.append(t)

    def _alias(self, name: str, args, kwargs, out) -> None:
        """A view's outputs carry what its input's dims carry, moved as ``rules.alias_dims`` says."""
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if source is None or id(source) not in self.info:
            return
        producer, output, dims, blocks = self.info[id(source)]
        in_shape = tuple(source.shape)
        for t in self._tensors(out):
            where = rules.alias_dims(name, args, kwargs, tuple(range(len(in_shape))), in_shape, tuple(t.shape))
            self.info[id(t)] = (producer, output, tuple(None if w is None else dims[w] for w in where),
                                tuple(0 if w is None or dims[w] is None else math.gcd(blocks[w], t.shape[j])
                                      for j, w in enumerate(where)))
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
        leaves = self._tensors((args, kwargs))
        statuses = {self.status.get(id(t)) for t in leaves} - {None}
        if not statuses or not self._tensors(out):
            return
        where = self.module_stack[-1] if self.module_stack and self.module_stack[-1] else "<root>"
        if PARTITIONED in statuses:
            ndim = next(t.dim() for t in leaves if self.status.get(id(t)) == PARTITIONED)
            refused = rules.spatial_refusals(
                name, args, kwargs, lambda v: isinstance(v, torch.Tensor) and self.status.get(id(v)) == PARTITIONED,
                lambda v: tuple(v.shape) if isinstance(v, torch.Tensor) else None, ndim, where)
            self.refusals.extend(refused)
            self._mark(out, None if any(a is None for a, _ in refused) else PARTITIONED)
        else:
            refused = rules.replicated_refusal(name, self.training, where)
            if refused:
                self.refusals.append((None, refused))
            self._mark(out, REPLICATED)

    def _mark(self, out, status: str | None) -> None:
        for t in self._tensors(out):
            if status is None:
                self.status.pop(id(t), None)
            else:
                self.status[id(t)] = status
            self.alive.append(t)

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
              flops0: float | None = None) -> dict:
        with self.own():
            return self._begin(name, kind, op, args, kwargs, module, flops0)

    def _begin(self, name, kind, op, args, kwargs, module, flops0) -> dict:
        tensors = self._tensors((args, kwargs))
        reads = tuple(self._read(t) for t in tensors)
        inputs = tuple(dict.fromkeys(r.source for r in reads if r.source >= INPUT))
        record = {
            "name": name, "kind": kind, "op": op, "inputs": inputs, "reads": reads, "module": module,
            "in": [tuple(t.shape) for t in tensors], "in_bytes": _bytes(tensors), "args": _simple_args(args, kwargs),
            "params": tuple(dict.fromkeys(name for r in reads if r.source == PARAM for name in r.params)),
            "flops0": self.counter.get_total_flops() if flops0 is None else flops0, "saved": 0, "functions": set(),
            "spatial_in": bool(tensors) and self.status.get(id(tensors[0])) == PARTITIONED,
        }
        self.current = record
        return record

    def end(self, record: dict, out, flops: float | None = None) -> None:
        with self.own():
            self._end(record, out, flops)

    def _end(self, record: dict, out, flops: float | None) -> None:
        tensors = self._tensors(out)
        record["index"] = len(self.records)
        record["flops"] = self.counter.get_total_flops() - record["flops0"] if flops is None else flops
        record["out"] = tuple(tensors[0].shape) if tensors else ()
        record["outputs"] = len(tensors)
        record["out_bytes"] = _bytes(tensors)
        record["dtype_bytes"] = tensors[0].element_size() if tensors else 4
        self.records.append(record)
        self._produce(out, record["index"])
        self.current = None

    def pack(self, t: torch.Tensor):
        if self.current is None or self.current["kind"] == "attention":  # counted by _attention_saved
            return t
        with self.own():
            base = t._base if t._base is not None else t
            if id(base) not in self.params and id(t) not in self.params and id(base) not in self.saved:
                self.saved.add(id(base))
                self.alive.append(base)
                self.current["saved"] += base.numel() * base.element_size()
        return t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name == "__get__":  # a property (``x.T``, ``x.mT``): by its own name
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if self.quiet:
            return func(*args, **kwargs)
        if self.inside_leaf:
            out = func(*args, **kwargs)
            with self.own():
                if self.current is not None and self._tensors(out):
                    self.current["functions"].add(name)
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
            record["name"] = f"{parent}:{name}#{k}" if parent else f"{name}#{k}"
            if kind == "attention":
                q, key = (list(args) + [kwargs.get("query"), kwargs.get("key")])[:2]
                record["heads"], record["kv_heads"] = q.shape[-3], key.shape[-3]
                record["saved"] = self._attention_saved(args, kwargs, out)
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


def _is_leaf(module: nn.Module) -> bool:
    return isinstance(module, WHOLE_MODULES) or not any(True for _ in module.children())


class _Blocks:
    """Records the calls of the model's blocks: what each receives and returns."""

    def __init__(self, tracer: _Tracer, names: list[str]):
        self.tracer, self.names = tracer, names
        self.order: list[str] = []  # blocks in the order of their first call
        self.calls: list[dict] = []

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
                                           leaf.requires_grad, value))
        if name not in self.order:
            self.order.append(name)
        self.calls.append({"block": name, "args": tuple(block_args), "first": len(t.records)})

    def leave(self, name: str, out) -> None:
        with self.tracer.own():
            self._leave(name, out)

    def _leave(self, name: str, out) -> None:
        t = self.tracer
        call = next(c for c in reversed(self.calls) if c["block"] == name and "output" not in c)
        call["output"] = structure(out)
        call["returns"] = tuple(t.values.setdefault(id(x), len(t.values)) for x in t._tensors(out))
        t.alive.extend(t._tensors(out))
        call["layers"] = (call.pop("first"), len(t.records))


def _install_hooks(model: nn.Module, tracer: _Tracer, calls: _Blocks) -> list:
    handles = []
    paths = {id(m): p for p, m in model.named_modules()}
    inside_whole = set()
    block_names = set(calls.names)
    for path, module in model.named_modules():
        if any(path.startswith(w + ".") for w in inside_whole):
            continue
        if isinstance(module, WHOLE_MODULES):
            inside_whole.add(path)
        leaf = _is_leaf(module)
        converted = leaf and rules.spatial_base(type(module)) is not None
        gathers = converted and rules.spatial_base(type(module)).__name__ in rules.GATHERING_MODULES
        block = path in block_names

        def pre(m, args, kwargs, leaf=leaf, converted=converted, block=block):
            path = paths[id(m)]
            if block:
                calls.enter(path, args, kwargs)
            tracer.module_stack.append(path)
            if leaf:
                if not tracer.inside_leaf:
                    kind = module_kind(m) or "other"
                    calls_so_far = tracer.counts[path] = tracer.counts.get(path, -1) + 1
                    name = path if calls_so_far == 0 else f"{path}#{calls_so_far}"  # a module called again
                    tracer.module_records[id(m)] = tracer.begin(name, kind, type(m).__name__, args, kwargs, m)
                    tracer.module_records[id(m)]["path"] = path
                tracer.inside_leaf += 1
                tracer.converted += converted

        def post(m, args, kwargs, out, leaf=leaf, converted=converted, gathers=gathers, block=block):
            tracer.module_stack.pop()
            if leaf:
                tracer.inside_leaf -= 1
                tracer.converted -= converted
                if converted:
                    status = tracer.status.get(id(args[0])) if args and isinstance(args[0], torch.Tensor) else None
                    tracer._mark(out, REPLICATED if status and (gathers or status == REPLICATED) else status)
                if not tracer.inside_leaf:
                    tracer.end(tracer.module_records.pop(id(m)), out)
            if block:
                calls.leave(paths[id(m)], out)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    return handles


def input_dtype_of(model: nn.Module) -> torch.dtype:
    """The input a model takes by default: token ids (``torch.long``) if its first module is an
    ``nn.Embedding``, else a float volume or sequence of the model's floating dtype."""
    first = next((m for m in model.modules() if not list(m.children())), None)
    if isinstance(first, nn.Embedding):
        return torch.long
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    return param.dtype if param is not None else torch.float32


def analyse(model: nn.Module, input_shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
            input_dtype: torch.dtype | None = None, example: torch.Tensor | None = None) -> ModelGraph:
    """The layer graph of ``model`` for an input of ``input_shape`` (batch first), traced on the meta
    device in training mode, on a copy of the model. ``input_dtype`` defaults to ``dtype`` (give
    ``torch.long`` for token ids); ``example`` (a real tensor of that shape) gives the input's values to a
    forward that branches on them (else zeros)."""
    if not input_shape or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in input_shape):
        raise PlanError(f"input shape {input_shape}: give positive sizes, batch first, e.g. (1, 4, 128, 128, 128)")
    input_dtype = input_dtype or dtype
    values = meta.Values()
    with values:
        copy = meta.meta_copy(model, values, dtype)
        copy.train()
        x = torch.zeros(input_shape, dtype=input_dtype, device="meta")
        if math.prod(input_shape) <= meta.VALUE_LIMIT:
            real = example if example is not None and not example.is_meta else torch.zeros(input_shape, dtype=input_dtype)
            values.set(x, real.detach().to("cpu", input_dtype))
        volume = input_dtype.is_floating_point and len(input_shape) >= 3
        with FlopCounterMode(display=False) as counter:
            tracer = _Tracer(copy, x, counter, volume)
            calls = _Blocks(tracer, [name for name, _ in blocks(copy)])
            handles = _install_hooks(copy, tracer, calls)
            try:
                with saved_tensors_hooks(tracer.pack, lambda t: t), tracer:
                    out = copy(x)
            except HybridparError:
                raise
            except meta.DataDependentError as err:
                where = tracer.module_stack[-1] if tracer.module_stack else "<root>"
                raise PlanError(f"the forward of {where!r} branches on a value computed from the weights ({err}); "
                                "hybridpar analyses a model without its weights: compute that branch from the "
                                "input or the configuration instead") from None
            except Exception as err:  # a model that does not run on this input: say which input
                raise PlanError(f"the model does not run on an input of shape {tuple(input_shape)} and dtype "
                                f"{str(input_dtype).removeprefix('torch.')} ({type(err).__name__}: {err}); give the "
                                "shape (and dtype: --input-dtype, or an example tensor) the model's forward "
                                "expects, batch first") from None
            finally:
                for h in handles:
                    h.remove()
    return _graph(copy, tracer, calls, tuple(input_shape), x, out)


def _graph(model: nn.Module, tracer: _Tracer, calls: _Blocks, input_shape, x, out) -> ModelGraph:
    layers = [_layer(r) for r in tracer.records]
    shared = _shared(model, layers)
    names = {name for group in shared for name in group}
    runs: dict[str, int] = {}
    for layer in layers:
        if layer.path:
            runs[layer.path] = runs.get(layer.path, 0) + 1
    layers = [dataclasses.replace(layer, shared=bool(names & set(layer.params)), repeated=runs.get(layer.path, 0) > 1)
              for layer in layers]
    consumers = [[] for _ in layers]
    for layer in layers:
        for p in layer.inputs:
            if p != INPUT:
                consumers[p].append(layer.index)
    params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    order = calls.order + [n for n in calls.names if n not in calls.order]
    index = {name: i for i, name in enumerate(order)}
    block_calls = tuple(BlockCall(index[c["block"]], c["args"], c["output"], c["layers"], c["returns"])
                        for c in calls.calls if "output" in c)
    return ModelGraph(tuple(layers), input_shape, x.numel() * x.element_size(), param_bytes, params,
                      tuple(tuple(c) for c in consumers), type(model).__name__, tuple(order), block_calls,
                      shared, str(x.dtype).removeprefix("torch."),
                      tuple(dict.fromkeys(tracer.refusals)),
                      outputs=tuple(dict.fromkeys(tracer.info[id(t)][0] for t in tracer._tensors(out)
                                                  if id(t) in tracer.info)),
                      unused=_unused(model, layers),
                      output_values=tuple(tracer.values[id(t)] for t in tracer._tensors(out) if id(t) in tracer.values))


def _shared(model: nn.Module, layers: list[Layer]) -> tuple[tuple[str, ...], ...]:
    """Names of each parameter registered under several names or used by several layers."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    tensor = {name: key for key, group in names.items() for name in group}
    users: dict[int, int] = {}
    for layer in layers:
        for key in {tensor[name] for name in layer.params if name in tensor}:
            users[key] = users.get(key, 0) + 1
    return tuple(tuple(group) for key, group in names.items() if len(group) > 1 or users.get(key, 0) > 1)


def _unused(model: nn.Module, layers: list[Layer]) -> tuple[str, ...]:
    """Parameters (first names) that no layer uses: a module the forward never calls."""
    used = {name for layer in layers for name in layer.params}
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return tuple(names[0] for names in groups.values() if not used & set(names))


CONTAINERS = (nn.Sequential, nn.ModuleList)


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's blocks, ``(name, module)`` in the order they are registered: its top-level children, with an
    ``nn.Sequential`` or ``nn.ModuleList`` child expanded into its entries, and a child that holds an
    ``nn.ModuleList`` (a trunk: a Hugging Face ``model.model``, ``transformer``) expanded into its own blocks;
    a module registered twice counts once, under its first name (as ``named_modules`` names it). A model
    pipelines if its forward calls these one after another (``ModelGraph.blocks`` has the order of the
    calls)."""
    out, seen = [], set()
    for name, child in _block_candidates(model):
        if id(child) not in seen:
            seen.add(id(child))
            out.append((name, child))
    return out


def _block_candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    out = []
    for name, child in model.named_children():
        if isinstance(child, CONTAINERS):
            out.extend((f"{name}.{n}", c) for n, c in child.named_children())
        elif any(type(c) is nn.ModuleList for c in child.children()):
            out.extend((f"{name}.{n}", c) for n, c in _block_candidates(child))
        else:
            out.append((name, child))
    return out


def _layer(r: dict) -> Layer:
    module = r["module"]
    kind = r["kind"]
    params = list(module.parameters()) if module is not None else []
    if kind == "other" and module is not None and _elementwise(module, r["functions"], params):
        kind = "pointwise"
    names = r["params"]
    if module is not None:
        names = tuple(f"{r['path']}.{n}" for n, _ in module.named_parameters())
    extra = _module_features(module, len(r["out"]) - 2) if module is not None else {}
    if kind == "attention" and "heads" in r:
        extra.update(heads=r["heads"], kv_heads=r["kv_heads"])
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    return Layer(
        index=r["index"], name=r["name"], kind=kind, op=r["op"], inputs=r["inputs"],
        in_shape=r["in"][0] if r["in"] else (), out_shape=r["out"], dtype_bytes=r["dtype_bytes"],
        flops=float(r["flops"]), bytes_moved=float(r["in_bytes"] + r["out_bytes"] + param_bytes),
        out_bytes=r["out_bytes"], saved_bytes=r["saved"], param_bytes=param_bytes,
        num_params=sum(p.numel() for p in params), spatial_in=r["spatial_in"],
        has_weight=any(p.requires_grad for p in params), reads=r["reads"], args=r["args"], params=names,
        exact=module is not None and type(module) in SPLITTABLE_TYPES, outputs=r["outputs"],
        path=r.get("path", ""), **extra,
    )


def _elementwise(module: nn.Module, functions: set, params: list) -> bool:
    """A module that works value by value (an activation, dropout, identity): every function it calls is
    pointwise, and any parameter it has is one value (PReLU's). Softmax, GLU or a per-channel PReLU are not."""
    if isinstance(module, (nn.Dropout, nn.Identity)):
        return True
    return bool(functions) and functions <= rules.POINTWISE and all(p.numel() == 1 for p in params)


def _module_features(module: nn.Module, num_spatial: int) -> dict:
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        n = len(module.kernel_size)
        pads = module._reversed_padding_repeated_twice
        windows = tuple(Window(module.kernel_size[i], module.stride[i], pads[2 * (n - 1 - i)], module.dilation[i])
                        for i in range(n))
        return {"windows": windows, "boundary": module.padding_mode,
                "channels": (module.in_channels, module.out_channels), "groups": module.groups}
    if isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return {"channels": (module.in_channels, module.out_channels), "groups": module.groups}
    if isinstance(module, (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)):
        k, s, p = (_per_dim(v, num_spatial) for v in (module.kernel_size, module.stride or module.kernel_size,
                                                      module.padding))
        d = _per_dim(getattr(module, "dilation", 1), num_spatial)
        return {"windows": tuple(Window(k[i], s[i], p[i], d[i]) for i in range(num_spatial))}
    if isinstance(module, nn.Linear):
        return {"channels": (module.in_features, module.out_features)}
    if isinstance(module, nn.Embedding):
        return {"channels": (module.num_embeddings, module.embedding_dim)}
    if isinstance(module, nn.MultiheadAttention):
        return {"heads": module.num_heads, "kv_heads": module.num_heads,
                "channels": (module.embed_dim, module.embed_dim)}
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        return {"channels": (module.num_features, module.num_features)}
    return {}


def _per_dim(value, n: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


__all__ = ["CONST", "INPUT", "PARAM", "BlockArg", "BlockCall", "Layer", "ModelGraph", "Read", "analyse", "blocks",
           "module_kind", "structure"]

"""Model analysis: one forward pass on the meta device gives the planner its layer graph.

A *layer* is a leaf module (``Conv3d``, ``Linear``, ``LayerNorm``, ...) or a tensor operation called
between modules (the residual ``add``, ``scaled_dot_product_attention``, ``cat``). Views (``view``,
``transpose``, ``split``, ...) are not layers: their outputs count as the tensor they view. For each
layer the trace records, for the example batch:

- forward FLOPs (PyTorch's ``FlopCounterMode``; attention counted here as ``4·B·H·Lq·Lk·E``, since
  the counter misses the fused kernels of some backends) and the bytes the forward reads and writes;
- bytes of its output, of what autograd saves for backward (``saved_tensors_hooks``; a tensor saved
  twice counts once, parameters not at all) and of its parameters;
- its sliding windows (kernel, stride, padding, dilation per spatial dim), whence its halo widths;
- the layers whose outputs it reads, so the planner sees skip connections and legal pipeline cuts.

Nothing is allocated: parameters and activations live on the meta device, so CosmoFlow at 512³ or a
175B-parameter GPT analyse in seconds on a laptop.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from hybridpar.errors import PlanError
from hybridpar.spatial.geometry import Window

INPUT = -1  # producer index of the model input

ALIASES = frozenset(
    """view view_as reshape reshape_as transpose permute split split_with_sizes chunk unbind contiguous
    flatten unflatten squeeze unsqueeze expand expand_as __getitem__ t narrow select to type float double
    half bfloat16 detach clone""".split()
)
POINTWISE = frozenset(
    """add sub mul div true_divide neg pow rsub abs sqrt rsqrt exp log log1p expm1 square clamp clip
    maximum minimum where sigmoid tanh relu relu6 leaky_relu elu selu celu gelu silu mish softplus
    hardtanh hardswish hardsigmoid erf sin cos dropout alpha_dropout feature_alpha_dropout
    __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__
    __rtruediv__ __itruediv__ __neg__ __pow__ __rpow__ add_ mul_ relu_ leaky_relu_ sigmoid_ tanh_""".split()
)
ATTENTION_FUNCTIONS = frozenset({"scaled_dot_product_attention"})

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


@dataclass(frozen=True)
class Layer:
    """One layer of the traced model, for the example batch (``batch`` samples)."""

    index: int
    name: str  # module path ("features.0") or "<parent path>:<function>#k" for a tensor operation
    kind: str  # conv, conv_transpose, pool, global_pool, batch_norm, group_norm, layer_norm, linear,
    #            embedding, flatten, upsample, attention, pointwise, cat, other
    op: str  # the module's class or the function's name
    inputs: tuple[int, ...]  # producer layer of each tensor read (INPUT: the model input)
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
    heads: int = 0  # attention heads
    spatial_in: bool = False  # its first input is an (N, C, *spatial) volume that may be split in slabs
    has_weight: bool = False

    @cached_property
    def signature(self) -> tuple:
        """Everything that prices the layer: equal for the repeated blocks of a network."""
        return (self.kind, self.op, self.in_shape, self.out_shape, self.dtype_bytes, self.flops, self.bytes_moved,
                self.out_bytes, self.saved_bytes, self.param_bytes, self.windows, self.boundary, self.channels,
                self.heads, self.spatial_in, self.has_weight, self.inputs == (self.index - 1,),
                self.inputs == () or all(p == INPUT for p in self.inputs))

    @property
    def is_module(self) -> bool:
        """Whether the layer is a module (its name a module path), not an operation called in a forward
        (``'add#0'``, ``'blocks.0.attn:scaled_dot_product_attention#0'``)."""
        return ":" not in self.name and "#" not in self.name

    @property
    def owner(self) -> str:
        """The path of the module the layer runs in: its own, or that of the module whose forward calls the
        operation (``''``: the model's own forward)."""
        if self.is_module:
            return self.name
        return self.name.partition(":")[0] if ":" in self.name else ""

    @property
    def halo(self) -> tuple[tuple[int, int], ...]:
        """Rows below and above each output slab that a window reads beyond the slab's own input rows
        (for a stride-1 window: the padding on each side)."""
        return tuple(_halo(w) for w in self.windows)


def _halo(w: Window) -> tuple[int, int]:
    reach = w.dilation * (w.kernel - 1)
    return (w.pad_left, max(0, reach - w.pad_left - (w.stride - 1)))


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
    blocks: tuple[str, ...] = ()  # the model's top-level sequence of blocks (see ``blocks``); () if unknown

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
    def forced_replicated(self) -> frozenset[int]:
        """Layers whose output must be whole over tp: read by another layer than the next, or none (the output)."""
        return frozenset(i for i in range(len(self.layers)) if self.consumers[i] != (i + 1,))

    @cached_property
    def isotropic(self) -> bool:
        """Every spatial dim alike (a cubic input, windows the same along each dim): permuting a spatial
        grid changes no cost."""
        if self.spatial_ndim < 2 or len(set(self.input_shape[2:])) != 1:
            return False
        return all(len(set(layer.windows)) <= 1 and len(set(layer.out_shape[2:])) <= 1
                   for layer in self.layers if layer.spatial_in)

    @cached_property
    def segments(self) -> tuple[tuple[int, int, int], ...]:
        """``(first, stop, kind)`` of the runs of layers that end at a whole (``forced_replicated``) output;
        runs of the same layer signatures share a ``kind`` (the blocks of a GPT)."""
        kinds: dict[tuple, int] = {}
        out, start = [], 0
        for end in sorted(self.forced_replicated):
            key = tuple(layer.signature for layer in self.layers[start : end + 1])
            out.append((start, end + 1, kinds.setdefault(key, len(kinds))))
            start = end + 1
        return tuple(out)

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
    def unordered_layer(self) -> Layer | None:
        """The first layer that runs outside the blocks or out of their order (then the model cannot be cut
        into pipeline stages), or ``None``."""
        latest = -1
        for layer, block in zip(self.layers, self.block_index):
            if block is None or block < latest:
                return layer
            latest = block
        return None

    @cached_property
    def stage_starts(self) -> tuple[int, ...]:
        """Layers a pipeline stage can start at (after the first): the first layer of a block, where exactly
        one tensor crosses. A graph without ``blocks`` (built by hand) allows every cut point."""
        if not self.blocks:
            return tuple(i + 1 for i in self.cut_points)
        if self.unordered_layer is not None:
            return ()
        cuts = set(self.cut_points)
        return tuple(i for i in range(1, len(self.layers))
                     if self.block_index[i] != self.block_index[i - 1] and i - 1 in cuts)

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


class _Tracer(TorchFunctionMode):
    """Records leaf modules and the tensor operations between them as layers."""

    def __init__(self, model: nn.Module, x: torch.Tensor, counter: FlopCounterMode):
        super().__init__()
        self.counter = counter
        self.producer: dict[int, int] = {id(x): INPUT}
        self.alive: list[torch.Tensor] = [x]
        self.records: list[dict] = []
        self.module_stack: list[str] = []
        self.inside_leaf = 0
        self.current: dict | None = None
        self.saved: set[int] = set()
        self.params = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}
        self.counts: dict[str, int] = {}
        self.quiet = 0  # our own bookkeeping (numel, shapes) is not the model's

    # --- tensors ---------------------------------------------------------------------------------
    def _tensors(self, obj) -> list[torch.Tensor]:
        return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]

    def _producers(self, args) -> tuple[int, ...]:
        seen = []
        for t in self._tensors(args):
            p = self.producer.get(id(t))
            if p is not None and p not in seen:
                seen.append(p)
        return tuple(seen)

    def _produce(self, out, index: int) -> None:
        for t in self._tensors(out):
            self.producer[id(t)] = index
            self.alive.append(t)

    # --- layers ---------------------------------------------------------------------------------
    def begin(self, name: str, kind: str, op: str, args, module: nn.Module | None = None,
              flops0: float | None = None) -> dict:
        self.quiet += 1
        tensors = self._tensors(args)
        record = {
            "name": name, "kind": kind, "op": op, "inputs": self._producers(args), "module": module,
            "in": [tuple(t.shape) for t in tensors], "in_bytes": _bytes(tensors),
            "flops0": self.counter.get_total_flops() if flops0 is None else flops0, "saved": 0, "functions": set(),
        }
        self.current = record
        self.quiet -= 1
        return record

    def end(self, record: dict, out, flops: float | None = None) -> None:
        self.quiet += 1
        tensors = self._tensors(out)
        record["index"] = len(self.records)
        record["flops"] = self.counter.get_total_flops() - record["flops0"] if flops is None else flops
        record["out"] = tuple(tensors[0].shape) if tensors else ()
        record["out_bytes"] = _bytes(tensors)
        record["dtype_bytes"] = tensors[0].element_size() if tensors else 4
        self.records.append(record)
        self._produce(out, record["index"])
        self.current = None
        self.quiet -= 1

    def pack(self, t: torch.Tensor):
        if self.current is None or self.current["kind"] == "attention":  # counted by _attention_saved
            return t
        self.quiet += 1
        base = t._base if t._base is not None else t
        if id(base) not in self.params and id(t) not in self.params and id(base) not in self.saved:
            self.saved.add(id(base))
            self.alive.append(base)
            self.current["saved"] += base.numel() * base.element_size()
        self.quiet -= 1
        return t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if self.quiet:
            return func(*args, **kwargs)
        if self.inside_leaf:
            out = func(*args, **kwargs)
            if self.current is not None and self._tensors(out):
                self.current["functions"].add(name)
            return out
        producers = self._producers((args, kwargs))
        if not producers:
            return func(*args, **kwargs)
        if name in ALIASES or name == "__get__":
            out = func(*args, **kwargs)
            self._produce(out, producers[0])
            return out
        flops0 = self.counter.get_total_flops()
        kind = "attention" if name in ATTENTION_FUNCTIONS else (
            "pointwise" if name in POINTWISE else "cat" if name in ("cat", "concat", "concatenate") else "other")
        record = self.begin("", kind, name, (args, kwargs), flops0=flops0)
        out = func(*args, **kwargs)
        if not self._tensors(out):
            self.current = None
            return out
        parent = self.module_stack[-1] if self.module_stack else ""
        k = self.counts[f"{parent}:{name}"] = self.counts.get(f"{parent}:{name}", -1) + 1
        record["name"] = f"{parent}:{name}#{k}" if parent else f"{name}#{k}"
        if kind == "attention":
            record["heads"] = args[0].shape[1]
            record["saved"] = self._attention_saved(args, kwargs, out)
        self.end(record, out, _attention_flops(args, kwargs) if kind == "attention" else None)
        return out

    def _attention_saved(self, args, kwargs, out) -> int:
        """What fused attention (flash, memory-efficient; CPU and GPU) keeps: q, k, v, the output and the
        log-sum-exp per query row, not the ``Lq x Lk`` matrix of the math path that the meta device runs."""
        self.quiet += 1
        total = 0
        for t in self._tensors((args[:3], kwargs)) + self._tensors(out):
            base = t._base if t._base is not None else t
            if id(base) not in self.saved:
                self.saved.add(id(base))
                self.alive.append(base)
                total += base.numel() * base.element_size()
        q = args[0]
        total += q.numel() // q.shape[-1] * 4
        self.quiet -= 1
        return total


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _attention_flops(args, kwargs) -> float:
    q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")])[:3]
    *batch, lq, e = q.shape
    lk, ev = k.shape[-2], v.shape[-1]
    return 2.0 * math.prod(batch) * lq * lk * (e + ev)  # Q·Kᵀ and P·V; causal masks are not discounted


def module_kind(module: nn.Module) -> str | None:
    for classes, kind in MODULE_KINDS:
        if isinstance(module, classes):
            return kind
    return None


def _is_leaf(module: nn.Module) -> bool:
    return isinstance(module, WHOLE_MODULES) or not any(True for _ in module.children())


def _install_hooks(model: nn.Module, tracer: _Tracer) -> list:
    handles = []
    paths = {id(m): p for p, m in model.named_modules()}
    inside_whole = set()
    for path, module in model.named_modules():
        if any(path.startswith(w + ".") for w in inside_whole):
            continue
        if isinstance(module, WHOLE_MODULES):
            inside_whole.add(path)
        leaf = _is_leaf(module)

        def pre(m, args, kwargs, leaf=leaf):
            tracer.module_stack.append(paths[id(m)])
            if leaf:
                if not tracer.inside_leaf:
                    kind = module_kind(m) or "other"
                    path = paths[id(m)]
                    calls = tracer.counts[path] = tracer.counts.get(path, -1) + 1
                    name = path if calls == 0 else f"{path}#{calls}"  # a module called again (a shared pool)
                    m._hp_record = tracer.begin(name, kind, type(m).__name__, (args, kwargs), m)
                tracer.inside_leaf += 1

        def post(m, args, kwargs, out, leaf=leaf):
            tracer.module_stack.pop()
            if leaf:
                tracer.inside_leaf -= 1
                if not tracer.inside_leaf:
                    tracer.end(m.__dict__.pop("_hp_record"), out)

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    return handles


def _meta_model(model: nn.Module) -> nn.Module:
    """``model`` itself if it already lives on the meta device, else a meta copy (no memory)."""
    tensors = list(model.parameters()) + list(model.buffers())
    if all(t.is_meta for t in tensors):
        return model
    memo = {}
    for t in tensors:
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def analyse(model: nn.Module, input_shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
            input_dtype: torch.dtype | None = None) -> ModelGraph:
    """The layer graph of ``model`` for an input of ``input_shape`` (batch first), traced on the meta
    device in training mode. ``input_dtype`` defaults to ``dtype`` (give ``torch.long`` for token ids)."""
    if not input_shape or any(not isinstance(n, int) or n < 1 for n in input_shape):
        raise PlanError(f"input shape {input_shape}: give positive sizes, batch first, e.g. (1, 4, 128, 128, 128)")
    meta = _meta_model(model).to(dtype)
    meta.train()
    x = _example(input_shape, input_dtype or dtype)
    with FlopCounterMode(display=False) as counter:
        tracer = _Tracer(meta, x, counter)
        handles = _install_hooks(meta, tracer)
        try:
            with saved_tensors_hooks(tracer.pack, lambda t: t), tracer:
                meta(x)
        except PlanError:
            raise
        except Exception as err:  # a model that does not run on this input: say which input
            raise PlanError(f"the model does not run on an input of shape {tuple(input_shape)} ({type(err).__name__}: "
                            f"{err}); give the shape the model's forward expects, batch first") from None
        finally:
            for h in handles:
                h.remove()
    return _graph(meta, tracer, tuple(input_shape), x)


def _example(shape, dtype) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.empty(shape, dtype=dtype, device="meta")
    return torch.zeros(shape, dtype=dtype, device="meta")


def _graph(model: nn.Module, tracer: _Tracer, input_shape, x) -> ModelGraph:
    spatial_input = x.is_floating_point() and x.dim() >= 3
    spatial_producers = {INPUT} if spatial_input else set()
    layers = []
    for r in tracer.records:
        layer = _layer(r, spatial_producers)
        if layer.spatial_in and layer.kind not in ("global_pool", "flatten") and len(layer.out_shape) == x.dim():
            spatial_producers.add(layer.index)
        layers.append(layer)
    consumers = [[] for _ in layers]
    for layer in layers:
        for p in layer.inputs:
            if p != INPUT:
                consumers[p].append(layer.index)
    params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return ModelGraph(tuple(layers), input_shape, x.numel() * x.element_size(), param_bytes, params,
                      tuple(tuple(c) for c in consumers), type(model).__name__,
                      tuple(name for name, _ in blocks(model)))


CONTAINERS = (nn.Sequential, nn.ModuleList)


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's top-level sequence of blocks: ``(name, module)`` of each top-level child, with an
    ``nn.Sequential`` or ``nn.ModuleList`` child expanded into its entries. A model pipelines if its forward
    applies these one after another, each to the output of the one before."""
    out = []
    for name, child in model.named_children():
        if isinstance(child, CONTAINERS):
            out.extend((f"{name}.{n}", c) for n, c in child.named_children())
        else:
            out.append((name, child))
    return out


def _layer(r: dict, spatial_producers: set[int]) -> Layer:
    module = r["module"]
    kind = r["kind"]
    if kind == "other" and module is not None and r["functions"] and r["functions"] <= POINTWISE | ALIASES:
        kind = "pointwise"
    if kind == "other" and module is not None and (
            isinstance(module, (nn.Dropout, nn.Identity)) or type(module).__module__ == "torch.nn.modules.activation"):
        kind = "pointwise"
    params = list(module.parameters()) if module is not None else []
    extra = _module_features(module, len(r["out"]) - 2) if module is not None else {}
    if kind == "attention" and "heads" in r:
        extra["heads"] = r["heads"]
    return Layer(
        index=r["index"], name=r["name"], kind=kind, op=r["op"], inputs=r["inputs"],
        in_shape=r["in"][0] if r["in"] else (), out_shape=r["out"], dtype_bytes=r["dtype_bytes"],
        flops=float(r["flops"]), bytes_moved=float(r["in_bytes"] + r["out_bytes"] + sum(
            p.numel() * p.element_size() for p in params)),
        out_bytes=r["out_bytes"], saved_bytes=r["saved"],
        param_bytes=sum(p.numel() * p.element_size() for p in params), num_params=sum(p.numel() for p in params),
        spatial_in=bool(r["inputs"]) and r["inputs"][0] in spatial_producers,
        has_weight=any(p.requires_grad for p in params), **extra,
    )


def _module_features(module: nn.Module, num_spatial: int) -> dict:
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        n = len(module.kernel_size)
        pads = module._reversed_padding_repeated_twice
        windows = tuple(Window(module.kernel_size[i], module.stride[i], pads[2 * (n - 1 - i)], module.dilation[i])
                        for i in range(n))
        return {"windows": windows, "boundary": module.padding_mode,
                "channels": (module.in_channels, module.out_channels)}
    if isinstance(module, (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)):
        return {"channels": (module.in_channels, module.out_channels)}
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
        return {"heads": module.num_heads, "channels": (module.embed_dim, module.embed_dim)}
    if isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)):
        return {"channels": (module.num_features, module.num_features)}
    return {}


def _per_dim(value, n: int) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


__all__ = ["INPUT", "Layer", "ModelGraph", "analyse", "module_kind"]

"""The model graph: what one forward of a model does, as the planner and the runtime read it (pure records).

A *layer* is a leaf module (``Conv3d``, ``Linear``, ``LayerNorm``, ...) or a tensor operation called between
modules (the residual ``add``, ``scaled_dot_product_attention``, ``cat``), with its costs for the example batch,
every tensor it reads (``Read``: which layer made it, and where each of its dims comes from) and its sliding
windows. The graph also holds the model's blocks and their calls (the interfaces of pipeline stages), the
parameters that are shared, and what the spatial runtime would refuse. ``hybridpar.ir.analysis`` builds it
from a model on the meta device; the planner reads it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from hybridpar.errors import PlanError
from hybridpar.geometry import Window
from hybridpar.ir import rules
from hybridpar.ir.sources import CONST, INPUT, PARAM


@dataclass(frozen=True)
class View:
    """One view on the way from a layer's output to a reader (``Read.views``): the function, its input and output
    shapes for the example batch, ``where[j]`` the input dim whose whole blocks output dim ``j`` holds (``None``:
    none), the sizes it was given literally (``view(b, -1, 4, 8)``: ``(b, -1, 4, 8)``; ``None`` for a view that
    takes no sizes, as ``transpose``) and the module whose forward called it."""

    op: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    where: tuple[int | None, ...]
    sizes: tuple[int, ...] | None
    module: str


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
    views: tuple[View, ...] = ()  # the views from the source's output to this tensor, in order


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
    args: tuple[tuple, ...] = field(default=(), compare=False)  # other arguments: ((position or name, value), ...)
    params: tuple[str, ...] = field(default=(), compare=False)  # names of the parameters it uses
    exact: bool = False  # a module of exactly one of the torch.nn types tensor parallelism splits
    groups: int = 1  # of a conv
    outputs: int = 1  # tensors it returns
    shared: bool = False  # uses a parameter that is shared (ModelGraph.shared)
    path: str = ""  # the module's path, for a layer that is a module ("" for an operation)
    repeated: bool = False  # a module the forward calls more than once (its later calls are "path#k")
    inplace: bool = False  # writes into a tensor it reads (``relu_``, ``x += y``, ``nn.ReLU(inplace=True)``)

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
    partitioned: bool = False  # a volume split in slabs under spatial parallelism (what a rank holds is its slab)
    from_input: bool = False  # computed from the model input: its dim 0 is the batch where it has the batch's size


@dataclass(frozen=True)
class BlockCall:
    """One call of a block (``ModelGraph.blocks[block]``): what it is passed and what it returns. ``output`` is
    the returned structure (``structure``); ``layers`` the range of layer indices the call ran."""

    block: int
    args: tuple[BlockArg, ...]
    output: tuple
    layers: tuple[int, int]
    returns: tuple[int, ...] = ()  # the values (``BlockArg.value``) of the tensors it returns
    leaves: int = 0  # everything it is passed, flattened: its tensors and the rest (flags, None, sizes)


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
    unused: tuple[str, ...] = ()  # parameters that get no gradient from the output a loss reads (for the example)
    output_values: tuple[int, ...] = ()  # their values (``BlockArg.value``), where a block returned them
    state: tuple[str, ...] = ()  # the model's state-dict names (parameters and buffers), as ``state_dict`` gives them
    output: tuple = ()  # (shape, dtype, requires_grad, partitioned, from the input) of the tensor a loss reads

    def at_batch(self, batch: int) -> ModelGraph:
        """The graph's pipeline interfaces for a batch of ``batch`` samples (a micro-batch), without tracing again:
        the model input, what its blocks are passed and return and the output it gives, each with its batch dim
        (dim 0, where a tensor computed from the input has the example's batch there; PyTorch's pipelining splits
        micro-batches along it too) resized; a tensor the forward makes without the input (a table of positions)
        keeps its shape. Its layers keep the example's costs (the planner scales those)."""
        if batch == self.batch:
            return self
        example = self.batch

        def resized(shape: tuple[int, ...], from_input: bool) -> tuple[int, ...]:
            return (batch,) + tuple(shape[1:]) if from_input and shape and shape[0] == example else shape

        def structure(item: tuple) -> tuple:
            kind, rest = item[0], item[1:]
            if kind == "tensor":
                return (kind, resized(rest[0], rest[3])) + tuple(rest[1:])
            if kind in ("tuple", "list"):
                return (kind, tuple(structure(x) for x in rest[0]))
            if kind == "dict":
                return (kind, tuple((k, structure(v)) for k, v in rest[0]))
            return item

        calls = tuple(replace(call, output=structure(call.output), args=tuple(
            replace(a, shape=resized(a.shape, a.from_input)) for a in call.args)) for call in self.block_calls)
        output = (resized(self.output[0], self.output[4]),) + tuple(self.output[1:]) if self.output else ()
        return replace(self, input_shape=resized(self.input_shape, True), block_calls=calls, output=output,
                       input_bytes=self.input_bytes * batch // example)

    def with_shapes(self, shapes: dict[int, tuple[int, ...]]) -> ModelGraph:
        """The graph with the values ``shapes`` (``BlockArg.value``: shape) passed to its blocks in those shapes: what
        a run of the pipeline stages found they exchange (a value made from the batch's size, not computed from the
        input, which ``at_batch`` cannot tell from a table of positions)."""
        calls = tuple(replace(call, args=tuple(replace(a, shape=shapes.get(a.value, a.shape)) for a in call.args))
                      for call in self.block_calls)
        return replace(self, block_calls=calls)

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
        """Layers a pipeline stage can start at (after the first): the first layer of a block, other than the first
        block the forward calls, where the model can be cut (``rules.stage_cut_refusal``). A graph without
        ``blocks`` (built by hand) allows every cut point."""
        if not self.blocks:
            return tuple(i + 1 for i in self.cut_points)
        return tuple(first for b, first in self.block_starts.items()
                     if first > 0 and b > 0 and rules.stage_cut_refusal(self, b) is None)

    @cached_property
    def is_chain(self) -> bool:
        """Whether the forward is its blocks applied one after another, each to what the one before returned (the
        first to the model input) and to nothing else, and returns what the last one returns, with nothing between
        them: then a pipeline stage takes the previous stage's output as its input, and skipped blocks pass it on.
        A block passed anything besides (a flag, a size the model's code read off its input: BEiT's resolution) is
        not in a chain: the stage runs the model's code on the model's input, as the general stage does."""
        calls = self.block_calls
        if not calls or any(b is None for b in self.block_index):
            return False
        previous = None
        for call in calls:
            tensors = [a for a in call.args if a.source not in (PARAM, CONST)]
            if len(tensors) != 1 or len(call.returns) != 1 or call.leaves != 1:
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


__all__ = ["CONST", "INPUT", "PARAM", "BlockArg", "BlockCall", "Layer", "ModelGraph", "Read", "View"]

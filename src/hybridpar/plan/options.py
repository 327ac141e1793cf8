"""Per-layer costs of one mesh choice: what each layer costs on one device for each tp strategy.

For a spatial grid, a tp degree and a micro-batch size, ``layer_options`` lists every way to run each layer
that the rules allow it by itself (``rules.tp_refusal``) with its time (forward + backward, its own
communication included) and memory; the tp layout of its output is ``R`` (whole on every tp rank), ``S``
(features / channels / heads split) or ``P`` (partial sums, after a row split, summed by the row layer).
``redistribution`` prices the layout changes the runtime makes at a layer: a column layer's gather, a row
layer's sum and the slice of a whole input. Everything is per device and per micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from hybridpar.geometry import split_bounds
from hybridpar.ir import rules
from hybridpar.ir.graph import INPUT, Layer, ModelGraph
from hybridpar.plan import cost
from hybridpar.plan.cluster import ClusterSpec

R, S, P = "R", "S", "P"
LAYOUTS = {"replicate": R, "column": S, "row": P, "shard": S}  # the layout each strategy leaves
# A spatially split normalisation runs as separate ops: forward sum, x - mean, its square, the square's sum,
# the scaling (5 reads + 3 writes: 4x the fused layer's read + write), backward about twice that.
SPATIAL_NORM_PASSES = (4, 8)


@dataclass(frozen=True)
class Option:
    strategy: str  # replicate, column, row, shard
    layout_out: str  # of its output: R whole, S split, P partial sums (a row layer's, which it sums)
    time: float  # forward + backward of one micro-batch, own communication included
    forward: float  # forward compute (what checkpointing recomputes)
    comm: dict  # exposed seconds by kind
    params: float  # parameter bytes on this device (before ZeRO sharding)
    saved: float  # activation bytes kept for backward, per micro-batch
    workspace: float  # transient bytes while the layer runs
    out_bytes: float  # output bytes on this device in layout R
    in_bytes: float  # bytes of the (first) input on this device in layout R


@dataclass(frozen=True)
class MeshContext:
    """What the per-layer costs depend on besides the layer."""

    cluster: ClusterSpec = field(compare=False)  # one per search: left out of the hash
    dtype: str
    grid: tuple[int, ...]
    tp: int
    micro_batch: int
    spatial_group: cost.Group
    tp_group: cost.Group
    norm_group: cost.Group
    overlap: bool
    sequence_parallel: bool = False  # replicated token-wise layers run on 1/tp of the tokens
    sharded: bool = False  # FSDP / ZeRO shards the parameters over dp x spatial > 1 ranks (no channel-split convs)

    def __hash__(self) -> int:  # a cache key of the search, hashed thousands of times: once per context
        if "_hash" not in self.__dict__:
            fields = (self.dtype, self.grid, self.tp, self.micro_batch, self.spatial_group, self.tp_group,
                      self.norm_group, self.overlap, self.sequence_parallel, self.sharded)
            self.__dict__["_hash"] = hash(fields)
        return self.__dict__["_hash"]


@lru_cache(maxsize=65536)
def _halo_rows(layer: Layer, grid: tuple[int, ...]) -> tuple[int, ...]:
    """Rows the worst part receives along each split dim of a windowed layer."""
    rows = []
    for axis, window in enumerate(layer.windows):
        parts = grid[axis]
        if parts == 1:
            rows.append(0)
            continue
        size, m = layer.in_shape[2 + axis], layer.out_shape[2 + axis]
        bounds_in, worst = split_bounds(size, parts), 0
        for (lo, hi), b in zip(bounds_in, split_bounds(m, parts)):
            start, stop = window.need(*b)
            worst = max(worst, max(0, lo - max(start, 0)) + max(0, min(stop, size) - hi))
        rows.append(worst)
    return tuple(rows)


@lru_cache(maxsize=65536)
def slab_fraction(shape: tuple[int, ...], grid: tuple[int, ...]) -> float:
    """The largest slab's share of an ``(N, C, *spatial)`` volume split by ``grid``."""
    return math.prod(-(-n // p) / n for n, p in zip(shape[2:], grid))


def _spatial(layer: Layer, ctx: MeshContext) -> tuple[float, tuple[float, ...]]:
    """(fraction of the layer this device computes, halo bytes per sample received along each spatial dim)."""
    if not layer.spatial_in or math.prod(ctx.grid) == 1:
        return 1.0, ()
    fraction = slab_fraction(layer.in_shape if layer.kind in ("global_pool", "flatten") else layer.out_shape,
                             ctx.grid)
    if not layer.windows:
        return fraction, ()
    local_in = [-(-n // p) for n, p in zip(layer.in_shape[2:], ctx.grid)]
    channels = layer.in_shape[1]
    halos = tuple(rows * math.prod(n for a, n in enumerate(local_in) if a != axis) * channels * layer.dtype_bytes
                  for axis, rows in enumerate(_halo_rows(layer, ctx.grid)))
    return fraction, halos


def layer_options(layer: Layer, graph: ModelGraph, ctx: MeshContext) -> tuple[Option, ...]:
    """Every way to run ``layer`` on this mesh that the rules allow it by itself (replicate alone when tp is 1)."""
    scale = ctx.micro_batch / graph.batch
    fraction, halo_per_sample = _spatial(layer, ctx)
    return tuple(_option(layer, ctx, s, scale, fraction, halo_per_sample) for s in strategies(layer, ctx))


def strategies(layer: Layer, ctx: MeshContext) -> tuple[str, ...]:
    """The tp strategies ``layer`` may take on this mesh (``rules.tp_refusal``)."""
    if ctx.tp == 1:
        return ("replicate",)
    spatial = math.prod(ctx.grid) > 1
    return tuple(s for s in rules.TP_STRATEGIES
                 if rules.tp_refusal(layer, s, ctx.tp, spatial=spatial, sharded=ctx.sharded) is None)


def _option(layer: Layer, ctx: MeshContext, name: str, scale: float, fraction: float,
            halo_per_sample: tuple[float, ...]) -> Option:
    lout = LAYOUTS[name]
    on_tokens = ctx.sequence_parallel and name == "replicate" and layer.kind in rules.TOKEN_WISE
    split = ctx.tp if name != "replicate" or on_tokens else 1
    params = layer.param_bytes / (1 if on_tokens else split)  # a norm's parameters stay whole on every rank
    act_bytes = (layer.bytes_moved - layer.param_bytes) * scale * fraction / split
    first = all(p == INPUT for p in layer.inputs) or not layer.inputs or layer.kind == "embedding"
    cin, cout = layer.channels
    channels = (cin // (split if name == "row" else 1), cout // (split if name == "column" else 1))
    positions = math.prod(layer.out_shape) / max(cout, 1) * scale * fraction
    forward, backward = cost.layer_times(layer.kind, layer.op, layer.flops * scale * fraction / split,
                                         act_bytes + params, ctx.cluster, ctx.dtype, has_weight=layer.has_weight,
                                         input_grad=not first, channels=channels, positions=positions,
                                         work=_conv_work(layer, ctx, channels[0]),
                                         kernel=tuple(w.kernel for w in layer.windows))
    forward, backward = _spatial_runtime_times(layer, ctx, forward, backward, act_bytes, halo_per_sample, split)
    comm = {}
    if any(halo_per_sample):
        per_dim = ctx.micro_batch / (split if name in ("row", "shard") else 1)
        halo = cost.halo_exchange_time(tuple(b * per_dim for b in halo_per_sample), ctx.spatial_group.link)
        comm["halo"] = cost.exposed_halo_time(halo, forward, ctx.overlap) + halo
    comm.update(_spatial_collectives(layer, ctx, scale, fraction, split))
    if name == "column" and not first:
        comm["tp"] = cost.all_reduce_time(_in_bytes(layer) * scale * fraction, ctx.tp_group)
    waits = [g.link.sync_wait for g, kinds in ((ctx.spatial_group, ("halo", "spatial")), (ctx.tp_group, ("tp",)))
             if any(comm.get(k) for k in kinds)]
    if any(waits):
        comm["sync"] = _meetings(layer, first) * max(waits)
    saved = (layer.saved_bytes * scale * fraction + _runtime_copies(layer, ctx, halo_per_sample) * ctx.micro_batch) \
        / split
    out_bytes = layer.out_bytes * scale * (fraction if layer.kind not in ("flatten", "global_pool") else 1.0)
    workspace = (_in_bytes(layer) * scale * fraction + out_bytes) / split
    in_bytes = _in_bytes(layer) * scale * _in_fraction(layer, ctx)
    return Option(name, lout, forward + backward + sum(comm.values()), forward, comm, params, saved,
                  workspace, out_bytes, in_bytes)


def _meetings(layer: Layer, first: bool) -> int:
    """Times a communicating layer's ranks meet after computing apart in one step (each costs ``sync_wait``,
    cost.py): once per pass; a spatially split normalisation twice per pass (its sums, then the sums of
    squares about the mean); a first layer, whose input needs no gradient, not in backward."""
    per_pass = 2 if layer.kind in ("group_norm", "batch_norm") and layer.spatial_in else 1
    return per_pass * (1 if first else 2)


def _spatial_runtime_times(layer: Layer, ctx: MeshContext, forward: float, backward: float, act_bytes: float,
                           halo_per_sample: tuple[float, ...], split: int) -> tuple[float, float]:
    """Forward and backward time of a layer as the spatial runtime runs it on slabs: a conv with halos first
    assembles its slab and halos into one tensor (a copy at the forward rate of a ``cat`` of that size; its
    backward slices the gradient back out, another), and a normalisation is built from separate elementwise
    ops around all-reduced sums (``SPATIAL_NORM_PASSES`` times the fused layer's ``act_bytes``, an affine one
    two passes more each way, at the forward rate of an ``add`` of that size)."""
    if not layer.spatial_in or math.prod(ctx.grid) == 1:
        return forward, backward
    if _assembles(layer, halo_per_sample):
        moved = 2 * (_slab_per_sample(layer, ctx) + sum(halo_per_sample)) * ctx.micro_batch / split
        copy = moved / ctx.cluster.op_rate("cat", moved)[0]
        return forward + copy, backward + copy
    if layer.kind in ("group_norm", "batch_norm"):
        passes_forward, passes_backward = SPATIAL_NORM_PASSES
        extra = 2 if layer.has_weight else 0
        rate = ctx.cluster.op_rate("add", act_bytes)[0]
        return (passes_forward + extra) * act_bytes / rate, (passes_backward + 2 * extra) * act_bytes / rate
    return forward, backward


def _conv_work(layer: Layer, ctx: MeshContext, in_channels: int) -> int:
    """N*C*D*H of the input a conv of this device sees (slab, micro-batch), where it decides PyTorch's CPU
    kernel: the slow one only for a batch of 1 and a kernel no wider than 3 (``use_mkldnn``); else 0."""
    wide = any(w.kernel > 3 for w in layer.windows[-2:])
    if layer.kind not in ("conv", "conv_transpose") or len(layer.in_shape) < 4 or ctx.micro_batch > 1 or wide:
        return 0
    dims = layer.in_shape[2:4]
    grid = ctx.grid if layer.spatial_in and len(ctx.grid) == len(layer.in_shape) - 2 else (1,) * len(dims)
    return ctx.micro_batch * in_channels * math.prod(-(-n // p) for n, p in zip(dims, grid))


def _runtime_copies(layer: Layer, ctx: MeshContext, halo_per_sample: tuple[float, ...]) -> float:
    """Bytes per sample that the spatial runtime keeps for backward beyond what the plain layer keeps: the
    slab assembled with its halos that a conv (or transposed conv) then saves (a copy, where the plain conv shares
    its input with the layer before), and the intermediates of a normalisation built from all-reduced sums."""
    if not layer.spatial_in or math.prod(ctx.grid) == 1:
        return 0.0
    if _assembles(layer, halo_per_sample):
        return _slab_per_sample(layer, ctx) + sum(halo_per_sample)
    if layer.kind == "group_norm":
        return _slab_per_sample(layer, ctx)
    return 0.0


def _assembles(layer: Layer, halo_per_sample: tuple[float, ...]) -> bool:
    """Whether the spatial runtime copies this layer's slab and halos into one tensor (``assemble``)."""
    return layer.kind in ("conv", "conv_transpose") and any(halo_per_sample)


def _slab_per_sample(layer: Layer, ctx: MeshContext) -> float:
    """Bytes of one sample's slab of the layer's (first) input on this device."""
    return _in_bytes(layer) / layer.in_shape[0] * _in_fraction(layer, ctx)


def _in_fraction(layer: Layer, ctx: MeshContext) -> float:
    if not layer.spatial_in or math.prod(ctx.grid) == 1:
        return 1.0
    return slab_fraction(layer.in_shape, ctx.grid)


def _in_bytes(layer: Layer) -> float:
    return math.prod(layer.in_shape) * layer.dtype_bytes if layer.in_shape else 0.0


def _spatial_collectives(layer: Layer, ctx: MeshContext, scale: float, fraction: float, split: int) -> dict:
    if not layer.spatial_in or math.prod(ctx.grid) == 1:
        return {}
    channels = layer.out_shape[1] if len(layer.out_shape) > 1 else 1
    if layer.kind == "batch_norm":  # sums and sums of squares, forward and backward
        stats = 2 * channels / split * 4
        return {"spatial": 2 * cost.all_reduce_time(stats, ctx.norm_group)}
    if layer.kind == "group_norm":
        stats = 2 * ctx.micro_batch * channels / split * 4
        return {"spatial": 2 * cost.all_reduce_time(stats, ctx.spatial_group)}
    if layer.kind == "global_pool":
        return {"spatial": cost.all_reduce_time(layer.out_bytes * scale / split, ctx.spatial_group)}
    if layer.kind == "flatten":
        return {"spatial": cost.all_gather_time(layer.out_bytes * scale / split, ctx.spatial_group)}
    return {}


def transition(src: str, dst: str, num_bytes: float, group: cost.Group) -> float:
    """Forward + backward time to turn an activation of ``num_bytes`` (whole) from layout ``src`` into ``dst``:
    the changes the runtime makes (a column layer's gather, a row layer's sum and its slice of a whole input)."""
    if src == dst:
        return 0.0
    if (src, dst) in ((S, R), (R, S)):
        return cost.all_gather_time(num_bytes, group)  # a slice's gradient comes back split: gathered
    if (src, dst) == (P, R):
        return cost.all_reduce_time(num_bytes, group)
    raise ValueError(f"no layout change {src} -> {dst}")


def redistribution(layer: Layer, option: Option, gather: bool, sliced: bool, group: cost.Group) -> float:
    """What the runtime's layout changes at ``layer`` cost (forward + backward): a column layer that gathers its
    output, a row layer's sum of partial outputs, and its slice of a whole input."""
    move = transition(R, S, option.in_bytes, group) if sliced else 0.0
    if option.layout_out == P:
        move += transition(P, R, option.out_bytes, group)
    elif gather:
        move += transition(S, R, option.out_bytes, group)
    return move

"""Spatial layers that slide a window along each spatial dim: convolutions, transposed convolutions, max and
average pooling. Each gathers the rows its window reaches past the slab (``base.window_halos``) and computes
its rows of the output exactly as one process computes them on the whole volume."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridpar.geometry import DimExchange, TransposedWindow, plan_exchange
from hybridpar.ir.windows import right_pads, windows_of
from hybridpar.spatial.base import Halos, SpatialLayer, out_slab, window_halos
from hybridpar.spatial.halo import PendingHalo, assemble, halo_conv, rows_of


@dataclass(frozen=True)
class OverlapPlan:
    """A stride-1, zero-padded conv whose slab is split along one ``axis`` and keeps its size: the
    output is the slab's own conv with ``pad`` rows fixed on the sides that have a neighbour."""

    axis: int
    pad: int
    reach: int
    fix_left: bool
    fix_right: bool


@dataclass(frozen=True)
class ConvGeometry:
    halos: Halos
    overlap: OverlapPlan | None  # the halo may arrive while the slab's inside is convolved
    reads_model_input: bool  # the model's input itself: the halo is convolved apart (``halo.halo_conv``)


class SpatialConv(SpatialLayer):
    """``Conv1d/2d/3d``: any kernel, stride, padding (int, ``'same'``, ``'valid'``), dilation, groups and
    padding mode. The slab plus its halo is convolved with no padding, so each output row sees
    exactly the input rows (and padding rows) it sees in one process."""

    def _hp_plan(self, in_shape, out_shape, ctx) -> ConvGeometry:
        n = len(self.kernel_size)
        windows, right = windows_of(self, n), right_pads(self)
        left = [w.pad_left for w in windows]
        symmetric = [left[i] if left[i] == right[i] and self.padding_mode == "zeros" else None for i in range(n)]
        halos = window_halos(ctx, ctx.where(self), in_shape, out_shape, windows, self.padding_mode, symmetric)
        overlap = _overlap_plan(halos, windows, in_shape, out_shape, self.padding_mode)
        return ConvGeometry(halos, overlap, ctx.reads_model_input)

    def _hp_run(self, x, geo: ConvGeometry, ctx):
        halos = geo.halos
        if geo.overlap is not None and ctx.use_overlap(x, geo.overlap):
            return self._run_overlapped(x, halos.exchanges[geo.overlap.axis], halos.native, geo.overlap, ctx)
        if geo.reads_model_input and len(halos.active) == 1:
            axis = halos.active[0]
            return halo_conv(x, self.weight, self.bias, halos.exchanges[axis], ctx.comm, 2 + axis,
                             self.stride, halos.native, self.dilation, self.groups)
        x = assemble(x, halos.exchanges, ctx.comm, 0.0)
        return self._conv(x, halos.native)

    def _conv(self, x, native):
        conv = (F.conv1d, F.conv2d, F.conv3d)[len(self.kernel_size) - 1]
        return conv(x, self.weight, self.bias, self.stride, native, self.dilation, self.groups)

    def _run_overlapped(self, x, ex: DimExchange, native, plan: OverlapPlan, ctx):
        """Post the halo exchange, convolve the whole slab with the layer's own zero padding while the
        halo is in flight (right everywhere but the ``pad`` rows next to a neighbour), then recompute
        those border rows from the halo and write them into the output. The conv saves the slab itself,
        not a copy with halos, and the output is never copied."""
        dim, pad, reach = 2 + plan.axis, plan.pad, plan.reach
        pending = PendingHalo(x, ex, ctx.comm, dim, 0.0)
        y = self._conv(x, tuple(pad if a == plan.axis else p for a, p in enumerate(native)))
        pieces = pending.pieces()
        total = sum(p.shape[dim] for p in pieces)
        if plan.fix_left:
            y.narrow(dim, 0, pad).copy_(self._conv(rows_of(pieces, 0, pad + reach, dim), native))
        if plan.fix_right:
            right = self._conv(rows_of(pieces, total - pad - reach, total, dim), native)
            y.narrow(dim, y.shape[dim] - pad, pad).copy_(right)
        return y


def _overlap_plan(halos: Halos, windows, in_shape, out_shape, padding_mode) -> OverlapPlan | None:
    """An ``OverlapPlan`` where the layer allows one (else ``None``: assemble the halo first)."""
    if len(halos.active) != 1 or padding_mode != "zeros":
        return None
    axis = halos.active[0]
    ex, window = halos.exchanges[axis], windows[axis]
    pad, reach = window.pad_left, window.dilation * (window.kernel - 1)
    own = [p for p in ex.pieces if p.owner == ex.part]
    keeps_size = in_shape[2 + axis] == out_shape[2 + axis] and reach == 2 * pad
    if window.stride != 1 or pad == 0 or not keeps_size or len(own) != 1 or ex.hi - ex.lo < reach:
        return None
    if own[0].indices != tuple(range(ex.lo, ex.hi)) or ex.pieces[0].length != pad:
        return None
    remote = [p.owner not in (None, ex.part) for p in ex.pieces]
    if not any(remote):
        return None
    return OverlapPlan(axis, pad, reach, fix_left=remote[0], fix_right=remote[-1])


@dataclass(frozen=True)
class TransposedGeometry:
    exchanges: tuple[DimExchange | None, ...]
    crops: tuple[tuple[int, int], ...]  # per spatial dim: (offset, length) of this slab in the local result


class SpatialConvTranspose(SpatialLayer):
    """``ConvTranspose1d/2d/3d``: the input rows that reach this slab's outputs are gathered, transposed-
    convolved with no padding, and the result cropped (or zero-extended where ``output_padding`` or a
    stride wider than the kernel leaves rows no input reaches) to the slab; bias added last."""

    def _hp_plan(self, in_shape, out_shape, ctx) -> TransposedGeometry:
        where = ctx.where(self)
        exchanges, crops = [], []
        for axis in range(len(self.kernel_size)):
            size = in_shape[2 + axis]
            window = TransposedWindow(
                self.kernel_size[axis], self.stride[axis], self.padding[axis], self.dilation[axis], size
            )
            needs = tuple(_nonempty(window.need(*b), size) for b in ctx.grid.bounds(axis, out_shape[2 + axis]))
            ex = plan_exchange(axis=axis, size=size, bounds=ctx.grid.bounds(axis, size), needs=needs, boundary="zeros",
                               part=ctx.coords[axis], where=where)
            o0, o1 = out_slab(ctx, out_shape, axis)
            exchanges.append(None if ex.is_identity else ex)
            crops.append((o0 - window.first_output(needs[ctx.coords[axis]][0]), o1 - o0))
        return TransposedGeometry(tuple(exchanges), tuple(crops))

    def _hp_run(self, x, geo: TransposedGeometry, ctx):
        x = assemble(x, geo.exchanges, ctx.comm, 0.0)
        conv_t = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[len(self.kernel_size) - 1]
        y = conv_t(x, self.weight, None, self.stride, 0, 0, self.groups, self.dilation)
        for axis, (offset, length) in enumerate(geo.crops):
            y = _crop_or_extend(y, 2 + axis, offset, length)
        if self.bias is not None:
            y = y + self.bias.view(1, -1, *([1] * len(geo.crops)))
        return y


def _nonempty(need: tuple[int, int], size: int) -> tuple[int, int]:
    """A slab whose outputs no input row reaches still takes one row, so shapes stay regular."""
    start, stop = need
    if stop > start:
        return need
    start = min(start, size - 1)
    return start, start + 1


def _crop_or_extend(y: torch.Tensor, dim: int, offset: int, length: int) -> torch.Tensor:
    """Rows ``[offset, offset + length)`` of ``y`` along ``dim``, zeros where they fall outside."""
    have = y.shape[dim]
    start, stop = max(offset, 0), min(offset + length, have)
    core = y.narrow(dim, start, max(stop - start, 0))
    before, after = max(-offset, 0), length - max(stop - start, 0) - max(-offset, 0)
    if before == 0 and after == 0:
        return core
    shape = list(y.shape)
    parts = []
    for rows in (before, None, after):
        if rows is None:
            parts.append(core)
        elif rows > 0:
            shape[dim] = rows
            parts.append(y.new_zeros(shape))
    return torch.cat(parts, dim)


class SpatialMaxPool(SpatialLayer):
    """``MaxPool1d/2d/3d`` with any kernel, stride, padding, dilation and ``ceil_mode``: padding and the
    rows past the end that ``ceil_mode`` windows reach are filled with ``-inf``."""

    def _hp_plan(self, in_shape, out_shape, ctx) -> Halos:
        windows = windows_of(self, len(in_shape) - 2)
        return window_halos(ctx, ctx.where(self), in_shape, out_shape, windows, "zeros", [w.pad_left for w in windows])

    def _hp_run(self, x, geo: Halos, ctx):
        x = assemble(x, geo.exchanges, ctx.comm, -math.inf)
        pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[x.dim() - 3]
        stride = self.stride or self.kernel_size
        return pool(x, self.kernel_size, stride, geo.native, self.dilation, ceil_mode=False)


@dataclass(frozen=True, eq=False)
class AvgPoolGeometry:
    halos: Halos
    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    divisor: torch.Tensor  # per output position of this slab: what one process divides the window's sum by


class SpatialAvgPool(SpatialLayer):
    """``AvgPool1d/2d/3d`` with any kernel, stride, padding, ``ceil_mode``, ``count_include_pad`` and
    ``divisor_override``: a window sum over the slab plus halo, divided by the divisor one process
    uses at that global output position (PyTorch's rule, per dim, multiplied)."""

    def _hp_plan(self, in_shape, out_shape, ctx) -> AvgPoolGeometry:
        n = len(in_shape) - 2
        windows = windows_of(self, n)
        k, s, p = ([getattr(w, f) for w in windows] for f in ("kernel", "stride", "pad_left"))
        halos = window_halos(ctx, ctx.where(self), in_shape, out_shape, windows, "zeros", p)
        divisor = torch.ones(())
        for axis in range(n):
            o0, o1 = out_slab(ctx, out_shape, axis)
            per_dim = torch.tensor(
                [self._divisor(o, k[axis], s[axis], p[axis], in_shape[2 + axis]) for o in range(o0, o1)],
                dtype=torch.float64,
            )
            divisor = divisor.unsqueeze(-1) * per_dim
        if getattr(self, "divisor_override", None):
            divisor = torch.full_like(divisor, float(self.divisor_override))
        return AvgPoolGeometry(halos, k, s, divisor)

    def _divisor(self, o, k, s, p, size) -> int:
        start = o * s - p
        end = min(start + k, size + p)
        if getattr(self, "count_include_pad", True):
            return end - start
        return max(min(end, size) - max(start, 0), 1)

    def _hp_run(self, x, geo: AvgPoolGeometry, ctx):
        k, s, native = geo.kernel, geo.stride, geo.halos.native
        x = assemble(x, geo.halos.exchanges, ctx.comm, 0.0)
        if x.dim() == 3:
            total = F.avg_pool2d(x.unsqueeze(2), (1, k[0]), (1, s[0]), (0, native[0]), divisor_override=1).squeeze(2)
        else:
            pool = F.avg_pool2d if x.dim() == 4 else F.avg_pool3d
            total = pool(x, k, s, native, divisor_override=1)
        return total / geo.divisor.to(dtype=x.dtype, device=x.device)

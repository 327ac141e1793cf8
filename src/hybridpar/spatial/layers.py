"""Spatial versions of standard layers: each plans its geometry from global shapes, then computes its
slab of the output exactly as one process would compute the whole.

A converted module keeps its class's parameters, buffers and names (its class becomes a subclass of
the original, as FSDP2 does); only ``forward`` changes. Each kind provides

- ``_hp_plan(in_shape, out_shape, ctx)``: pure geometry from global shapes, raising on every rank alike;
- ``_hp_run(x, geo, ctx)``: the slab computation;
- ``_hp_output``: ``"partitioned"`` or ``"replicated"`` (global pooling, flatten).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridpar.errors import UnsupportedModuleError
from hybridpar.geometry import TransposedWindow, Window, plan_exchange, split_bounds
from hybridpar.plan import rules
from hybridpar.spatial import collectives
from hybridpar.spatial.checks import PARTITIONED, REPLICATED
from hybridpar.spatial.halo import PendingHalo, assemble, halo_conv, rows_of


def _tuple(value, n: int) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


def _out_slab(ctx, out_shape, axis: int) -> tuple[int, int]:
    return split_bounds(out_shape[2 + axis], ctx.grid.parts[axis])[ctx.coords[axis]]


def _windowed_exchanges(ctx, where, in_shape, out_shape, windows, boundary, native_pads):
    """Exchanges per spatial dim for a sliding-window layer, and the padding left to the local op.

    A dim that is not split keeps the layer's own symmetric padding where that gives the same rows
    (``native_pads[axis]`` not ``None``), saving a copy; every other dim is assembled explicitly.
    """
    exchanges, native = [], []
    for axis, window in enumerate(windows):
        size, parts, m = in_shape[2 + axis], ctx.grid.parts[axis], out_shape[2 + axis]
        needs = tuple(window.need(*b) for b in split_bounds(m, parts))
        pad = native_pads[axis]
        if parts == 1 and pad is not None and needs[0][0] == -pad and needs[0][1] <= size + pad:
            exchanges.append(None)
            native.append(pad)
            continue
        ex = plan_exchange(
            axis=axis, size=size, parts=parts, needs=needs, boundary=boundary,
            part=ctx.coords[axis], where=where,
        )
        exchanges.append(None if ex.is_identity else ex)
        native.append(0)
    return tuple(exchanges), tuple(native)


class SpatialLayer:
    """Mixin for converted layers; the context drives ``forward`` (see ``convert.SpatialContext``)."""

    _hp_output = PARTITIONED

    def forward(self, *args, **kwargs):
        return self._hp_ctx.call_layer(self, super().forward, args, kwargs)

    def _hp_plan(self, in_shape, out_shape, ctx):
        return None


class SpatialConv(SpatialLayer):
    """``Conv1d/2d/3d``: any kernel, stride, padding (int, ``'same'``, ``'valid'``), dilation, groups and
    padding mode. The slab plus its halo is convolved with no padding, so each output row sees
    exactly the input rows (and padding rows) it sees in one process."""

    def _hp_plan(self, in_shape, out_shape, ctx):
        n = len(self.kernel_size)
        pads = self._reversed_padding_repeated_twice
        left = [pads[2 * (n - 1 - i)] for i in range(n)]
        right = [pads[2 * (n - 1 - i) + 1] for i in range(n)]
        windows = [Window(self.kernel_size[i], self.stride[i], left[i], self.dilation[i]) for i in range(n)]
        symmetric = [left[i] if left[i] == right[i] and self.padding_mode == "zeros" else None for i in range(n)]
        exchanges, native = _windowed_exchanges(ctx, ctx.where(self), in_shape, out_shape, windows,
                                                self.padding_mode, symmetric)
        overlap = _overlap_plan(exchanges, windows, ctx, in_shape, out_shape, self.padding_mode)
        return exchanges, native, overlap, ctx.reads_model_input

    def _hp_run(self, x, geo, ctx):
        exchanges, native, overlap, reads_model_input = geo
        if overlap is not None and ctx.use_overlap(x, overlap):
            return self._run_overlapped(x, exchanges[overlap.axis], native, overlap, ctx)
        active = [a for a, ex in enumerate(exchanges) if ex is not None]
        if reads_model_input and len(active) == 1:
            return halo_conv(x, self.weight, self.bias, exchanges[active[0]], ctx.comm, 2 + active[0],
                             self.stride, native, self.dilation, self.groups)
        x = assemble(x, exchanges, ctx.comm, 0.0)
        return self._conv(x, native)

    def _conv(self, x, native):
        conv = (F.conv1d, F.conv2d, F.conv3d)[len(self.kernel_size) - 1]
        return conv(x, self.weight, self.bias, self.stride, native, self.dilation, self.groups)

    def _run_overlapped(self, x, ex, native, plan: OverlapPlan, ctx):
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


@dataclass(frozen=True)
class OverlapPlan:
    """A stride-1, zero-padded conv whose slab is split along one ``axis`` and keeps its size: the
    output is the slab's own conv with ``pad`` rows fixed on the sides that have a neighbour."""

    axis: int
    pad: int
    reach: int
    fix_left: bool
    fix_right: bool


def _overlap_plan(exchanges, windows, ctx, in_shape, out_shape, padding_mode) -> OverlapPlan | None:
    """An ``OverlapPlan`` where the layer allows one (else ``None``: assemble the halo first)."""
    active = [a for a, ex in enumerate(exchanges) if ex is not None]
    if len(active) != 1 or padding_mode != "zeros":
        return None
    axis = active[0]
    ex, window = exchanges[axis], windows[axis]
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


class SpatialConvTranspose(SpatialLayer):
    """``ConvTranspose1d/2d/3d``: the input rows that reach this slab's outputs are gathered, transposed-
    convolved with no padding, and the result cropped (or zero-extended where ``output_padding`` or a
    stride wider than the kernel leaves rows no input reaches) to the slab; bias added last."""

    def _hp_plan(self, in_shape, out_shape, ctx):
        where = ctx.where(self)
        exchanges, crops = [], []
        for axis in range(len(self.kernel_size)):
            size, parts = in_shape[2 + axis], ctx.grid.parts[axis]
            window = TransposedWindow(
                self.kernel_size[axis], self.stride[axis], self.padding[axis], self.dilation[axis], size
            )
            needs = tuple(_nonempty(window.need(*b), size) for b in split_bounds(out_shape[2 + axis], parts))
            ex = plan_exchange(axis=axis, size=size, parts=parts, needs=needs, boundary="zeros",
                               part=ctx.coords[axis], where=where)
            o0, o1 = _out_slab(ctx, out_shape, axis)
            exchanges.append(None if ex.is_identity else ex)
            crops.append((o0 - window.first_output(needs[ctx.coords[axis]][0]), o1 - o0))
        return tuple(exchanges), tuple(crops)

    def _hp_run(self, x, geo, ctx):
        exchanges, crops = geo
        x = assemble(x, exchanges, ctx.comm, 0.0)
        conv_t = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[len(self.kernel_size) - 1]
        y = conv_t(x, self.weight, None, self.stride, 0, 0, self.groups, self.dilation)
        for axis, (offset, length) in enumerate(crops):
            y = _crop_or_extend(y, 2 + axis, offset, length)
        if self.bias is not None:
            y = y + self.bias.view(1, -1, *([1] * len(crops)))
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

    def _hp_plan(self, in_shape, out_shape, ctx):
        n = len(in_shape) - 2
        k, s, p, d = (_tuple(v, n) for v in (self.kernel_size, self.stride or self.kernel_size,
                                                self.padding, self.dilation))
        windows = [Window(k[i], s[i], p[i], d[i]) for i in range(n)]
        return _windowed_exchanges(ctx, ctx.where(self), in_shape, out_shape, windows, "zeros", p)

    def _hp_run(self, x, geo, ctx):
        exchanges, native = geo
        x = assemble(x, exchanges, ctx.comm, -math.inf)
        n = x.dim() - 2
        pool = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[n - 1]
        stride = self.stride or self.kernel_size
        return pool(x, self.kernel_size, stride, native, self.dilation, ceil_mode=False)


class SpatialAvgPool(SpatialLayer):
    """``AvgPool1d/2d/3d`` with any kernel, stride, padding, ``ceil_mode``, ``count_include_pad`` and
    ``divisor_override``: a window sum over the slab plus halo, divided by the divisor one process
    uses at that global output position (PyTorch's rule, per dim, multiplied)."""

    def _hp_plan(self, in_shape, out_shape, ctx):
        n = len(in_shape) - 2
        k, s, p = (_tuple(v, n) for v in (self.kernel_size, self.stride or self.kernel_size, self.padding))
        windows = [Window(k[i], s[i], p[i]) for i in range(n)]
        exchanges, native = _windowed_exchanges(ctx, ctx.where(self), in_shape, out_shape, windows, "zeros", p)
        divisor = torch.ones(())
        for axis in range(n):
            o0, o1 = _out_slab(ctx, out_shape, axis)
            per_dim = torch.tensor(
                [self._divisor(o, k[axis], s[axis], p[axis], in_shape[2 + axis]) for o in range(o0, o1)],
                dtype=torch.float64,
            )
            divisor = divisor.unsqueeze(-1) * per_dim
        if getattr(self, "divisor_override", None):
            divisor = torch.full_like(divisor, float(self.divisor_override))
        return exchanges, native, k, s, divisor

    def _divisor(self, o, k, s, p, size) -> int:
        start = o * s - p
        end = min(start + k, size + p)
        if getattr(self, "count_include_pad", True):
            return end - start
        return max(min(end, size) - max(start, 0), 1)

    def _hp_run(self, x, geo, ctx):
        exchanges, native, k, s, divisor = geo
        x = assemble(x, exchanges, ctx.comm, 0.0)
        if x.dim() == 3:
            total = F.avg_pool2d(x.unsqueeze(2), (1, k[0]), (1, s[0]), (0, native[0]), divisor_override=1).squeeze(2)
        else:
            pool = F.avg_pool2d if x.dim() == 4 else F.avg_pool3d
            total = pool(x, k, s, native, divisor_override=1)
        return total / divisor.to(dtype=x.dtype, device=x.device)


class SpatialGlobalPool(SpatialLayer):
    """``AdaptiveAvgPool``/``AdaptiveMaxPool`` to size 1: reduce the slab, then reduce over the group.
    The output ``(N, C, 1, ...)`` is the same on every rank."""

    _hp_output = REPLICATED

    def _hp_plan(self, in_shape, out_shape, ctx):
        if any(size != 1 for size in out_shape[2:]):
            raise UnsupportedModuleError(
                f"{ctx.where(self)}: adaptive pooling to {tuple(out_shape[2:])} is only exact to size 1 under "
                "a spatial split; use output_size=1, or a fixed-window AvgPool/MaxPool"
            )
        return math.prod(in_shape[2:])

    def _hp_run(self, x, geo, ctx):
        dims = tuple(range(2, x.dim()))
        if isinstance(self, (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)):
            local = x.amax(dim=dims, keepdim=True)
            return collectives.all_gather(local, ctx.comm.group).amax(dim=0)
        return collectives.all_reduce_sum(x.sum(dim=dims, keepdim=True), ctx.comm.group) / geo


class SpatialFlatten(SpatialLayer):
    """``Flatten``: the slabs are gathered into the global tensor first, so the flattened order (and the
    dense head after it) is one process's; the output is the same on every rank."""

    _hp_output = REPLICATED

    def _hp_plan(self, in_shape, out_shape, ctx):
        return tuple(in_shape[2:])

    def _hp_run(self, x, geo, ctx):
        return collectives.gather_slabs(x, ctx.comm, geo).flatten(self.start_dim, self.end_dim)


def _sync_stats(sums: list[torch.Tensor], group) -> list[torch.Tensor]:
    """All-reduce several statistics in one collective."""
    flat = collectives.all_reduce_sum(torch.cat([s.reshape(-1) for s in sums]), group)
    return [f.view(s.shape) for f, s in zip(flat.split([s.numel() for s in sums]), sums)]


class SpatialBatchNorm(SpatialLayer):
    """``BatchNorm1d/2d/3d``: batch statistics over the whole spatial group (and over data parallelism
    too when the context was given ``batch_norm_mesh`` spanning it), two passes for accuracy; running
    statistics updated as one process would on the whole batch."""

    def _hp_run(self, x, geo, ctx):
        use_batch = self.training or not self.track_running_stats
        if not use_batch:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        dims = [0] + list(range(2, x.dim()))
        count = torch.tensor([x.numel() // x.shape[1]], dtype=x.dtype, device=x.device)
        total, count = _sync_stats([x.sum(dims), count], ctx.norm_group)
        mean = total / count
        centred = x - _channels(mean, x)
        (sq,) = _sync_stats([(centred * centred).sum(dims)], ctx.norm_group)
        var = sq / count
        if self.training and self.track_running_stats:
            self._update_running(mean.detach(), var.detach(), count.detach())
        y = centred * _channels(torch.rsqrt(var + self.eps), x)
        if self.affine:
            y = y * _channels(self.weight, x) + _channels(self.bias, x)
        return y

    @torch.no_grad()
    def _update_running(self, mean, var, count):
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * (count / (count - 1).clamp(min=1))
        self.running_mean.mul_(1 - factor).add_(factor * mean.to(self.running_mean.dtype))
        self.running_var.mul_(1 - factor).add_(factor * unbiased.to(self.running_var.dtype))


def _channels(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, *([1] * (x.dim() - 2)))


class SpatialInstanceNorm(SpatialLayer):
    """``InstanceNorm1d/2d/3d``: per-sample, per-channel statistics summed over the spatial group."""

    def _hp_run(self, x, geo, ctx):
        if not self.training and self.track_running_stats:
            return F.instance_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                   False, 0.0, self.eps)
        dims = tuple(range(2, x.dim()))
        count = float(math.prod(geo))
        (total,) = _sync_stats([x.sum(dims, keepdim=True)], ctx.comm.group)
        mean = total / count
        centred = x - mean
        (sq,) = _sync_stats([(centred * centred).sum(dims, keepdim=True)], ctx.comm.group)
        var = sq / count
        if self.training and self.track_running_stats:
            self._update_running(mean.detach().flatten(2).mean(0).squeeze(-1),
                                 var.detach().flatten(2).mean(0).squeeze(-1) * count / max(count - 1, 1))
        y = centred * torch.rsqrt(var + self.eps)
        if self.affine:
            y = y * _channels(self.weight, x) + _channels(self.bias, x)
        return y

    def _hp_plan(self, in_shape, out_shape, ctx):
        return tuple(in_shape[2:])

    @torch.no_grad()
    def _update_running(self, mean, unbiased_var):
        m = self.momentum
        self.running_mean.mul_(1 - m).add_(m * mean)
        self.running_var.mul_(1 - m).add_(m * unbiased_var)


class SpatialGroupNorm(SpatialLayer):
    """``GroupNorm``: per-sample, per-group statistics (channels of the group x all slabs)."""

    def _hp_plan(self, in_shape, out_shape, ctx):
        return (in_shape[1] // self.num_groups) * math.prod(in_shape[2:])

    def _hp_run(self, x, geo, ctx):
        n, c = x.shape[:2]
        grouped = x.reshape(n, self.num_groups, -1)
        (total,) = _sync_stats([grouped.sum(-1, keepdim=True)], ctx.comm.group)
        mean = total / geo
        centred = grouped - mean
        (sq,) = _sync_stats([(centred * centred).sum(-1, keepdim=True)], ctx.comm.group)
        y = (centred * torch.rsqrt(sq / geo + self.eps)).reshape(x.shape)
        if self.affine:
            y = y * _channels(self.weight, x) + _channels(self.bias, x)
        return y


class SpatialUpsample(SpatialLayer):
    """``Upsample`` (nearest, nearest-exact, linear, bilinear, trilinear; both ``align_corners``):
    per dim, the source rows and weights one process uses are found by interpolating an identity
    matrix with PyTorch's own kernel; the slab then gathers its source rows (with halo) and blends."""

    MODES = ("nearest", "nearest-exact", "linear", "bilinear", "trilinear")

    def _hp_plan(self, in_shape, out_shape, ctx):
        where = ctx.where(self)
        if self.mode not in self.MODES:
            raise UnsupportedModuleError(f"{where}: Upsample mode {self.mode!r} is not supported; "
                                         f"use one of {self.MODES}")
        n = len(in_shape) - 2
        scales = _tuple(self.scale_factor, n) if self.scale_factor is not None else (None,) * n
        exchanges, taps = [], []
        for axis in range(n):
            rows = self._source_rows(in_shape[2 + axis], out_shape[2 + axis], scales[axis])
            needs = tuple((int(rows[0][o0:o1].min()), int(rows[1][o0:o1].max()) + 1)
                          for o0, o1 in split_bounds(out_shape[2 + axis], ctx.grid.parts[axis]))
            ex = plan_exchange(axis=axis, size=in_shape[2 + axis], parts=ctx.grid.parts[axis], needs=needs,
                               boundary="zeros", part=ctx.coords[axis], where=where)
            o0, o1 = _out_slab(ctx, out_shape, axis)
            start = needs[ctx.coords[axis]][0]
            exchanges.append(None if ex.is_identity else ex)
            taps.append((rows[0][o0:o1] - start, rows[1][o0:o1] - start, rows[2][o0:o1], rows[3][o0:o1]))
        return tuple(exchanges), tuple(taps)

    def _source_rows(self, size: int, out_size: int, scale):
        """Per output row: two source rows and their weights, read off PyTorch's 1-D interpolation."""
        mode = {"bilinear": "linear", "trilinear": "linear"}.get(self.mode, self.mode)
        eye = torch.eye(size, dtype=torch.float64).unsqueeze(1)
        kwargs = {"scale_factor": scale} if scale is not None else {"size": out_size}
        if mode == "linear":
            kwargs["align_corners"] = self.align_corners
        if scale is not None:
            kwargs["recompute_scale_factor"] = self.recompute_scale_factor
        weights = F.interpolate(eye, mode=mode, **kwargs).squeeze(1).T  # (out, in)
        assert weights.shape[0] == out_size, (weights.shape, out_size)
        nonzero = weights != 0
        first = nonzero.float().argmax(dim=1)
        last = size - 1 - nonzero.flip(1).float().argmax(dim=1)
        w_first = weights.gather(1, first[:, None]).squeeze(1)
        w_last = torch.where(last == first, torch.zeros_like(w_first), weights.gather(1, last[:, None]).squeeze(1))
        return first, last, w_first, w_last

    def _hp_run(self, x, geo, ctx):
        exchanges, taps = geo
        x = assemble(x, exchanges, ctx.comm, 0.0)
        for axis, (first, last, w_first, w_last) in enumerate(taps):
            dim = 2 + axis
            shape = [1] * x.dim()
            shape[dim] = -1
            a = x.index_select(dim, first.to(x.device))
            if torch.all(w_last == 0) and torch.all(w_first == 1):
                x = a
                continue
            b = x.index_select(dim, last.to(x.device))
            x = a * w_first.to(x).view(shape) + b * w_last.to(x).view(shape)
        return x


class SpatialDropout(SpatialLayer):
    """``Dropout``: on a slab each rank draws its own rows' mask; ``Dropout1d/2d/3d`` drop whole
    channels, so the ``(N, C)`` mask is drawn on spatial rank 0 and shared. On a replicated tensor
    (after flatten) the whole mask is shared, so every rank keeps computing the same head."""

    def forward(self, x):
        return self._hp_ctx.call_layer(self, super().forward, (x,), {}, replicated=self._hp_run_replicated)

    def _channelwise(self) -> bool:
        return isinstance(self, (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d))

    def _hp_run(self, x, geo, ctx):
        if not self.training or self.p == 0 or not self._channelwise():
            return super(SpatialLayer, self).forward(x)
        return self._shared_mask(x, x.shape[:2] + (1,) * (x.dim() - 2), ctx)

    def _hp_run_replicated(self, x, ctx):
        if not self.training or self.p == 0:
            return x
        shape = x.shape if not self._channelwise() else x.shape[:2] + (1,) * (x.dim() - 2)
        return self._shared_mask(x, shape, ctx)

    def _shared_mask(self, x, shape, ctx):
        keep = 1.0 - self.p
        mask = collectives.broadcast_(torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(keep), ctx.comm)
        return x * mask / keep if keep > 0 else x * 0


SPATIAL_CLASSES = {"Conv": SpatialConv, "ConvTranspose": SpatialConvTranspose, "MaxPool": SpatialMaxPool,
                   "AvgPool": SpatialAvgPool, "AdaptiveAvgPool": SpatialGlobalPool,
                   "AdaptiveMaxPool": SpatialGlobalPool,
                   "BatchNorm": SpatialBatchNorm, "InstanceNorm": SpatialInstanceNorm, "GroupNorm": SpatialGroupNorm,
                   "Upsample": SpatialUpsample, "Flatten": SpatialFlatten, "Dropout": SpatialDropout}
# the torch.nn classes the rules name (``hybridpar.plan.rules.SPATIAL_MODULES``), each with its spatial version
LAYERS: dict[type, type] = {getattr(nn, name): SPATIAL_CLASSES[re.sub(r"[123]d$", "", name)]
                            for name in sorted(rules.SPATIAL_MODULES)}

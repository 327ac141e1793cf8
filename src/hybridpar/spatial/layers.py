"""Every spatial layer, by the ``torch.nn`` class it stands in for (``LAYERS``), and the layers that neither
slide a window nor normalise: global pooling, flatten, upsampling and dropout.

How a spatial layer is written (``_hp_plan``, ``_hp_run``, ``_hp_output``): ``hybridpar.spatial.base``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridpar.errors import UnsupportedModuleError
from hybridpar.geometry import DimExchange, plan_exchange
from hybridpar.ir import rules
from hybridpar.spatial import collectives
from hybridpar.spatial.base import Halos, SpatialLayer, Statistics, as_tuple, out_slab
from hybridpar.spatial.checks import REPLICATED
from hybridpar.spatial.halo import assemble
from hybridpar.spatial.norms import SpatialBatchNorm, SpatialGroupNorm, SpatialInstanceNorm
from hybridpar.spatial.windows import (
    AvgPoolGeometry,
    ConvGeometry,
    SpatialAvgPool,
    SpatialConv,
    SpatialConvTranspose,
    SpatialMaxPool,
    TransposedGeometry,
)


class SpatialGlobalPool(SpatialLayer):
    """``AdaptiveAvgPool``/``AdaptiveMaxPool`` to size 1: reduce the slab, then reduce over the group.
    The output ``(N, C, 1, ...)`` is the same on every rank."""

    _hp_output = REPLICATED

    def _hp_plan(self, in_shape, out_shape, ctx) -> Statistics:
        if any(size != 1 for size in out_shape[2:]):
            raise UnsupportedModuleError(
                f"{ctx.where(self)}: adaptive pooling to {tuple(out_shape[2:])} is only exact to size 1 under "
                "a spatial split; use output_size=1, or a fixed-window AvgPool/MaxPool"
            )
        return Statistics(math.prod(in_shape[2:]))

    def _hp_run(self, x, geo: Statistics, ctx):
        dims = tuple(range(2, x.dim()))
        if isinstance(self, (nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d)):
            local = x.amax(dim=dims, keepdim=True)
            return collectives.all_gather(local, ctx.comm.group).amax(dim=0)
        return collectives.all_reduce_sum(x.sum(dim=dims, keepdim=True), ctx.comm.group) / geo.count


@dataclass(frozen=True)
class Gather:
    spatial_shape: tuple[int, ...]  # of the whole volume the slabs are gathered into


class SpatialFlatten(SpatialLayer):
    """``Flatten``: the slabs are gathered into the global tensor first, so the flattened order (and the
    dense head after it) is one process's; the output is the same on every rank."""

    _hp_output = REPLICATED

    def _hp_plan(self, in_shape, out_shape, ctx) -> Gather:
        return Gather(tuple(in_shape[2:]))

    def _hp_run(self, x, geo: Gather, ctx):
        return collectives.gather_slabs(x, ctx.comm, geo.spatial_shape).flatten(self.start_dim, self.end_dim)


@dataclass(frozen=True, eq=False)
class UpsampleGeometry:
    exchanges: tuple[DimExchange | None, ...]
    taps: tuple[tuple[torch.Tensor, ...], ...]  # per spatial dim: (first, last, w_first, w_last) per output row


class SpatialUpsample(SpatialLayer):
    """``Upsample`` (nearest, nearest-exact, linear, bilinear, trilinear; both ``align_corners``):
    per dim, the source rows and weights one process uses are found by interpolating an identity
    matrix with PyTorch's own kernel; the slab then gathers its source rows (with halo) and blends."""

    MODES = ("nearest", "nearest-exact", "linear", "bilinear", "trilinear")

    def _hp_plan(self, in_shape, out_shape, ctx) -> UpsampleGeometry:
        where = ctx.where(self)
        if self.mode not in self.MODES:
            raise UnsupportedModuleError(f"{where}: Upsample mode {self.mode!r} is not supported; "
                                         f"use one of {self.MODES}")
        n = len(in_shape) - 2
        scales = as_tuple(self.scale_factor, n) if self.scale_factor is not None else (None,) * n
        exchanges, taps = [], []
        for axis in range(n):
            rows = self._source_rows(in_shape[2 + axis], out_shape[2 + axis], scales[axis])
            needs = tuple((int(rows[0][o0:o1].min()), int(rows[1][o0:o1].max()) + 1)
                          for o0, o1 in ctx.grid.bounds(axis, out_shape[2 + axis]))
            ex = plan_exchange(axis=axis, size=in_shape[2 + axis], bounds=ctx.grid.bounds(axis, in_shape[2 + axis]),
                               needs=needs, boundary="zeros", part=ctx.coords[axis], where=where)
            o0, o1 = out_slab(ctx, out_shape, axis)
            start = needs[ctx.coords[axis]][0]
            exchanges.append(None if ex.is_identity else ex)
            taps.append((rows[0][o0:o1] - start, rows[1][o0:o1] - start, rows[2][o0:o1], rows[3][o0:o1]))
        return UpsampleGeometry(tuple(exchanges), tuple(taps))

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

    def _hp_run(self, x, geo: UpsampleGeometry, ctx):
        x = assemble(x, geo.exchanges, ctx.comm, 0.0)
        for axis, (first, last, w_first, w_last) in enumerate(geo.taps):
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


# what a layer plans once per global input shape and runs with (``None``: batch norm, dropout)
Geometry = ConvGeometry | TransposedGeometry | Halos | AvgPoolGeometry | Statistics | Gather | UpsampleGeometry | None

SPATIAL_CLASSES = {"Conv": SpatialConv, "ConvTranspose": SpatialConvTranspose, "MaxPool": SpatialMaxPool,
                   "AvgPool": SpatialAvgPool, "AdaptiveAvgPool": SpatialGlobalPool,
                   "AdaptiveMaxPool": SpatialGlobalPool,
                   "BatchNorm": SpatialBatchNorm, "InstanceNorm": SpatialInstanceNorm, "GroupNorm": SpatialGroupNorm,
                   "Upsample": SpatialUpsample, "Flatten": SpatialFlatten, "Dropout": SpatialDropout}
# the torch.nn classes the rules name (``hybridpar.ir.rules.SPATIAL_MODULES``), each with its spatial version
LAYERS: dict[type, type] = {getattr(nn, name): SPATIAL_CLASSES[re.sub(r"[123]d$", "", name)]
                            for name in sorted(rules.SPATIAL_MODULES)}

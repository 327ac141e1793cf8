"""What every spatial layer shares: the mixin that hands ``forward`` to the context, and the halo plan of a
layer that slides a window along each spatial dim.

A converted module keeps its class's parameters, buffers and names (its class becomes a subclass of the
original, as FSDP2 does); only ``forward`` changes. Each kind provides

- ``_hp_plan(in_shape, out_shape, ctx)``: its geometry (a frozen record, or ``None``) from global shapes, raising
  on every rank alike;
- ``_hp_run(x, geo, ctx)``: the slab computation, given that geometry;
- ``_hp_output``: ``"partitioned"`` or ``"replicated"`` (global pooling, flatten).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridpar.geometry import DimExchange, Window, plan_exchange
from hybridpar.spatial.checks import PARTITIONED


class SpatialLayer:
    """Mixin for converted layers; the context drives ``forward`` (see ``convert.SpatialContext``)."""

    _hp_output = PARTITIONED

    def forward(self, *args, **kwargs):
        return self._hp_ctx.call_layer(self, super().forward, args, kwargs)

    def _hp_plan(self, in_shape, out_shape, ctx):
        return None


@dataclass(frozen=True)
class Halos:
    """Per spatial dim: the exchange that builds the rows the local op reads (``None``: the slab as it is),
    and the padding left to the local op (the layer's own, where a dim that is not split keeps it)."""

    exchanges: tuple[DimExchange | None, ...]
    native: tuple[int, ...]

    @property
    def active(self) -> tuple[int, ...]:
        """The spatial dims whose rows cross between ranks or get filled."""
        return tuple(a for a, ex in enumerate(self.exchanges) if ex is not None)


@dataclass(frozen=True)
class Statistics:
    """A layer whose statistics (a mean, a sum) run over the whole volume: ``count`` elements per statistic."""

    count: int


def as_tuple(value, n: int) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,) * n


def out_slab(ctx, out_shape, axis: int) -> tuple[int, int]:
    """``[start, stop)`` of this rank's output rows along spatial dim ``axis``."""
    return ctx.grid.bounds(axis, out_shape[2 + axis])[ctx.coords[axis]]


def window_halos(ctx, where: str, in_shape, out_shape, windows: list[Window], boundary: str, native_pads) -> Halos:
    """The halos of a sliding-window layer. A dim that is not split keeps the layer's own symmetric padding
    where that gives the same rows (``native_pads[axis]`` not ``None``), saving a copy; every other dim is
    assembled explicitly."""
    exchanges, native = [], []
    for axis, window in enumerate(windows):
        size, parts, m = in_shape[2 + axis], ctx.grid.parts[axis], out_shape[2 + axis]
        needs = tuple(window.need(*b) for b in ctx.grid.bounds(axis, m))
        pad = native_pads[axis]
        if parts == 1 and pad is not None and needs[0][0] == -pad and needs[0][1] <= size + pad:
            exchanges.append(None)
            native.append(pad)
            continue
        ex = plan_exchange(
            axis=axis, size=size, bounds=ctx.grid.bounds(axis, size), needs=needs, boundary=boundary,
            part=ctx.coords[axis], where=where,
        )
        exchanges.append(None if ex.is_identity else ex)
        native.append(0)
    return Halos(tuple(exchanges), tuple(native))

"""Spatial grids: whether a model's layers run exactly on the slabs of a grid (``check_grid``): no operation that
mixes positions along a split dim (``ModelGraph.spatial_refusals``, recorded by the analysis), every slab at least
one row, every halo within a neighbour's slab (the runtime's ``plan_exchange``, in closed form for zero padding)."""

from __future__ import annotations

from functools import lru_cache

from hybridpar.errors import GeometryError, PlanError
from hybridpar.geometry import Grid, plan_exchange
from hybridpar.ir.rules.slabs import first_refusal


def check_grid(graph, grid: tuple[int, ...] | Grid) -> None:
    """Refuse a spatial grid (parts per dim, or a ``Grid`` with slab weights) the runtime would refuse (an
    operation that mixes positions, a slab thinner than its halo), naming the first layer that breaks: the same
    rules as ``hybridpar.spatial``."""
    grid = grid if isinstance(grid, Grid) else Grid(tuple(grid))
    if grid.size == 1:
        return
    if graph.spatial_ndim != grid.ndim:
        raise PlanError(f"spatial grid {grid.parts} has {grid.ndim} dims but the model's input {graph.input_shape} "
                        f"has {graph.spatial_ndim} spatial dims")
    refused = first_refusal(graph.spatial_refusals, grid.parts)
    if refused:
        raise PlanError(refused)
    for layer in graph.layers:
        if layer.spatial_in:
            _check_layer_grid(layer, grid)


def _check_layer_grid(layer, grid: Grid) -> None:
    where = f"layer {layer.name!r} ({layer.op})"
    out_spatial = layer.out_shape[2:] if layer.kind not in ("global_pool", "flatten") else layer.in_shape[2:]
    for axis, parts in enumerate(grid.parts[:len(out_spatial)]):
        rows = min(out_spatial[axis], layer.in_shape[2 + axis])
        if parts > 1 and rows < parts:
            raise PlanError(f"{where}: spatial dim {axis} has {rows} rows, fewer than its {parts} parts")
    for axis, window in enumerate(layer.windows):
        if grid.parts[axis] > 1:
            size = layer.in_shape[2 + axis]
            _check_window(window, size, grid.bounds(axis, size), grid.bounds(axis, layer.out_shape[2 + axis]),
                          layer.boundary, axis, where)


@lru_cache(maxsize=65536)
def _check_window(window, size: int, bounds: tuple, out_bounds: tuple, boundary: str, axis: int, where: str) -> None:
    """Every part's halo comes from its neighbours: the runtime's rule (``plan_exchange``), in closed form
    for zero padding."""
    needs, parts = tuple(window.need(*b) for b in out_bounds), len(bounds)
    if boundary != "zeros":
        try:
            plan_exchange(axis=axis, size=size, bounds=bounds, needs=needs, boundary=boundary, part=0, where=where)
        except GeometryError as err:
            raise PlanError(str(err)) from None
        return
    for q, (start, stop) in enumerate(needs):
        lo = bounds[max(q - 1, 0)][0]
        hi = bounds[min(q + 1, parts - 1)][1]
        if max(start, 0) < lo or min(stop, size) > hi:
            thinnest = min(b - a for a, b in bounds)
            raise PlanError(f"{where}: along spatial dim {axis} (size {size}, {parts} parts), part {q} needs rows "
                            f"[{start}, {stop}), which reach past its neighbour (the thinnest slab has {thinnest} "
                            f"rows, thinner than the halo); use fewer parts along dim {axis} or a larger input")

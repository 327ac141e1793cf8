"""Collectives over the spatial group as autograd Functions (backward mirrors forward).

The gradient convention: every rank of a spatial group computes the same global loss and calls
``backward`` on it; autograd through these Functions then gives each rank ``P`` times its share of
every parameter gradient, and averaging gradients over the group (as data parallelism does) gives
the exact gradient. See ``docs/concepts.md``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridpar.spatial.halo import SpatialComm


class _AllReduceSum(torch.autograd.Function):
    """Forward: the sum of ``x`` over ``group``. Backward: the sum of the gradients over ``group``."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum over ``group``, differentiable."""
    return _AllReduceSum.apply(x, group)


class _AllGather(torch.autograd.Function):
    """Forward: stack every rank's equal-shaped ``x`` along a new dim 0.
    Backward: sum the stacked gradient over ranks and keep this rank's row."""

    @staticmethod
    def forward(ctx, x, group):
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        ctx.group = group
        return torch.stack(out)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None


def all_gather(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``(world, *x.shape)``: every rank's ``x``, differentiable."""
    return _AllGather.apply(x, group)


def gather_slabs(x: torch.Tensor, comm: SpatialComm, spatial_shape: tuple[int, ...]) -> torch.Tensor:
    """The global ``(N, C, *spatial_shape)`` tensor from every rank's slab (uneven slabs included)."""
    grid = comm.grid
    slabs = [grid.slab(spatial_shape, r) for r in range(grid.size)]
    largest = [max(b[d][1] - b[d][0] for b in slabs) for d in range(grid.ndim)]
    pad = []
    for d in reversed(range(grid.ndim)):
        pad += [0, largest[d] - x.shape[2 + d]]
    stacked = all_gather(torch.nn.functional.pad(x, pad), comm.group)
    rows = []
    for r, bounds in enumerate(slabs):
        piece = stacked[r]
        for d, (lo, hi) in enumerate(bounds):
            piece = piece.narrow(2 + d, 0, hi - lo)
        rows.append(piece)
    return _place(rows, slabs, grid)


def _place(pieces, slabs, grid) -> torch.Tensor:
    """Concatenate slabs in grid order: innermost grid dim first."""
    def build(axis: int, prefix: tuple[int, ...]):
        if axis == grid.ndim:
            return pieces[grid.rank_of(prefix)]
        return torch.cat([build(axis + 1, prefix + (c,)) for c in range(grid.parts[axis])], dim=2 + axis)
    return build(0, ())


def broadcast_(x: torch.Tensor, comm: SpatialComm) -> torch.Tensor:
    """Overwrite ``x`` with spatial rank 0's (no gradient: for random masks)."""
    dist.broadcast(x, comm.global_ranks[0], group=comm.group)
    return x

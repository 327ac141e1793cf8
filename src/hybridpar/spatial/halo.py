"""Halo exchange and gathers as autograd Functions; their backward is the mirror communication.

``halo_exchange`` builds, along one tensor dim, the rows a layer needs from this rank's slab, its
neighbours' border rows and fill rows; its backward sends each halo's gradient back to the rank it
came from, which adds it to its own. Exchanges along several dims run one dim after the other on the
already extended tensor, so edges and corners arrive without extra messages.

Only this module and ``collectives`` talk to ``torch.distributed``; layers call these functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybridpar.spatial.geometry import DimExchange, Grid


@dataclass
class ExchangeStats:
    """Bytes this rank sent in halo exchanges (forward and backward), for benchmarks and tests."""

    bytes_sent: int = 0
    messages: int = 0

    def reset(self) -> None:
        self.bytes_sent = 0
        self.messages = 0


@dataclass
class SpatialComm:
    """The spatial process group of one rank and the grid laid over it."""

    group: dist.ProcessGroup
    grid: Grid
    rank: int
    global_ranks: tuple[int, ...]
    stats: ExchangeStats = field(default_factory=ExchangeStats)

    @classmethod
    def from_group(cls, group: dist.ProcessGroup, grid: Grid) -> "SpatialComm":
        size = dist.get_world_size(group)
        ranks = tuple(dist.get_global_rank(group, r) for r in range(size))
        return cls(group=group, grid=grid, rank=dist.get_rank(group), global_ranks=ranks)

    @property
    def coords(self) -> tuple[int, ...]:
        return self.grid.coords(self.rank)

    def peer(self, axis: int, part: int) -> int:
        """Global rank of the part ``part`` along grid axis ``axis``, other coordinates as this rank's."""
        return self.global_ranks[self.grid.neighbour(self.rank, axis, part)]


def _rows(x: torch.Tensor, dim: int, indices: tuple[int, ...], lo: int) -> torch.Tensor:
    start = indices[0] - lo
    if indices == tuple(range(indices[0], indices[0] + len(indices))):
        return x.narrow(dim, start, len(indices))
    return x.index_select(dim, torch.tensor([i - lo for i in indices], device=x.device))


def _add_rows(grad: torch.Tensor, dim: int, indices: tuple[int, ...], lo: int, rows: torch.Tensor) -> None:
    if indices == tuple(range(indices[0], indices[0] + len(indices))):
        grad.narrow(dim, indices[0] - lo, len(indices)).add_(rows)
    else:
        grad.index_add_(dim, torch.tensor([i - lo for i in indices], device=grad.device), rows)


def _exchange(comm: SpatialComm, axis: int, sends, recvs) -> None:
    """Post every send and receive of one exchange at once, then wait for all of them."""
    ops = [dist.P2POp(dist.isend, buf, comm.peer(axis, part), comm.group, tag) for part, buf, tag in sends]
    ops += [dist.P2POp(dist.irecv, buf, comm.peer(axis, part), comm.group, tag) for part, buf, tag in recvs]
    for buf in (b for _, b, _ in sends):
        comm.stats.bytes_sent += buf.numel() * buf.element_size()
    comm.stats.messages += len(sends)
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def _shape_with(x: torch.Tensor, dim: int, length: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = length
    return shape


class _HaloExchange(torch.autograd.Function):
    """Forward: assemble ``pieces`` along ``dim`` (own rows, neighbours' rows, fill rows).
    Backward: own rows' gradients stay, halo gradients go back to their owners and are added there."""

    @staticmethod
    def forward(ctx, x, ex: DimExchange, comm: SpatialComm, dim: int, fill: float):
        sends = [(part, _rows(x, dim, idx, ex.lo).contiguous(), tag) for part, idx, tag in ex.sends]
        recvs = {
            tag: (p.owner, x.new_empty(_shape_with(x, dim, p.length)), tag)
            for tag, p in enumerate(ex.pieces)
            if p.owner not in (None, ex.part)
        }
        _exchange(comm, ex.axis, sends, list(recvs.values()))
        out = []
        for tag, piece in enumerate(ex.pieces):
            if piece.owner is None:
                out.append(x.new_full(_shape_with(x, dim, piece.length), fill))
            elif piece.owner == ex.part:
                out.append(_rows(x, dim, piece.indices, ex.lo))
            else:
                out.append(recvs[tag][1])
        ctx.ex, ctx.comm, ctx.dim, ctx.shape = ex, comm, dim, x.shape
        return torch.cat(out, dim) if len(out) > 1 else out[0].clone()

    @staticmethod
    def backward(ctx, grad_out):
        ex, comm, dim = ctx.ex, ctx.comm, ctx.dim
        grad_out = grad_out.contiguous()
        grads = grad_out.split([p.length for p in ex.pieces], dim)
        grad_x = grad_out.new_zeros(ctx.shape)
        sends = [
            (p.owner, g.contiguous(), tag)
            for tag, (p, g) in enumerate(zip(ex.pieces, grads))
            if p.owner not in (None, ex.part)
        ]
        recvs = [
            (part, grad_out.new_empty(_shape_with(grad_out, dim, len(idx))), tag) for part, idx, tag in ex.sends
        ]
        _exchange(comm, ex.axis, sends, recvs)
        for piece, g in zip(ex.pieces, grads):
            if piece.owner == ex.part:
                _add_rows(grad_x, dim, piece.indices, ex.lo, g)
        for (_, idx, _), (_, buf, _) in zip(ex.sends, recvs):
            _add_rows(grad_x, dim, idx, ex.lo, buf)
        return grad_x, None, None, None, None


def halo_exchange(x: torch.Tensor, ex: DimExchange | None, comm: SpatialComm, dim: int, fill: float = 0.0):
    """Rows ``ex`` asks for along tensor dim ``dim`` (``None``: the slab as it is)."""
    if ex is None or ex.is_identity:
        return x
    return _HaloExchange.apply(x, ex, comm, dim, fill)


def assemble(x: torch.Tensor, exchanges, comm: SpatialComm, fill: float = 0.0) -> torch.Tensor:
    """Halo exchange along every spatial dim of an ``(N, C, *spatial)`` slab, one dim after the other."""
    for axis, ex in enumerate(exchanges):
        x = halo_exchange(x, ex, comm, 2 + axis, fill)
    return x


"""Halo exchange and gathers as autograd Functions; their backward is the mirror communication.

``halo_exchange`` builds, along one tensor dim, the rows a layer needs from this rank's slab, its
neighbours' border rows and fill rows; its backward sends each halo's gradient back to the rank it
came from, which adds it to its own. Exchanges along several dims run one dim after the other on the
already extended tensor, so edges and corners arrive without extra messages.

Only this module and ``collectives`` talk to ``torch.distributed``; layers call these functions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybridpar.geometry import DimExchange, Grid


@dataclass
class ExchangeStats:
    """Bytes this rank sent in halo exchanges (forward and backward), for benchmarks and tests, and the seconds it
    waited for halos (the time a slower neighbour costs it: ``hybridpar.train.pace`` leaves it out of the rank's
    compute time). ``links``: per peer (a global rank), the seconds of each blocking exchange with it since
    ``take``, in order; ``link_bytes``: the bytes sent to it; both kept while ``timed`` (``hybridpar.train.links``
    compares the two sides of each link). ``hold``: seconds to hold an exchange of so many bytes before posting it
    (an emulated slow link, ``hybridpar.train.faults``), inside its timed span as a slow link's transfer would be."""

    bytes_sent: int = 0
    messages: int = 0
    wait_s: float = 0.0
    links: dict[int, list[float]] = field(default_factory=dict)
    link_bytes: dict[int, int] = field(default_factory=dict)
    timed: bool = False
    hold: Callable[[int], float] | None = None

    def reset(self) -> None:
        self.bytes_sent = 0
        self.messages = 0
        self.wait_s = 0.0
        self.take()

    def take(self) -> tuple[dict[int, list[float]], dict[int, int]]:
        """The per-peer seconds and bytes since the last call, cleared."""
        links, sent = self.links, self.link_bytes
        self.links, self.link_bytes = {}, {}
        return links, sent


@dataclass
class SpatialComm:
    """The spatial process group of one rank and the grid laid over it."""

    group: dist.ProcessGroup
    grid: Grid
    rank: int
    global_ranks: tuple[int, ...]
    stats: ExchangeStats = field(default_factory=ExchangeStats)

    @classmethod
    def from_group(cls, group: dist.ProcessGroup, grid: Grid) -> SpatialComm:
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


def _post(comm: SpatialComm, axis: int, sends, recvs) -> list:
    """Post every send and receive of one exchange at once; returns the requests to wait on."""
    ops = [dist.P2POp(dist.isend, buf, comm.peer(axis, part), comm.group, tag) for part, buf, tag in sends]
    ops += [dist.P2POp(dist.irecv, buf, comm.peer(axis, part), comm.group, tag) for part, buf, tag in recvs]
    for _, buf, _ in sends:
        comm.stats.bytes_sent += buf.numel() * buf.element_size()
    comm.stats.messages += len(sends)
    return dist.batch_isend_irecv(ops) if ops else []


def _wait(requests, comm: SpatialComm) -> None:
    begin = time.perf_counter()
    for req in requests:
        req.wait()
    comm.stats.wait_s += time.perf_counter() - begin


def _exchange(comm: SpatialComm, axis: int, sends, recvs) -> None:
    """One blocking exchange: post every send and receive, wait for them all; while ``timed``, its seconds
    recorded per peer."""
    stats = comm.stats
    begin = time.perf_counter()
    sent: dict[int, int] = {}  # bytes per peer, where the timing or a held link asks
    if stats.timed or stats.hold is not None:
        for part, buf, _ in sends:
            peer = comm.peer(axis, part)
            sent[peer] = sent.get(peer, 0) + buf.numel() * buf.element_size()
    if stats.hold is not None:
        time.sleep(stats.hold(sum(sent.values())))
    for req in _post(comm, axis, sends, recvs):
        req.wait()
    took = time.perf_counter() - begin
    stats.wait_s += took
    if stats.timed:
        for peer in {*sent, *(comm.peer(axis, part) for part, _, _ in recvs)}:
            stats.links.setdefault(peer, []).append(took)
            stats.link_bytes[peer] = stats.link_bytes.get(peer, 0) + sent.get(peer, 0)


def _shape_with(x: torch.Tensor, dim: int, length: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = length
    return shape


def _is_remote(piece, ex: DimExchange) -> bool:
    return piece.owner not in (None, ex.part)


def _forward_messages(x, ex: DimExchange, dim: int):
    """This part's border rows to send and empty halo pieces to receive: (sends, receives, halos by tag)."""
    sends = [(part, _rows(x, dim, idx, ex.lo).contiguous(), tag) for part, idx, tag in ex.sends]
    halos = {tag: x.new_empty(_shape_with(x, dim, p.length)) for tag, p in enumerate(ex.pieces) if _is_remote(p, ex)}
    recvs = [(ex.pieces[tag].owner, buf, tag) for tag, buf in halos.items()]
    return sends, recvs, halos


def _post_forward(x, ex: DimExchange, comm: SpatialComm, dim: int):
    """Send this part's border rows, post receives of the halo pieces; returns (requests, halos by tag)."""
    sends, recvs, halos = _forward_messages(x, ex, dim)
    return _post(comm, ex.axis, sends, recvs), halos


def _exchange_forward(x, ex: DimExchange, comm: SpatialComm, dim: int) -> dict:
    """The halo pieces of ``x``, exchanged blocking; returns the halos by tag."""
    sends, recvs, halos = _forward_messages(x, ex, dim)
    _exchange(comm, ex.axis, sends, recvs)
    return halos


def _return_halo_grads(ex: DimExchange, comm: SpatialComm, dim: int, grad_x: torch.Tensor, halo_grads: dict):
    """Backward of the exchange: send each halo's gradient to its owner, receive the gradients of the
    rows this part sent and add them into ``grad_x`` (this part's slab gradient)."""
    sends = [(ex.pieces[tag].owner, g.contiguous(), tag) for tag, g in halo_grads.items()]
    recvs = [(part, grad_x.new_empty(_shape_with(grad_x, dim, len(idx))), tag) for part, idx, tag in ex.sends]
    _exchange(comm, ex.axis, sends, recvs)
    for (_, idx, _), (_, buf, _) in zip(ex.sends, recvs):
        _add_rows(grad_x, dim, idx, ex.lo, buf)
    return grad_x


def _slab_grad(ex: DimExchange, comm: SpatialComm, dim: int, x_shape, grad_assembled: torch.Tensor):
    """The slab's gradient from the gradient of its assembled rows: own rows stay, halo rows go back
    to their owners, and the rows this part sent come back and are added."""
    grads = grad_assembled.split([p.length for p in ex.pieces], dim)
    halo_grads = {tag: g for tag, (p, g) in enumerate(zip(ex.pieces, grads)) if _is_remote(p, ex)}
    grad_x = _return_halo_grads(ex, comm, dim, grad_assembled.new_zeros(x_shape), halo_grads)
    for piece, g in zip(ex.pieces, grads):
        if piece.owner == ex.part:
            _add_rows(grad_x, dim, piece.indices, ex.lo, g)
    return grad_x


class _HaloExchange(torch.autograd.Function):
    """Forward: assemble ``pieces`` along ``dim`` (own rows, neighbours' rows, fill rows).
    Backward: own rows' gradients stay, halo gradients go back to their owners and are added there."""

    @staticmethod
    def forward(ctx, x, ex: DimExchange, comm: SpatialComm, dim: int, fill: float):
        halos = _exchange_forward(x, ex, comm, dim)
        out = _pieces(x, ex, dim, fill, halos)
        ctx.ex, ctx.comm, ctx.dim, ctx.shape = ex, comm, dim, x.shape
        return torch.cat(out, dim) if len(out) > 1 else out[0].clone()

    @staticmethod
    def backward(ctx, grad_out):
        return _slab_grad(ctx.ex, ctx.comm, ctx.dim, ctx.shape, grad_out.contiguous()), None, None, None, None


def _pieces(x, ex: DimExchange, dim: int, fill: float, halos: dict) -> list[torch.Tensor]:
    """The assembled rows, piece by piece: fill rows, own rows (views of ``x``), received halos."""
    out = []
    for tag, piece in enumerate(ex.pieces):
        if piece.owner is None:
            out.append(x.new_full(_shape_with(x, dim, piece.length), fill))
        elif piece.owner == ex.part:
            out.append(_rows(x, dim, piece.indices, ex.lo))
        else:
            out.append(halos[tag])
    return out


class _HaloStart(torch.autograd.Function):
    """Forward: post the exchange and return the (not yet filled) halo buffers; ``pending`` gets the
    requests, for ``_HaloWait``. Backward: the mirror exchange, blocking."""

    @staticmethod
    def forward(ctx, x, ex: DimExchange, comm: SpatialComm, dim: int, pending: list):
        requests, halos = _post_forward(x, ex, comm, dim)
        pending.extend(requests)
        ctx.ex, ctx.comm, ctx.dim, ctx.tags = ex, comm, dim, list(halos)
        ctx.shape, ctx.dtype, ctx.device = x.shape, x.dtype, x.device
        return tuple(halos.values())

    @staticmethod
    def backward(ctx, *grads):
        halo_grads = dict(zip(ctx.tags, grads))
        grad_x = torch.zeros(ctx.shape, dtype=ctx.dtype, device=ctx.device)
        return _return_halo_grads(ctx.ex, ctx.comm, ctx.dim, grad_x, halo_grads), None, None, None, None


class _HaloWait(torch.autograd.Function):
    """Forward: wait for the requests of ``_HaloStart``; the halos pass through. Backward: identity."""

    @staticmethod
    def forward(ctx, pending: list, comm: SpatialComm, *halos):
        _wait(pending, comm)
        return tuple(h.clone() for h in halos)

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *grads)


class PendingHalo:
    """An exchange in flight: ``start`` posts it, ``pieces`` waits and gives the assembled pieces."""

    def __init__(self, x, ex: DimExchange, comm: SpatialComm, dim: int, fill: float):
        self.x, self.ex, self.comm, self.dim, self.fill = x, ex, comm, dim, fill
        self._requests: list = []
        self._halos = _HaloStart.apply(x, ex, comm, dim, self._requests)

    def pieces(self) -> list[torch.Tensor]:
        halos = _HaloWait.apply(self._requests, self.comm, *self._halos)
        tags = [t for t, p in enumerate(self.ex.pieces) if _is_remote(p, self.ex)]
        return _pieces(self.x, self.ex, self.dim, self.fill, dict(zip(tags, halos)))


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


def rows_of(pieces: list[torch.Tensor], start: int, stop: int, dim: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of the concatenation of ``pieces`` along ``dim``, without building it all."""
    out, offset = [], 0
    for piece in pieces:
        length = piece.shape[dim]
        lo, hi = max(start, offset), min(stop, offset + length)
        if hi > lo:
            out.append(piece.narrow(dim, lo - offset, hi - lo))
        offset += length
    return torch.cat(out, dim) if len(out) > 1 else out[0]


class _HaloConv(torch.autograd.Function):
    """Halo exchange then convolution (no padding left along ``dim``), saving the slab and its halos
    rather than their concatenation: backward concatenates them again (a transient copy) for the
    convolution's gradients, then returns the halo gradients as ``_HaloExchange`` does. For a slab the
    caller keeps anyway (the model input) this saves a copy of it for the whole step."""

    @staticmethod
    def forward(ctx, x, weight, bias, ex: DimExchange, comm: SpatialComm, dim: int, args: tuple):
        halos = _exchange_forward(x, ex, comm, dim)
        stride, padding, dilation, groups = args
        zeros = [0] * len(stride)
        y = torch.ops.aten.convolution(torch.cat(_pieces(x, ex, dim, 0.0, halos), dim), weight, bias,
                                       stride, padding, dilation, False, zeros, groups)
        ctx.save_for_backward(x, weight, *halos.values())
        ctx.ex, ctx.comm, ctx.dim, ctx.args, ctx.tags, ctx.has_bias = ex, comm, dim, args, list(halos), bias is not None
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, *halo_list = ctx.saved_tensors
        ex, dim, (stride, padding, dilation, groups) = ctx.ex, ctx.dim, ctx.args
        assembled = torch.cat(_pieces(x, ex, dim, 0.0, dict(zip(ctx.tags, halo_list))), dim)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_in, grad_w, grad_b = torch.ops.aten.convolution_backward(
            grad_y, assembled, weight, [weight.shape[0]] if ctx.has_bias else None, stride, padding, dilation,
            False, [0] * len(stride), groups, [need_x, need_w, ctx.has_bias and need_b],
        )
        del assembled
        grad_x = _slab_grad(ex, ctx.comm, dim, x.shape, grad_in) if need_x else None
        return grad_x, grad_w, grad_b if ctx.has_bias else None, None, None, None, None


def halo_conv(x, weight, bias, ex: DimExchange, comm: SpatialComm, dim: int, stride, padding, dilation, groups):
    """``conv(halo_exchange(x), ...)`` that keeps the slab, not the slab with halos, for backward."""
    return _HaloConv.apply(x, weight, bias, ex, comm, dim, (tuple(stride), tuple(padding), tuple(dilation), groups))

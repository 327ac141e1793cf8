"""Communication: ping-pong over message sizes, the collectives over all ranks, and what a step loses per exchange
after compute; over the workers' process group (gloo on CPU workers, NCCL on GPUs), on tensors of their device."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridpar.calibrate.settings import (
    COLLECTIVES,
    SMALL_BYTES,
    SYNC_CONV_CHANNELS,
    SYNC_CONV_DEPTHS,
    SYNC_CONVS,
    Settings,
)
from hybridpar.calibrate.timing import Clock, max_over_ranks, median_time

# torch 2.13 names them *_single and deprecates the *_tensor names, which older releases have alone
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def measure_comm(settings: Settings) -> dict:
    rank = dist.get_rank()
    p2p = _ping_pong(settings, rank, Clock(settings)) if rank < 2 else []
    dist.barrier()
    return {"p2p_times": p2p, "collective_times": _collective_times(settings),
            "collective_ranks": dist.get_world_size(),
            "sync_wait": _sync_wait(settings)}


def _sync_wait(settings: Settings) -> float:
    """Seconds a step loses per exchange that follows compute, beyond the exchange's own time. For each depth
    of ``SYNC_CONV_DEPTHS`` every rank runs ``SYNC_CONVS`` convs on slabs of that depth, once with a small
    exchange after each conv (send to the next rank, receive from the one before) and once without,
    interleaved; the slowest rank's time of each, median over repeats; their difference per exchange, less
    the exchange's time when the ranks are in step. The loss is the median over the depths. It is mostly
    not the compute's spread but the wake-up of a rank's communication thread on cores its peers keep busy
    (about a millisecond on 2 workers whether a conv takes 0.3 or 10 ms; on 4 workers sharing 2 cores, a
    turn of the scheduler), and both ranks lose it: a step's loss, not one rank's wait."""
    rank, n, device, clock = dist.get_rank(), dist.get_world_size(), settings.device, Clock(settings)
    channels = SYNC_CONV_CHANNELS
    w = torch.randn(channels, channels, 3, 3, 3, device=device) / (channels * 27) ** 0.5
    send, recv = torch.zeros(SMALL_BYTES // 4, device=device), torch.empty(SMALL_BYTES // 4, device=device)
    # one batch (NCCL runs a send and a receive together; gloo, as before, one after the other)
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % n), dist.P2POp(dist.irecv, recv, (rank - 1) % n)]

    def exchange() -> None:
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    def sequence(slabs: list[torch.Tensor], with_exchanges: bool) -> float:
        dist.barrier()
        clock.start()
        for x in slabs:
            F.conv3d(x, w, padding=1)
            if with_exchanges:
                exchange()
        return max_over_ranks(clock.stop(), device)

    in_step = max_over_ranks(median_time(exchange, clock, settings.repeats, inner=settings.max_inner), device)
    losses = []
    for depth in SYNC_CONV_DEPTHS:
        slabs = [torch.randn(2, channels, depth, 32, 32, device=device) for _ in range(SYNC_CONVS)]
        sequence(slabs, True)
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(settings.repeats * 2):
            for with_exchanges in (False, True):
                times[with_exchanges].append(sequence(slabs, with_exchanges))
        losses.append((statistics.median(times[True]) - statistics.median(times[False])) / SYNC_CONVS - in_step)
    return max(0.0, statistics.median(losses))


def _inner(settings: Settings, nbytes: int) -> int:
    """Timed operations per repeat: many for small messages, one for messages of 1 MiB and more."""
    return max(1, min(settings.max_inner, 2**20 // nbytes))


def _ping_pong(settings: Settings, rank: int, clock: Clock) -> list[float]:
    """One-way seconds per message size between ranks 0 and 1: the median round trip, halved."""
    times = []
    for nbytes in settings.sizes:
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=settings.device)

        def round_trip():
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        times.append(median_time(round_trip, clock, settings.repeats * _inner(settings, nbytes), sync=False) / 2)
    return times


def _collective_times(settings: Settings) -> dict[str, list[float]]:
    """Seconds per all-reduce, all-gather and reduce-scatter of each size (the whole tensor's bytes)."""
    n, clock = dist.get_world_size(), Clock(settings)
    times: dict[str, list[float]] = {kind: [] for kind in COLLECTIVES}
    for nbytes in settings.sizes:
        whole = torch.zeros(max(n, nbytes // 4 // n * n), dtype=torch.float32, device=settings.device)
        part = torch.zeros(len(whole) // n, dtype=torch.float32, device=settings.device)
        ops = {"all_reduce": lambda: dist.all_reduce(whole),
               "all_gather": lambda: ALL_GATHER(whole, part),
               "reduce_scatter": lambda: REDUCE_SCATTER(part, whole)}
        for kind, op in ops.items():
            times[kind].append(median_time(op, clock, settings.repeats, inner=_inner(settings, nbytes)))
    return times

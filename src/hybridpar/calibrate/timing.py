"""Timing every worker at once: interleaved repeats after barriers, runs of calls long enough for a shared core,
medians over ranks."""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from hybridpar.calibrate.settings import FLUSH_BYTES, SHARED_CORE_SECONDS, Settings


def _interleaved_times(fns, repeats: int, warmup: int = 2) -> list[list[float]]:
    """Seconds of each ``fn()`` per repeat; each repeat starts on all ranks together (a barrier, not timed)
    with the caches cold (``FLUSH_BYTES`` written first, not timed): in a training step a layer's weights
    and most of its data come from memory, not from the caches its last call left warm. Where the workers'
    threads outnumber the cores, a repeat times back-to-back calls for at least ``SHARED_CORE_SECONDS`` (the
    mean of a call over the workers' turns on the cores, what a training step sees) instead of one call.
    A worker done with its timed calls keeps calling ``fn`` until all are (``_keep_busy``)."""
    calls = []
    for fn in fns:
        for _ in range(warmup):
            start = time.perf_counter()
            fn()
        calls.append(max(1, math.ceil(SHARED_CORE_SECONDS / (time.perf_counter() - start))) if _shares_cores() else 1)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8)
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, inner, samples in zip(fns, calls, times):
            flush.fill_(1)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - start) / inner)
            _keep_busy(fn)
    return times


def _keep_busy(fn) -> None:
    """Call ``fn`` (untimed) until every worker has finished its timed calls: a worker that stopped early
    would leave the others more of the cores and of the memory bandwidth than a training step does, where
    all work at once (on 4 workers sharing 2 cores a conv timed without this measured 10-25% fast)."""
    if dist.get_world_size() == 1:
        return
    done = dist.barrier(async_op=True)
    while not done.is_completed():
        fn()
    done.wait()


def _shares_cores() -> bool:
    """Whether this machine's workers, with all their threads, outnumber its cores."""
    return dist.get_world_size() * torch.get_num_threads() > len(os.sched_getaffinity(0))


def median_time(fn, repeats: int, warmup: int = 2, inner: int = 1, sync: bool = True) -> float:
    """Median seconds of one ``fn()`` over ``repeats x inner`` calls, each timed alone. With ``sync`` every
    repeat starts on all ranks together (a barrier, not timed). The median, not the mean, so that a moment
    when the machine was busy with something else does not set the number."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync:
            dist.barrier()
        for _ in range(inner):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _median_over_ranks(values: list[float]) -> list[float]:
    mine = torch.tensor(values, dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [statistics.median(column) for column in torch.stack(gathered).T.tolist()]


def max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def timed_rates(steps: list[tuple[float, Callable]], settings: Settings) -> list[float]:
    """``work / seconds`` of each ``(work, fn)`` (FLOPs or bytes): the median over repeats
    (``_interleaved_times``), then the median over ranks."""
    times = _interleaved_times([fn for _, fn in steps], settings.repeats)
    return _median_over_ranks([work / statistics.median(t) for (work, _), t in zip(steps, times)])

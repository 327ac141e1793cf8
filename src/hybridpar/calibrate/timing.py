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


class Clock:
    """Seconds from ``start()`` to ``stop()``, by the method's timer: the host's ``perf_counter``, or CUDA events
    on the current stream, ``stop`` waiting for the end event (a kernel runs after its launch has returned, so
    the host's clock alone would time the launches)."""

    def __init__(self, settings: Settings):
        self._events = settings.method.timer == "cuda_events"
        if self._events:
            self._begin, self._end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        self._started = 0.0

    def start(self) -> None:
        if self._events:
            self._begin.record()
        else:
            self._started = time.perf_counter()

    def stop(self) -> float:
        if not self._events:
            return time.perf_counter() - self._started
        self._end.record()
        self._end.synchronize()
        return self._begin.elapsed_time(self._end) / 1e3  # milliseconds


def _interleaved_times(fns, settings: Settings, warmup: int = 2) -> list[list[float]]:
    """Seconds of each ``fn()`` per repeat; each repeat starts on all ranks together (a barrier, not timed).
    On CPU workers (``Method.flush_caches``, ``Method.shares_host``) the caches are cold (``FLUSH_BYTES`` written
    first, not timed): in a training step a layer's weights and most of its data come from memory, not from the
    caches its last call left warm. Where the workers' threads outnumber the cores, a repeat times back-to-back
    calls for at least ``SHARED_CORE_SECONDS`` (the mean of a call over the workers' turns on the cores, what a
    training step sees) instead of one call. A worker done with its timed calls keeps calling ``fn`` until all
    are (``_keep_busy``)."""
    method, clock = settings.method, Clock(settings)
    shared = method.shares_host and _shares_cores()
    calls = [_warm_up(fn, warmup, clock, shared) for fn in fns]
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8) if method.flush_caches else None
    times = [[] for _ in fns]
    for _ in range(settings.repeats):
        for fn, inner, samples in zip(fns, calls, times):
            if flush is not None:
                flush.fill_(1)
            dist.barrier()
            clock.start()
            for _ in range(inner):
                fn()
            samples.append(clock.stop() / inner)
            if method.shares_host:
                _keep_busy(fn)
    return times


def _warm_up(fn, warmup: int, clock: Clock, shared: bool) -> int:
    """Call ``fn`` ``warmup`` times; the calls a timed repeat makes: one, or on shared cores enough for
    ``SHARED_CORE_SECONDS`` at the last warm-up call's time."""
    for _ in range(warmup):
        clock.start()
        fn()
        seconds = clock.stop()
    return max(1, math.ceil(SHARED_CORE_SECONDS / seconds)) if shared else 1


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


def median_time(fn, clock: Clock, repeats: int, warmup: int = 2, inner: int = 1, sync: bool = True) -> float:
    """Median seconds of one ``fn()`` over ``repeats x inner`` calls, each timed alone by ``clock``. With
    ``sync`` every repeat starts on all ranks together (a barrier, not timed). The median, not the mean, so
    that a moment when the machine was busy with something else does not set the number."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if sync:
            dist.barrier()
        for _ in range(inner):
            clock.start()
            fn()
            times.append(clock.stop())
    return statistics.median(times)


def _median_over_ranks(values: list[float], device: str) -> list[float]:
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [statistics.median(column) for column in torch.stack(gathered).T.tolist()]


def max_over_ranks(value: float, device: str) -> float:
    """The largest ``value`` of all ranks (reduced on ``device``: NCCL reduces GPU tensors only)."""
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def timed_rates(steps: list[tuple[float, Callable]], settings: Settings) -> list[float]:
    """``work / seconds`` of each ``(work, fn)`` (FLOPs or bytes): the median over repeats
    (``_interleaved_times``), then the median over ranks."""
    times = _interleaved_times([fn for _, fn in steps], settings)
    return _median_over_ranks([work / statistics.median(t) for (work, _), t in zip(steps, times)], settings.device)

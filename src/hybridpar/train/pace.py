"""Fail-slow detection (ResiHP): a rank that does not die but runs slowly (thermal throttling, a noisy neighbour)
holds back every synchronous step. Each rank times its forward pass less the time it waited for halos (what a
slower neighbour costs it), per unit of its work (``hybridpar.plan.sizing.rank_work``: its share of the batch
and of the volume, so that uneven shares and slabs compare fairly). Every ``train.slow_window`` steps one small
all-gather gives every rank every rank's median of the window; a rank whose time per unit of work (over the
speed the plan was sized for) is ``train.slow_factor`` times the median of its peers', by at least ``MATTERS`` of
its step, in ``PATIENCE`` windows in a row is reported, with its factor, the same on every rank. The speeds
measured then size the rebalanced plan (``train.rebalance``), against which the next windows are measured.

The forward pass is the measure because it waits for nobody under DDP (the gradients' all-reduce runs in the
backward) nor in a pipeline stage (its receives come before). Under tensor parallelism or FSDP the forward's own
collectives make the fast ranks wait for the slow one inside their forward, which shrinks the factors.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridpar.plan import sizing

PATIENCE = 2  # windows in a row over the factor before a rank is reported
# ... and over by this share of its step at least: a forward that long past its expectation holds the step back
# (its backward with it); below, timing noise on shared cores dominates, and there is little to gain
MATTERS = 0.05


@dataclass(frozen=True)
class Window:
    """What one window showed, the same on every rank: per rank the median forward seconds (halo waits left
    out), halo wait seconds and step seconds, and each rank's factor (its forward time per unit of work over
    the median of its peers'); ``slow``: the ranks reported in this window (``rank: factor``)."""

    step: int
    compute_s: tuple[float, ...]
    wait_s: tuple[float, ...]
    step_s: tuple[float, ...]
    factors: tuple[float, ...]
    slow: dict
    speeds: tuple[float, ...]  # each rank's speed as measured (relative to the fastest)
    peak: tuple[float, ...] = ()  # each rank's peak of allocated bytes in the window (0: not known)
    capacity: tuple[float, ...] = ()  # each rank's device bytes (0: not known)

    def record(self) -> dict:
        return {"step": self.step, "split": "pace", "compute_s": list(self.compute_s), "halo_wait_s":
                list(self.wait_s), "step_s": list(self.step_s), "factor": [round(f, 3) for f in self.factors],
                "speed": [round(s, 3) for s in self.speeds]}


class Pace:
    """The timing of one rank's steps under ``plan``, hooked onto the parallel model's modules. ``speeds``: each
    rank's speed the plan was sized for (``None``: all alike; a mixed cluster's, ``planning.cluster_speeds``); a
    rank's time is expected to go as its work over its speed (with ``layers``, a pipeline stage's FLOPs count),
    and a factor is the measured time over that expectation, over its peers'."""

    def __init__(self, config, plan, parallel, speeds: tuple[float, ...] | None = None,
                 layers: sizing.Layers | None = None):
        self.window, self.threshold = config.train.slow_window, config.train.slow_factor
        work = [sizing.rank_work(plan, r, layers) for r in range(dist.get_world_size())]
        self.speeds = speeds or (1.0,) * len(work)
        self.expected = [w / s for w, s in zip(work, self.speeds, strict=True)]
        self.device = parallel.device
        self._halos = exchange_counters(parallel)[0]
        self._spans: list = []  # this step's forwards: (start, end, halo wait); on a GPU, CUDA events
        self._begin, self._wait = None, 0.0
        self._step_begin = self._step_wait = 0.0
        self._steps: list[tuple[float, float, float]] = []
        self._warm = False  # the first step (allocations, DDP's first buckets) is not timed
        self._strikes = [0] * dist.get_world_size()
        self.reported: dict[int, float] = {}
        self._handles = []
        for module in parallel.computing_modules():
            self._handles += [module.register_forward_pre_hook(self._before),
                              module.register_forward_hook(self._after)]

    def _mark(self):
        """Now: on a GPU a CUDA event in the stream (read once the step has synchronised, so the forward is not
        held up), else the host's clock."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _halo_wait(self) -> float:
        return self._halos.wait_s if self._halos is not None else 0.0

    def _before(self, module, args) -> None:
        self._begin, self._wait = self._mark(), self._halo_wait()

    def _after(self, module, args, output) -> None:
        self._spans.append((self._begin, self._mark(), self._halo_wait() - self._wait))

    def _forward(self) -> float:
        """Seconds of this step's forwards, less their halo waits."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the step's loss has synchronised already: this waits for nothing
            return sum(a.elapsed_time(b) / 1e3 - wait for a, b, wait in self._spans)
        return sum(b - a - wait for a, b, wait in self._spans)

    def begin(self) -> None:
        """A step starts (what ran since the last step, a validation, is not its time)."""
        self._spans.clear()
        self._step_begin, self._step_wait = time.perf_counter(), self._halo_wait()

    def end(self, step: int) -> Window | None:
        """Step ``step`` ended; at the end of each window of steps (the first step of a plan left out: it allocates
        and warms up), what every rank measured (one all-gather: collective, on every rank after the same number
        of steps)."""
        if self._warm:
            forward = self._forward()
            self._steps.append((forward, self._halo_wait() - self._step_wait, time.perf_counter() - self._step_begin))
        self._warm = True
        if len(self._steps) < self.window:
            return None
        mine = [statistics.median(column) for column in zip(*self._steps, strict=True)] + list(self._memory())
        self._steps.clear()
        gathered = [torch.zeros(5, dtype=torch.float64, device=self.device) for _ in self.expected]
        dist.all_gather(gathered, torch.tensor(mine, dtype=torch.float64, device=self.device))
        compute, wait, step_s, peak, capacity = (tuple(float(g[i]) for g in gathered) for i in range(5))
        factors = _factors([c / e for c, e in zip(compute, self.expected, strict=True)])
        slow = {}
        for rank, factor in enumerate(factors):
            # over the factor, and its forward past what its peers' pace expects of it by MATTERS of its step
            over = factor > self.threshold and compute[rank] * (1 - 1 / factor) >= MATTERS * step_s[rank]
            self._strikes[rank] = self._strikes[rank] + 1 if over else 0
            if self._strikes[rank] >= PATIENCE and rank not in self.reported:
                slow[rank] = self.reported[rank] = factor
        # only a rank reported slow changes speed: the others' spread is within the factor, which is noise
        measured = [s / factors[r] if r in self.reported else s for r, s in enumerate(self.speeds)]
        return Window(step, compute, wait, step_s, factors, slow, tuple(s / max(measured) for s in measured),
                      peak, capacity)

    def _memory(self) -> tuple[float, float]:
        """This rank's peak of allocated bytes since the last window and its device's bytes (on a GPU; ``0, 0``
        elsewhere: no limit known)."""
        if self.device.type != "cuda":
            return 0.0, 0.0
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return float(peak), float(torch.cuda.get_device_properties(self.device).total_memory)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _factors(per_work: list[float]) -> tuple[float, ...]:
    """Each rank's time per unit of work over the median of its peers' (1 for a single rank)."""
    if len(per_work) == 1:
        return (1.0,)
    return tuple(t / max(statistics.median(per_work[:r] + per_work[r + 1:]), 1e-12)
                 for r, t in enumerate(per_work))


def exchange_counters(parallel) -> tuple:
    """The counters of ``parallel``'s exchanges: its spatial layers' halo counters (``None`` without spatial
    layers) and its DDP all-reduces' clocks (``hybridpar.parallel.data.BucketClock``)."""
    from hybridpar.errors import UnsupportedModuleError
    from hybridpar.parallel.data import bucket_clock
    from hybridpar.spatial import exchange_stats

    halos = None
    for module in parallel.modules.values():
        try:
            halos = exchange_stats(module)
            break
        except UnsupportedModuleError:
            continue
    return halos, [c for c in map(bucket_clock, parallel.modules.values()) if c is not None]

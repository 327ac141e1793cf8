"""``hybridpar calibrate``: this machine, split into N worker processes, measured as a ClusterSpec.

The N workers (``launch_local``, gloo on loopback, ``cores // N`` torch threads each) run every compute
measurement at the same moment, so one "device" of the spec is one worker while the other N - 1 work too:
oversubscription and shared memory bandwidth are measured, not assumed. Per worker, after warm-up:

- matmul (1024 x 1024 @ 1024 x 1024, 2 M N K FLOPs) -> ``peak_flops[dtype]``, so ``efficiency.matmul = 1``;
- conv3d forward + backward on (2, 16, 32^3), 16 -> 16 channels, k = 3 (backward = 2 x forward FLOPs)
  -> ``efficiency.conv`` = conv / matmul throughput;
- conv3d (k = 3, batch 2) on the grid ``CONV_GRID`` of input channels x output channels x output positions:
  forward, forward + backward, forward + backward of the weight alone -> ``conv_rates`` rows, FLOP/s of the
  forward, the input gradient and the weight gradient (on CPUs a thin conv runs at a tenth of a wide one's
  rate, a weight gradient from few channels slower still; the planner interpolates in log2 of all three);
  one more positions row, ``LARGE_FACTOR`` times the largest, measured for the pairs of at most
  ``LARGE_CHANNELS`` channels in and out (the thin layers of large volumes) and scaled for the others from
  the nearest measured pair;
- the same passes of a batch-1 conv on PyTorch's slow CPU kernel (what it runs one sample of small ``N·C·D·H``
  on; called by name, ``aten.slow_conv3d``, to reach it everywhere) over ``SLOW_CONV_GRID`` -> ``slow_conv_rates``:
  its rate against the fast kernel's ranges from a tenth (thin channels, large volumes) to about one;
- ``a + b`` on 64 MiB tensors into a fresh output (3 x 64 MiB moved) -> ``memory_bandwidth``: eager training
  writes every activation to a new tensor, so first-touch page faults are part of the bandwidth it sees;
- the memory-bound layers of ``OP_BENCHMARKS`` (pooling, normalisation, activations, a stride-2 transposed
  conv, ``add``, ``cat``), forward and forward + backward -> ``op_rates``: bytes/s of the bytes the planner's
  model analysis counts for the layer.

Each timed repeat starts after a barrier; a worker's number is the median of its repeats, the machine's the
median over workers. Where the workers' threads outnumber the cores (``--nproc 4`` on 2 cores), a repeat
times a run of back-to-back calls of at least ``SHARED_CORE_SECONDS``: a call shorter than the scheduler's
turn would often run whole in one turn and time as if it had a core of its own.
A worker done with its timed calls keeps computing, untimed, until all are: all work at once, as in a
training step.

Communication: ping-pong between ranks 0 and 1 over message sizes, fitted to ``latency + bytes /
bandwidth``; all-reduce over all N ranks, fitted to the ring model ``2(N-1) step_latency + 2(N-1)/N bytes /
bus_bandwidth``, and all-gather and reduce-scatter to half of it, each with its own rates (on gloo a
reduce-scatter takes longer than an all-reduce); what a step loses per exchange that follows compute
(``sync_wait``, ``_sync_wait``). With N = 1 there is nobody to talk to: compute is measured by one worker
alone, communication by a second launch of 2 workers (and ``sync_wait`` is 0). One machine has no
inter-node link: ``inter_node`` is a copy of ``intra_node`` (said in the TOML file's header).
"""

from __future__ import annotations

import datetime
import itertools
import math
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hybridpar.errors import HybridparError
from hybridpar.launch import init_distributed, launch_local, shutdown_distributed
from hybridpar.plan.cluster import ClusterSpec, ConvRate, Link, OpRate
from hybridpar.plan.cost import MEASURED_KERNEL

DTYPES = ("float32", "float64")
MATMUL_EDGE = 1024
CONV_INPUT = (2, 16, 32, 32, 32)  # (N, C, D, H, W): big enough for the mkldnn path in float32
CONV_KERNEL = MEASURED_KERNEL  # the planner reads the conv rates as those of this kernel width
MEMORY_BYTES = 64 * 2**20  # per tensor of the elementwise add
GLIBC_MMAP_CEILING = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit (_allocate_as_in_training)
FLUSH_BYTES = 64 * 2**20  # written before each timed call: more than the last-level caches of most CPUs
# conv_rates: in channels x out channels x output positions (batch 2: PyTorch's fast CPU kernel)
CONV_GRID = ((1, 4, 8, 16, 64), (4, 8, 16, 64), (2**11, 2**14, 2**17))
CONV_GRID_QUICK = ((1, 16), (4, 64), (2**11, 2**14))
# One more positions row, LARGE_FACTOR x the grid's largest (where the caches give out): measured for the channel
# pairs up to LARGE_CHANNELS in and out (a large volume's layers are thin, and these take seconds), the wider
# pairs' largest rows scaled by what the step costs the nearest measured pair (measured, they would take minutes;
# the step costs 16 -> 16 a third of its rate and 4 -> 16 nothing, so one reference pair for all misprices)
LARGE_FACTOR = 8
LARGE_CHANNELS = 16
# slow_conv_rates: the same axes for a batch of 1 on the slow kernel (its domain, N*C*D*H <= FAST_CONV_MIN, holds
# smaller volumes than the fast grid's)
SLOW_CONV_GRID = ((1, 4, 8, 16, 64), (4, 8, 16, 64), (2**10, 2**13, 2**16))
SLOW_CONV_GRID_QUICK = ((1, 16), (4, 64), (2**10, 2**13))


class _Join(nn.Module):
    """A tensor operation between modules, ``x + x`` or ``cat([x, x])``, after an ``Identity`` (a container, so
    that the model analysis sees the operation as a layer of its own, as in a real model)."""

    def __init__(self, fn):
        super().__init__()
        self.source = nn.Identity()
        self.fn = fn

    def forward(self, x):
        return self.fn(self.source(x))


# Sizes of the memory-bound layers measured, by (quick, large): an (N, C, D, H, W) volume of 4 MiB of float32
# (past the L2 caches, inside a large L3) and one of 32 MiB (past the caches); rows of a transformer.
VOLUMES = {(False, False): (2, 16, 32, 32, 32), (False, True): (4, 16, 64, 64, 32),
           (True, False): (2, 16, 16, 16, 16), (True, True): (2, 16, 32, 32, 32)}
ROWS = {(False, False): (1024, 1024), (False, True): (4096, 2048), (True, False): (256, 256), (True, True): (1024, 1024)}


def _half(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape[:2] + tuple(n // 2 for n in shape[2:])


# The memory-bound layers measured for `op_rates`, each ``(quick, large) -> (module, input shape)``: pooling and
# normalisation run below the memory bandwidth on CPUs, and so do a transposed conv of stride 2 and a 1x1 conv.
OP_BENCHMARKS = (
    lambda k: (nn.MaxPool3d(2), VOLUMES[k]),
    lambda k: (nn.AvgPool3d(2), VOLUMES[k]),
    lambda k: (nn.AdaptiveAvgPool3d(1), VOLUMES[k]),
    lambda k: (nn.BatchNorm3d(16), VOLUMES[k]),
    lambda k: (nn.InstanceNorm3d(16), VOLUMES[k]),
    lambda k: (nn.GroupNorm(4, 16), VOLUMES[k]),
    lambda k: (nn.ReLU(), VOLUMES[k]),
    lambda k: (nn.LeakyReLU(0.3), VOLUMES[k]),
    lambda k: (nn.ConvTranspose3d(16, 16, 2, stride=2), _half(VOLUMES[k])),
    lambda k: (nn.Conv3d(16, 4, 1), VOLUMES[k]),
    lambda k: (_Join(lambda x: x + x), VOLUMES[k]),
    lambda k: (_Join(lambda x: torch.cat([x, x], 1)), VOLUMES[k]),
    lambda k: (nn.LayerNorm(ROWS[k][1]), ROWS[k]),
    lambda k: (nn.GELU(), ROWS[k]),
)
FAST_CONV_MIN = 20480  # PyTorch's CPU rule: a batch of 1 takes oneDNN only when N*C*D*H of the input exceeds this
SMALL_BYTES = 256  # messages up to this size give the latency
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
# torch 2.13 names them *_single and deprecates the *_tensor names, which older releases have alone
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
# _sync_wait's sequences: SYNC_CONVS convs on slabs (2, C, depth, 32, 32) of one depth each, about 0.3 to
# 10 ms a conv on one core (the compute between a spatial step's exchanges)
SYNC_CONV_CHANNELS = 16
SYNC_CONV_DEPTHS = (2, 4, 8, 16, 32)
SYNC_CONVS = 8
# On more worker threads than cores a worker runs in turns with another: a call shorter than the scheduler's
# turn (a few ms) often runs whole in one turn, so calls are timed in runs of at least this long
SHARED_CORE_SECONDS = 0.03


@dataclass(frozen=True)
class Settings:
    dtype: str = "float32"
    quick: bool = False

    @property
    def repeats(self) -> int:
        return 3 if self.quick else 7

    @property
    def max_inner(self) -> int:
        """Timed operations per repeat for the smallest messages (each takes microseconds)."""
        return 10 if self.quick else 50

    @property
    def conv_grid(self) -> tuple[tuple[int, int, int], ...]:
        """(in channels, out channels, output positions) of the measured convs: every combination."""
        grid = CONV_GRID_QUICK if self.quick else CONV_GRID
        return tuple(itertools.product(*grid))

    @property
    def largest_positions(self) -> int:
        return max(p[2] for p in self.conv_grid)

    @property
    def large_conv_pairs(self) -> tuple[tuple[int, int], ...]:
        """The (in, out) channel pairs measured at ``LARGE_FACTOR`` times the largest positions."""
        return tuple(sorted({(cin, cout) for cin, cout, _ in self.conv_grid
                             if cin <= LARGE_CHANNELS and cout <= LARGE_CHANNELS}))

    @property
    def slow_conv_grid(self) -> tuple[tuple[int, int, int], ...]:
        return tuple(itertools.product(*(SLOW_CONV_GRID_QUICK if self.quick else SLOW_CONV_GRID)))

    @property
    def sizes(self) -> tuple[int, ...]:
        """Message sizes in bytes: 4 B to 64 MiB, by 16x (quick) or 4x."""
        return tuple(4 * 16**i for i in range(7)) if self.quick else tuple(4 * 4**i for i in range(13))


@dataclass(frozen=True)
class Calibration:
    spec: ClusterSpec
    matmul_flops: float  # FLOP/s of one worker while all run
    conv_flops: float
    sizes: tuple[int, ...]  # message bytes
    p2p_times: tuple[float, ...]  # one-way seconds per size
    collective_times: dict[str, tuple[float, ...]]  # COLLECTIVES -> seconds per collective of that many bytes
    collective_ranks: int
    notes: tuple[str, ...]
    comment: str  # the header of the TOML file


def calibrate(nproc: int, dtype: str = "float32", quick: bool = False) -> Calibration:
    """Measure this machine as ``nproc`` devices (see the module docstring)."""
    if dtype not in DTYPES:
        raise HybridparError(f"--dtype {dtype}: calibrate measures {', '.join(DTYPES)}")
    if nproc < 1:
        raise HybridparError(f"--nproc {nproc}: give at least 1 worker process")
    settings = Settings(dtype, quick)
    notes = ["inter_node = intra_node: one machine, no link between nodes was measured"]
    if nproc >= 2:
        result = launch_local(worker, (settings, ("compute", "comm")), nproc)[0]
    else:
        result = launch_local(worker, (settings, ("compute",)), 1)[0]
        comm = launch_local(worker, (settings, ("comm",)), 2)[0]
        result |= {k: v for k, v in comm.items() if k != "reserved_memory"}
        notes.append("--nproc 1: communication measured between 2 extra worker processes")
    return _calibration(result, nproc, settings, notes)


def worker(settings: Settings, phases: tuple[str, ...]) -> dict | None:
    """One worker: measures ``phases`` ("compute", "comm") with the others; rank 0 returns the numbers."""
    init_distributed()
    rank = dist.get_rank()
    try:
        result = {"reserved_memory": _max_over_ranks(_runtime_rss_bytes())}
        _allocate_as_in_training()  # for every phase: sync_wait's convs allocate too
        if "compute" in phases:
            result |= _measure_compute(settings)
        if "comm" in phases:
            result |= _measure_comm(settings)
    finally:
        shutdown_distributed()
    return result if rank == 0 else None


def _measure_compute(settings: Settings) -> dict:
    """Throughputs of matmul, conv3d (one wide conv, the ``conv_rates`` grid and its large row, the slow
    batch-1 kernel), an elementwise add and the memory-bound ops of ``OP_BENCHMARKS``. Each group is
    measured with its repeats interleaved, so that a slow moment of the machine slows a group's points
    alike, and its tensors are freed before the next group's are made (all at once, 4 workers outgrew this
    machine's 24 GiB). Each backward pass is timed alone, on a forward kept for it."""
    dtype = getattr(torch, settings.dtype)
    torch.manual_seed(dist.get_rank())
    matmul, conv, memory = _rates(_basic_steps(dtype), settings)
    result = {"matmul_flops": matmul, "conv_flops": conv, "memory_bandwidth": memory}
    rates = dict(zip(settings.conv_grid, _conv_rates(settings.conv_grid, dtype, settings)))
    large_points = [(cin, cout, LARGE_FACTOR * settings.largest_positions) for cin, cout in settings.large_conv_pairs]
    large = dict(zip(settings.large_conv_pairs, _conv_rates(large_points, dtype, settings)))
    result["conv_rates"] = [(*point, *r) for point, r in rates.items()] + _large_row(settings, rates, large)
    slow = _conv_rates(settings.slow_conv_grid, dtype, settings, batch=1)
    result["slow_conv_rates"] = [(*point, *r) for point, r in zip(settings.slow_conv_grid, slow)]
    ops = [_op_steps(make, (settings.quick, big), dtype) for make in OP_BENCHMARKS for big in (False, True)]
    op_rates = iter(_rates([step for _, steps in ops for step in steps], settings))
    result["op_rates"] = [(*op, next(op_rates), next(op_rates)) for op, _ in ops]
    return result


def _allocate_as_in_training() -> None:
    """Put glibc's allocator where a training worker's is after its first step. glibc maps every block above
    its threshold afresh (each page then faults on first touch) and raises the threshold to a freed mapped
    block's size, up to ``GLIBC_MMAP_CEILING``: after one step of freed activations, tensors up to the ceiling
    come back warm from the heap, larger ones are mapped and faulted in at every step. A worker that has not
    freed a large block yet maps each fresh output instead: a 16 -> 16 conv over 2^17 positions measured
    180-250 GFLOP/s so, 350 with the threshold raised, 300 inside a training step (page faults are system
    time, and dear on a virtual machine).

    Freeing one mapped block just under the ceiling raises the threshold (and the heap's trim threshold to
    twice it). Raised alone, it left every other fresh process faulting anyway: the heap had not grown yet,
    so an output came from new pages at its top, and once a small allocation landed above a freed output, the
    next output of that size (an aligned request, a few bytes larger than the freed chunk) grew the heap
    again. So the heap is then grown by two blocks under the threshold, touched and freed: it keeps their
    pages (below the trim threshold), and outputs come from them as in a step that has run once."""
    torch.empty(GLIBC_MMAP_CEILING - 2**20, dtype=torch.uint8).fill_(0)
    blocks = [torch.empty(GLIBC_MMAP_CEILING - 3 * 2**20, dtype=torch.uint8).fill_(0) for _ in range(2)]
    del blocks


def _rates(steps: list[tuple[float, Callable]], settings: Settings) -> list[float]:
    """``work / seconds`` of each ``(work, fn)`` (FLOPs or bytes): the median over repeats
    (``_interleaved_times``), then the median over ranks."""
    times = _interleaved_times([fn for _, fn in steps], settings.repeats)
    return _median_over_ranks([work / statistics.median(t) for (work, _), t in zip(steps, times)])


def _basic_steps(dtype: torch.dtype) -> list[tuple[float, Callable]]:
    """A matmul (FLOPs), one wide conv forward and backward (FLOPs) and an add into a fresh tensor (bytes)."""
    n = MATMUL_EDGE
    a, b, c = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype), torch.empty(n, n, dtype=dtype)
    x, y = (torch.ones(MEMORY_BYTES // a.element_size(), dtype=dtype) for _ in range(2))
    return [(2 * n**3, lambda: torch.mm(a, b, out=c)), _conv_step(dtype), (3 * MEMORY_BYTES, lambda: torch.add(x, y))]


def _conv_rates(points, dtype: torch.dtype, settings: Settings, batch: int = 2) -> list[tuple[float, float, float]]:
    """FLOP/s of the forward, input gradient and weight gradient of a conv at each (in, out, positions)."""
    steps = []
    for point in points:
        flops, fns = _conv_steps(*point, dtype, batch=batch)
        steps += [(flops, fn) for fn in fns]
    rates = _rates(steps, settings)
    return [tuple(rates[i:i + 3]) for i in range(0, len(rates), 3)]


def _large_row(settings: Settings, rates: dict, measured: dict) -> list[tuple]:
    """The ``conv_rates`` rows at ``LARGE_FACTOR`` times the grid's largest positions: ``measured`` (in, out) pairs
    as measured, every other pair its largest row scaled by what the step costs the measured pair nearest in log2
    of both channel counts."""
    largest = settings.largest_positions
    rows = []
    for cin, cout, positions in settings.conv_grid:
        if positions != largest:
            continue
        if (cin, cout) in measured:
            rows.append((cin, cout, LARGE_FACTOR * largest, *measured[cin, cout]))
            continue
        near = min(measured, key=lambda p: abs(math.log2(p[0] / cin)) + abs(math.log2(p[1] / cout)))
        ratios = (b / a for a, b in zip(rates[(*near, largest)], measured[near]))
        rows.append((cin, cout, LARGE_FACTOR * largest, *(r * q for r, q in zip(rates[cin, cout, largest], ratios))))
    return rows


def _conv_steps(in_channels: int, out_channels: int, positions: int, dtype: torch.dtype, batch: int = 2):
    """Forward FLOPs of a 3x3x3 conv from ``in_channels`` to ``out_channels`` over ``positions`` output
    positions in a batch of ``batch`` (two: PyTorch's fast CPU kernel; one: its slow kernel, called by name so
    that it runs at every size), and three timed functions: its forward, its input gradient, its weight
    gradient (each backward alone, on a forward kept for it)."""
    dims = _conv_dims(positions // batch)
    x = torch.randn(batch, in_channels, *dims, dtype=dtype)
    k = CONV_KERNEL
    w = torch.randn(out_channels, in_channels, k, k, k, dtype=dtype) / (in_channels * k**3) ** 0.5
    grad_out = torch.randn(batch, out_channels, *dims, dtype=dtype)
    flops = 2 * batch * math.prod(dims) * out_channels * in_channels * k**3

    def conv(x, w):
        if batch == 1:  # what F.conv3d runs for one sample of small N*C*D*H
            return torch.ops.aten.slow_conv3d(x, w, [k] * 3, None, [1] * 3, [k // 2] * 3)
        return F.conv3d(x, w, padding=k // 2)

    return flops, [lambda: conv(x, w), *_backward_steps(conv, (x, w), grad_out, separate=True)]


def _backward_steps(fn, inputs, grad_out, separate: bool) -> list:
    """Timed backward passes of ``fn(*inputs)``, on one forward kept for them: the gradient of each input
    apart (``separate``) or of all of them at once."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    groups = [(t,) for t in leaves] if separate else [tuple(leaves)]
    return [lambda wrt=wrt: torch.autograd.grad(out, wrt, grad_out, retain_graph=True) for wrt in groups]


def _conv_dims(volume: int) -> tuple[int, int, int]:
    """A (D, H, W) of ``volume`` (a power of two) as near a cube as powers of two allow, W the longest."""
    e = round(math.log2(volume))
    d = e // 3
    return 2**d, 2 ** ((e - d) // 2), 2 ** (e - d - (e - d) // 2)


def _op_steps(make, key: tuple[bool, bool], dtype: torch.dtype):
    """The op of the (last) layer ``make(key)`` builds and the bytes its forward reads and writes, both as
    the planner's model analysis sees them, and two timed functions, each with those bytes: its forward; its
    backward (the gradients of the input and of any weight, on a forward kept for it)."""
    from hybridpar.plan.graph import analyse

    module, shape = make(key)
    module = module.to(dtype)
    layer = analyse(module, shape, dtype).layers[-1]
    x = torch.randn(shape, dtype=dtype)
    params = [p for p in module.parameters() if p.requires_grad]
    names = [name for name, p in module.named_parameters() if p.requires_grad]

    def call(x, *weights):
        return torch.func.functional_call(module, dict(zip(names, weights)), (x,))

    grad_out = torch.randn_like(module(x))
    steps = [lambda: module(x), *_backward_steps(call, [x, *params], grad_out, separate=False)]
    return (layer.op, int(layer.bytes_moved)), [(layer.bytes_moved, step) for step in steps]


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


def _conv_step(dtype: torch.dtype):
    """FLOPs and a function doing one conv3d forward and backward (input and weight gradients)."""
    batch, channels, *spatial = CONV_INPUT
    k = CONV_KERNEL
    x = torch.randn(*CONV_INPUT, dtype=dtype, requires_grad=True)
    w = (torch.randn(channels, channels, k, k, k, dtype=dtype) / (channels * k**3) ** 0.5).requires_grad_()
    grad_out = torch.randn(*CONV_INPUT, dtype=dtype)  # padding 1 keeps the spatial size
    forward = 2 * batch * channels * (spatial[0] * spatial[1] * spatial[2]) * channels * k**3

    def step():
        out = F.conv3d(x, w, padding=k // 2)
        torch.autograd.grad(out, (x, w), grad_out)

    return 3 * forward, step


def _measure_comm(settings: Settings) -> dict:
    rank = dist.get_rank()
    p2p = _ping_pong(settings, rank) if rank < 2 else []
    dist.barrier()
    return {"p2p_times": p2p, "collective_times": _collective_times(settings), "collective_ranks": dist.get_world_size(),
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
    rank, n = dist.get_rank(), dist.get_world_size()
    channels = SYNC_CONV_CHANNELS
    w = torch.randn(channels, channels, 3, 3, 3) / (channels * 27) ** 0.5
    send, recv = torch.zeros(SMALL_BYTES // 4), torch.empty(SMALL_BYTES // 4)

    def exchange() -> None:
        for request in (dist.isend(send, (rank + 1) % n), dist.irecv(recv, (rank - 1) % n)):
            request.wait()

    def sequence(slabs: list[torch.Tensor], with_exchanges: bool) -> float:
        dist.barrier()
        start = time.perf_counter()
        for x in slabs:
            F.conv3d(x, w, padding=1)
            if with_exchanges:
                exchange()
        return _max_over_ranks(time.perf_counter() - start)

    in_step = _max_over_ranks(_median_time(exchange, settings.repeats, inner=settings.max_inner))
    losses = []
    for depth in SYNC_CONV_DEPTHS:
        slabs = [torch.randn(2, channels, depth, 32, 32) for _ in range(SYNC_CONVS)]
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


def _ping_pong(settings: Settings, rank: int) -> list[float]:
    """One-way seconds per message size between ranks 0 and 1: the median round trip, halved."""
    times = []
    for nbytes in settings.sizes:
        buf = torch.zeros(nbytes, dtype=torch.uint8)

        def round_trip():
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)

        times.append(_median_time(round_trip, settings.repeats * _inner(settings, nbytes), sync=False) / 2)
    return times


def _collective_times(settings: Settings) -> dict[str, list[float]]:
    """Seconds per all-reduce, all-gather and reduce-scatter of each size (the whole tensor's bytes)."""
    n = dist.get_world_size()
    times: dict[str, list[float]] = {kind: [] for kind in COLLECTIVES}
    for nbytes in settings.sizes:
        whole = torch.zeros(max(n, nbytes // 4 // n * n), dtype=torch.float32)
        part = torch.zeros(len(whole) // n, dtype=torch.float32)
        ops = {"all_reduce": lambda: dist.all_reduce(whole),
               "all_gather": lambda: ALL_GATHER(whole, part),
               "reduce_scatter": lambda: REDUCE_SCATTER(part, whole)}
        for kind, op in ops.items():
            times[kind].append(_median_time(op, settings.repeats, inner=_inner(settings, nbytes)))
    return times


def _median_time(fn, repeats: int, warmup: int = 2, inner: int = 1, sync: bool = True) -> float:
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


def _max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def _runtime_rss_bytes() -> float:
    """The resident set of a training worker before its model: hybridpar's trainer imported (checkpointing,
    HDF5) and a DDP wrapper built (which loads torch's compiler stack and allocates communication buffers)."""
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel

    import hybridpar.train.loop  # noqa: F401  (what a training worker has loaded)

    DistributedDataParallel(nn.Linear(1, 1))
    return _rss_bytes()


def _rss_bytes() -> float:
    """This process's resident memory (VmRSS of /proc/self/status; peak RSS where there is no /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _mem_total() -> float:
    """Bytes of memory of this machine (MemTotal of /proc/meminfo)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def fit_p2p(sizes: tuple[int, ...], times: tuple[float, ...]) -> tuple[float, float]:
    """``time = latency + bytes / bandwidth``: (latency, bandwidth)."""
    return _fit(sizes, times, 1.0, "point-to-point")


def fit_ring(sizes: tuple[int, ...], times: tuple[float, ...], n: int, kind: str = "all_reduce") -> tuple[float, float]:
    """``time = k(n-1) step_latency + k(n-1)/n bytes / bus_bandwidth``, ``k = 2`` for an all-reduce and 1 for
    an all-gather or a reduce-scatter (half a ring): (step_latency, bus_bandwidth)."""
    steps = (2 if kind == "all_reduce" else 1) * (n - 1)
    latency, bandwidth = _fit(sizes, times, steps / n, kind.replace("_", "-"))
    return latency / steps, bandwidth


def _fit(sizes, times, scale: float, what: str) -> tuple[float, float]:
    """Latency: the median time of the small messages; 1 / bandwidth: the least-squares slope (through the
    origin) of the time left over against ``scale * bytes``, so the big messages set the bandwidth."""
    small = [t for b, t in zip(sizes, times) if b <= SMALL_BYTES] or [times[0]]
    latency = statistics.median(small)
    xs = [scale * b for b in sizes]
    slope = sum(x * (t - latency) for x, t in zip(xs, times)) / sum(x * x for x in xs)
    if not slope > 0:
        raise HybridparError(f"{what} times did not grow with the message size ({list(times)} s for {list(sizes)} "
                             f"bytes); the machine is probably busy: run hybridpar calibrate again")
    return latency, 1 / slope


def _calibration(result: dict, nproc: int, settings: Settings, notes: list[str]) -> Calibration:
    sizes = settings.sizes
    latency, bandwidth = fit_p2p(sizes, result["p2p_times"])
    n = result["collective_ranks"]
    rates = {kind: fit_ring(sizes, result["collective_times"][kind], n, kind) for kind in COLLECTIVES}
    (step_latency, bus_bandwidth), gather, scatter = (rates[kind] for kind in COLLECTIVES)
    conv = result["conv_flops"] / result["matmul_flops"]
    if conv > 1:
        notes.append(f"conv3d ran at {conv:.2f}x the matmul throughput; efficiency.conv clamped to 1")
    link = Link(bandwidth, latency, collective_bandwidth=bus_bandwidth, collective_latency=step_latency,
                sync_wait=result["sync_wait"] if nproc > 1 else 0.0, all_gather_latency=gather[0],
                all_gather_bandwidth=gather[1], reduce_scatter_latency=scatter[0], reduce_scatter_bandwidth=scatter[1])
    host = socket.gethostname()
    spec = ClusterSpec(
        name=f"calibrated-{host}-{nproc}proc", num_nodes=1, devices_per_node=nproc,
        device_memory=_mem_total() / nproc, reserved_memory=result["reserved_memory"],
        peak_flops={settings.dtype: result["matmul_flops"]}, efficiency={"matmul": 1.0, "conv": min(conv, 1.0)},
        memory_bandwidth=result["memory_bandwidth"], intra_node=link, inter_node=link,
        conv_rates=tuple(ConvRate(settings.dtype, *row) for row in result["conv_rates"]),
        op_rates=tuple(OpRate(*row) for row in result["op_rates"]),
        fast_conv_min=FAST_CONV_MIN,
        slow_conv_rates=tuple(ConvRate(settings.dtype, *row) for row in result["slow_conv_rates"]),
    )
    when = datetime.datetime.now().isoformat(timespec="seconds")
    comment = (f"Measured by `hybridpar calibrate --nproc {nproc} --dtype {settings.dtype}"
               f"{' --quick' if settings.quick else ''}` on {host}, {when}:\nthis machine as {nproc} device(s), one "
               f"worker process each, all measured at once (docs/cluster.md).\n" + "\n".join(notes))
    return Calibration(spec, result["matmul_flops"], result["conv_flops"], sizes, tuple(result["p2p_times"]),
                       {k: tuple(v) for k, v in result["collective_times"].items()}, n, tuple(notes), comment)


def _conv_summary(rows, kernel: str) -> list[tuple[str, str, str]]:
    """A conv grid in three rows: each pass's slowest and fastest rate."""
    out = []
    for field in ("forward", "input_grad", "weight_grad") if rows else ():
        rates = [getattr(r, field) for r in rows]
        out.append((f"conv3d k=3 {field.replace('_', ' ')}{kernel} over {len(rows)} (in, out, positions)",
                    f"{min(rates) / 1e9:.1f} to {max(rates) / 1e9:.1f}", "GFLOP/s"))
    return out


def _collective_summary(link: Link, ranks: int) -> list[tuple[str, str, str]]:
    out = []
    for kind in COLLECTIVES:
        latency, bandwidth = link.collective(kind)
        name = kind.replace("_", "-")
        out += [(f"{name} step latency ({ranks} ranks)", f"{latency * 1e6:.1f}", "µs"),
                (f"{name} bus bandwidth ({ranks} ranks)", f"{bandwidth / 1e9:.2f}", "GB/s")]
    return out


def summary(cal: Calibration) -> list[tuple[str, str, str]]:
    """(quantity, value, unit) rows for the command line."""
    spec, link = cal.spec, cal.spec.intra_node
    dtype = next(iter(spec.peak_flops))
    return [
        (f"matmul {dtype} (peak_flops)", f"{cal.matmul_flops / 1e9:.1f}", "GFLOP/s"),
        ("conv3d forward + backward", f"{cal.conv_flops / 1e9:.1f}", "GFLOP/s"),
        ("efficiency.conv", f"{spec.efficiency['conv']:.3f}", ""),
        ("memory bandwidth (into a fresh tensor)", f"{spec.memory_bandwidth / 1e9:.2f}", "GB/s"),
        *_conv_summary(spec.conv_rates, ""),
        *_conv_summary(spec.slow_conv_rates, f", slow kernel (batch 1, N*C*D*H <= {spec.fast_conv_min})"),
        *((f"{r.op} moving {r.bytes / 2**20:.1f} MiB: forward / backward", f"{r.forward / 1e9:.1f} / "
           f"{r.backward / 1e9:.1f}", "GB/s") for r in spec.op_rates),
        ("point-to-point latency", f"{link.latency * 1e6:.1f}", "µs"),
        ("point-to-point bandwidth", f"{link.bandwidth / 1e9:.2f}", "GB/s"),
        ("step time lost per exchange after compute (sync_wait)", f"{link.sync_wait * 1e6:.1f}", "µs"),
        *_collective_summary(link, cal.collective_ranks),
        ("device memory (MemTotal / N)", f"{spec.device_memory / 2**30:.2f}", "GiB"),
        ("reserved memory (a training worker before its model)", f"{spec.reserved_memory / 2**30:.3f}", "GiB"),
    ]

"""``hybridpar calibrate``: this machine, split into N worker processes, measured as a ClusterSpec.

The N workers (``launch_local``, gloo on loopback, ``cores // N`` torch threads each) run every compute
measurement at the same moment, so one "device" of the spec is one worker while the other N - 1 work too:
oversubscription and shared memory bandwidth are measured, not assumed. Per worker, after warm-up:

- matmul (1024 x 1024 @ 1024 x 1024, 2 M N K FLOPs) -> ``peak_flops[dtype]``, so ``efficiency.matmul = 1``;
- conv3d forward + backward on (2, 16, 32^3), 16 -> 16 channels, k = 3 (backward = 2 x forward FLOPs)
  -> ``efficiency.conv`` = conv / matmul throughput;
- conv3d (k = 3, 32 output channels) on (2, C, 32^3) for C in 1, 4, 16, 64: forward, forward + backward, and
  forward + backward of the weight alone -> ``conv_efficiency`` rows (thin inputs, like a network's first
  layer, run far below a wide conv on CPUs; the planner interpolates in log2 C);
- ``a + b`` on 64 MiB tensors into a fresh output (3 x 64 MiB moved) -> ``memory_bandwidth``: eager training
  writes every activation to a new tensor, so first-touch page faults are part of the bandwidth it sees.

Each timed repeat starts after a barrier; a worker's number is the median of its repeats, the machine's the
median over workers. Communication: ping-pong between ranks 0 and 1 over message sizes, fitted to
``latency + bytes / bandwidth``; all-reduce over all N ranks, fitted to the ring model
``2(N-1) step_latency + 2(N-1)/N bytes / bus_bandwidth``. With N = 1 there is nobody to talk to: compute is
measured by one worker alone, communication by a second launch of 2 workers. One machine has no
inter-node link: ``inter_node`` is a copy of ``intra_node`` (said in the TOML file's header).
"""

from __future__ import annotations

import datetime
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridpar.errors import HybridparError
from hybridpar.launch import init_distributed, launch_local, shutdown_distributed
from hybridpar.plan.cluster import ClusterSpec, ConvEfficiency, Link

DTYPES = ("float32", "float64")
MATMUL_EDGE = 1024
CONV_INPUT = (2, 16, 32, 32, 32)  # (N, C, D, H, W): big enough for the mkldnn path in float32
CONV_KERNEL = 3
MEMORY_BYTES = 64 * 2**20  # per tensor of the elementwise add
CONV_CHANNELS = (1, 4, 16, 64)  # input channels of the conv efficiency curve
CURVE_OUT_CHANNELS = 32
FAST_CONV_MIN = 20480  # PyTorch's CPU rule: a batch of 1 takes oneDNN only when N*C*D*H of the input exceeds this
SMALL_BYTES = 256  # messages up to this size give the latency


@dataclass(frozen=True)
class Settings:
    dtype: str = "float32"
    quick: bool = False

    @property
    def repeats(self) -> int:
        return 3 if self.quick else 15

    @property
    def max_inner(self) -> int:
        """Timed operations per repeat for the smallest messages (each takes microseconds)."""
        return 10 if self.quick else 50

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
    allreduce_times: tuple[float, ...]  # seconds per all-reduce of that many bytes
    allreduce_ranks: int
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
        if "compute" in phases:
            result |= _measure_compute(settings)
        if "comm" in phases:
            result |= _measure_comm(settings)
    finally:
        shutdown_distributed()
    return result if rank == 0 else None


def _measure_compute(settings: Settings) -> dict:
    """Throughputs of matmul, conv3d and an elementwise add, their repeats interleaved so that a slow
    moment of the machine slows all alike (``efficiency.conv`` and the conv curve are ratios to matmul)."""
    dtype = getattr(torch, settings.dtype)
    torch.manual_seed(dist.get_rank())
    n = MATMUL_EDGE
    a, b, c = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype), torch.empty(n, n, dtype=dtype)
    conv_flops, conv_step = _conv_step(dtype)
    x, y = (torch.ones(MEMORY_BYTES // a.element_size(), dtype=dtype) for _ in range(2))
    work = [2 * n**3, conv_flops, 3 * MEMORY_BYTES]
    fns = [lambda: torch.mm(a, b, out=c), conv_step, lambda: torch.add(x, y)]
    curve = [_conv_curve_steps(channels, dtype, settings.quick) for channels in CONV_CHANNELS]
    for _, steps in curve:
        fns += steps
    slow_flops, slow_steps = _conv_curve_steps(16, dtype, settings.quick, batch=1)
    fns.append(slow_steps[1])
    times = [statistics.median(t) for t in _interleaved_times(fns, settings.repeats)]
    rates = [amount / t for amount, t in zip(work, times)]
    efficiencies = []
    for i, (flops, _) in enumerate(curve):
        forward, both, weight = times[3 + 3 * i : 6 + 3 * i]
        # a backward is its pass's time less the forward's (at least a tenth of the forward: noise)
        efficiencies += [flops / forward, 2 * flops / max(both - forward, forward / 10),
                         flops / max(weight - forward, forward / 10)]
    fast = curve[CONV_CHANNELS.index(16)]
    fast_time = times[3 + 3 * CONV_CHANNELS.index(16) + 1] / fast[0]  # seconds per forward FLOP, both gradients
    slow = min(times[-1] / slow_flops / fast_time, 1e9)
    values = _median_over_ranks(rates + [min(rate / rates[0], 1.0) for rate in efficiencies] + [min(1 / slow, 1.0)])
    rows = [(channels, *values[3 + 3 * i : 6 + 3 * i]) for i, channels in enumerate(CONV_CHANNELS)]
    return {"matmul_flops": values[0], "conv_flops": values[1], "memory_bandwidth": values[2], "conv_curve": rows,
            "slow_conv_factor": values[-1]}


def _conv_curve_steps(channels: int, dtype: torch.dtype, quick: bool, batch: int = 0):
    """Forward FLOPs of a 3x3x3 conv from ``channels`` to 32 channels, and three timed functions: forward;
    forward and backward (input and weight gradients); forward and backward of the weight alone. The batch
    (unless given) is large enough for PyTorch's fast CPU kernel (``FAST_CONV_MIN``)."""
    edge = 16 if quick else 32
    batch = batch or max(2, -(-(FAST_CONV_MIN + 1) // (channels * edge * edge)))
    x = torch.randn(batch, channels, edge, edge, edge, dtype=dtype)
    x_grad = x.clone().requires_grad_()
    w = (torch.randn(CURVE_OUT_CHANNELS, channels, 3, 3, 3, dtype=dtype) / (channels * 27) ** 0.5).requires_grad_()
    grad_out = torch.randn(batch, CURVE_OUT_CHANNELS, edge, edge, edge, dtype=dtype)
    flops = 2 * batch * CURVE_OUT_CHANNELS * edge**3 * channels * 27

    def both():
        torch.autograd.grad(F.conv3d(x_grad, w, padding=1), (x_grad, w), grad_out)

    def weight():
        torch.autograd.grad(F.conv3d(x, w, padding=1), (w,), grad_out)

    return flops, [lambda: F.conv3d(x, w, padding=1), both, weight]


def _interleaved_times(fns, repeats: int, warmup: int = 2) -> list[list[float]]:
    """Seconds of each ``fn()`` per repeat; each call starts on all ranks together (a barrier, not timed)."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times):
            dist.barrier()
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return times


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
    return {"p2p_times": p2p, "allreduce_times": _allreduce_times(settings), "allreduce_ranks": dist.get_world_size()}


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


def _allreduce_times(settings: Settings) -> list[float]:
    times = []
    for nbytes in settings.sizes:
        buf = torch.zeros(nbytes // 4, dtype=torch.float32)
        times.append(_median_time(lambda: dist.all_reduce(buf), settings.repeats, inner=_inner(settings, nbytes)))
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


def fit_ring(sizes: tuple[int, ...], times: tuple[float, ...], n: int) -> tuple[float, float]:
    """``time = 2(n-1) step_latency + 2(n-1)/n bytes / bus_bandwidth``: (step_latency, bus_bandwidth)."""
    steps = 2 * (n - 1)
    latency, bandwidth = _fit(sizes, times, steps / n, "all-reduce")
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
    step_latency, bus_bandwidth = fit_ring(sizes, result["allreduce_times"], result["allreduce_ranks"])
    conv = result["conv_flops"] / result["matmul_flops"]
    if conv > 1:
        notes.append(f"conv3d ran at {conv:.2f}x the matmul throughput; efficiency.conv clamped to 1")
    link = Link(bandwidth, latency, collective_bandwidth=bus_bandwidth, collective_latency=step_latency)
    host = socket.gethostname()
    spec = ClusterSpec(
        name=f"calibrated-{host}-{nproc}proc", num_nodes=1, devices_per_node=nproc,
        device_memory=_mem_total() / nproc, reserved_memory=result["reserved_memory"],
        peak_flops={settings.dtype: result["matmul_flops"]}, efficiency={"matmul": 1.0, "conv": min(conv, 1.0)},
        memory_bandwidth=result["memory_bandwidth"], intra_node=link, inter_node=link,
        conv_efficiency=tuple(ConvEfficiency(*row) for row in result["conv_curve"]),
        fast_conv_min=FAST_CONV_MIN, slow_conv_factor=result["slow_conv_factor"],
    )
    when = datetime.datetime.now().isoformat(timespec="seconds")
    comment = (f"Measured by `hybridpar calibrate --nproc {nproc} --dtype {settings.dtype}"
               f"{' --quick' if settings.quick else ''}` on {host}, {when}:\nthis machine as {nproc} device(s), one "
               f"worker process each, all measured at once (docs/cluster.md).\n" + "\n".join(notes))
    return Calibration(spec, result["matmul_flops"], result["conv_flops"], sizes, tuple(result["p2p_times"]),
                       tuple(result["allreduce_times"]), result["allreduce_ranks"], tuple(notes), comment)


def summary(cal: Calibration) -> list[tuple[str, str, str]]:
    """(quantity, value, unit) rows for the command line."""
    spec, link = cal.spec, cal.spec.intra_node
    dtype = next(iter(spec.peak_flops))
    return [
        (f"matmul {dtype} (peak_flops)", f"{cal.matmul_flops / 1e9:.1f}", "GFLOP/s"),
        ("conv3d forward + backward", f"{cal.conv_flops / 1e9:.1f}", "GFLOP/s"),
        ("efficiency.conv", f"{spec.efficiency['conv']:.3f}", ""),
        ("memory bandwidth (into a fresh tensor)", f"{spec.memory_bandwidth / 1e9:.2f}", "GB/s"),
        *((f"conv from {r.in_channels} channels: forward / backward / weight", f"{r.forward:.2f} / "
           f"{r.backward:.2f} / {r.weight_gradient:.2f}", "of peak") for r in spec.conv_efficiency),
        (f"conv on PyTorch's slow CPU kernel (N*C*D*H <= {spec.fast_conv_min})", f"{spec.slow_conv_factor:.2f}",
         "x the fast rate"),
        ("point-to-point latency", f"{link.latency * 1e6:.1f}", "µs"),
        ("point-to-point bandwidth", f"{link.bandwidth / 1e9:.2f}", "GB/s"),
        (f"all-reduce step latency ({cal.allreduce_ranks} ranks)", f"{link.step_latency * 1e6:.1f}", "µs"),
        (f"all-reduce bus bandwidth ({cal.allreduce_ranks} ranks)", f"{link.bus_bandwidth / 1e9:.2f}", "GB/s"),
        ("device memory (MemTotal / N)", f"{spec.device_memory / 2**30:.2f}", "GiB"),
        ("reserved memory (a training worker before its model)", f"{spec.reserved_memory / 2**30:.3f}", "GiB"),
    ]

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

import torch.distributed as dist

from hybridpar.calibrate.comm import measure_comm
from hybridpar.calibrate.compute import measure_compute
from hybridpar.calibrate.fit import Calibration, fit_p2p, fit_ring, to_calibration
from hybridpar.calibrate.memory import allocate_as_in_training, runtime_rss_bytes
from hybridpar.calibrate.report import summary
from hybridpar.calibrate.settings import DTYPES, Settings
from hybridpar.calibrate.timing import max_over_ranks
from hybridpar.errors import HybridparError
from hybridpar.launch import init_distributed, launch_local, shutdown_distributed


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
    return to_calibration(result, nproc, settings, notes)


def worker(settings: Settings, phases: tuple[str, ...]) -> dict | None:
    """One worker: measures ``phases`` ("compute", "comm") with the others; rank 0 returns the numbers."""
    init_distributed()
    rank = dist.get_rank()
    try:
        result = {"reserved_memory": max_over_ranks(runtime_rss_bytes())}
        allocate_as_in_training()  # for every phase: sync_wait's convs allocate too
        if "compute" in phases:
            result |= measure_compute(settings)
        if "comm" in phases:
            result |= measure_comm(settings)
    finally:
        shutdown_distributed()
    return result if rank == 0 else None

__all__ = ["Calibration", "Settings", "calibrate", "fit_p2p", "fit_ring", "summary", "worker"]

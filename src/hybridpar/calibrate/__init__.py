"""``hybridpar calibrate``: this machine, split into N worker processes, measured as a ClusterSpec.

The workers compute on their mesh's device (``hybridpar.mesh``: a GPU each on a CUDA machine, NCCL between them;
else CPU workers on gloo), and the report and the TOML file's header say which ("measured: 2 CPU workers on 2
cores (cpu, gloo)", "measured: 4 × NVIDIA H100 80GB HBM3 (cuda, nccl)"). What follows is the CPU workers' case; on
GPUs a repeat is timed with CUDA events, caches are not flushed, the cores are not shared, memory comes from the
GPU and PyTorch's slow CPU conv kernel is not measured (``calibrate.device``). With one GPU and ``--nproc 1`` there
is no GPU to talk to: communication is measured between 2 CPU workers, and the header says so.

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

import contextlib
import os
from dataclasses import replace

import torch
import torch.distributed as dist

from hybridpar.calibrate.comm import measure_comm
from hybridpar.calibrate.compute import measure_compute
from hybridpar.calibrate.device import Measured, method_for
from hybridpar.calibrate.fit import Calibration, fit_p2p, fit_ring, to_calibration
from hybridpar.calibrate.memory import allocate_as_in_training, device_bytes, runtime_bytes
from hybridpar.calibrate.report import summary
from hybridpar.calibrate.settings import DTYPES, Settings
from hybridpar.calibrate.timing import max_over_ranks
from hybridpar.errors import HybridparError
from hybridpar.launch import init_distributed, launch_local, shutdown_distributed
from hybridpar.mesh import ParallelDims, accelerator_type, build_mesh, device_of


def default_nproc() -> int:
    """Workers when ``--nproc`` is not given: one per GPU on a CUDA machine, else one per CPU core."""
    if accelerator_type() == "cpu":
        return os.cpu_count() or 1
    return torch.accelerator.device_count()


def calibrate(nproc: int, dtype: str = "float32", quick: bool = False) -> Calibration:
    """Measure this machine as ``nproc`` devices (see the module docstring)."""
    if dtype not in DTYPES:
        raise HybridparError(f"--dtype {dtype}: calibrate measures {', '.join(DTYPES)}")
    if nproc < 1:
        raise HybridparError(f"--nproc {nproc}: give at least 1 worker process")
    device_type = accelerator_type()
    method_for(device_type)  # an accelerator calibrate cannot measure stops here, before any worker starts
    num_devices = torch.accelerator.device_count() if device_type != "cpu" else 0
    if device_type != "cpu" and nproc > num_devices:
        raise HybridparError(f"--nproc {nproc}: this machine has {num_devices} {device_type} device(s), one worker "
                             f"each; give --nproc {num_devices} or fewer")
    settings = Settings(dtype, quick)
    notes = ["inter_node = intra_node: one machine, no link between nodes was measured"]
    if nproc >= 2:
        result = launch_local(worker, (settings, ("compute", "comm")), nproc)[0]
    else:
        result = launch_local(worker, (settings, ("compute",)), 1)[0]
        alone = device_type != "cpu" and num_devices < 2
        with _accelerators_hidden() if alone else contextlib.nullcontext():
            comm = launch_local(worker, (settings, ("comm",)), 2)[0]
        result |= {k: v for k, v in comm.items() if k not in ("reserved_memory", "device_memory")}
        notes.append("--nproc 1: communication measured between 2 extra worker processes")
        if alone:
            notes.append(f"one {device_type} device, none to talk to: those 2 workers ran on the CPU (gloo), so "
                         "[intra_node] is no GPU link; give it and [inter_node] your interconnect's numbers "
                         "(docs/cluster.md)")
    return to_calibration(result, nproc, settings, notes)


@contextlib.contextmanager
def _accelerators_hidden():
    """Workers started inside see no CUDA device (they inherit the environment): their mesh is the CPU's."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def worker(settings: Settings, phases: tuple[str, ...]) -> dict | None:
    """One worker: measures ``phases`` ("compute", "comm") with the others on its mesh's device; rank 0 returns
    the numbers and what it measured on (``compute_measured``, ``comm_measured``)."""
    init_distributed()
    rank = dist.get_rank()
    try:
        settings, measured = on_mesh(settings)
        result = {"reserved_memory": max_over_ranks(runtime_bytes(settings), settings.device),
                  "device_memory": device_bytes(settings, measured.count)}
        if settings.method.memory == "proc":
            allocate_as_in_training()  # for every phase: sync_wait's convs allocate too
        if "compute" in phases:
            result |= measure_compute(settings) | {"compute_measured": measured}
        if "comm" in phases:
            result |= measure_comm(settings) | {"comm_measured": measured}
    finally:
        shutdown_distributed()
    return result if rank == 0 else None


def on_mesh(settings: Settings) -> tuple[Settings, Measured]:
    """This worker's ``settings`` on its mesh's device (``hybridpar.mesh``: one axis, ``dp``, over all workers),
    and what the workers measure on: that device (a GPU's name) and their process group's backend."""
    world = dist.get_world_size()
    mesh = build_mesh(ParallelDims(dp=world), world)["dp"]
    device = device_of(mesh)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    measured = Measured(world, device.type, dist.get_backend(mesh.get_group()), name, cores)
    return replace(settings, device=str(device)), measured


__all__ = ["Calibration", "Measured", "Settings", "calibrate", "default_nproc", "fit_p2p", "fit_ring", "on_mesh",
           "summary", "worker"]

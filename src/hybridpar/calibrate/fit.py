"""From measurements to a ``ClusterSpec``: latency and bandwidth fits of point-to-point and ring collectives."""

from __future__ import annotations

import datetime
import socket
import statistics
from dataclasses import dataclass

from hybridpar.calibrate.device import Measured, measured_line
from hybridpar.calibrate.settings import COLLECTIVES, FAST_CONV_MIN, SMALL_BYTES, Settings
from hybridpar.errors import HybridparError
from hybridpar.plan.cluster import ClusterSpec, Link
from hybridpar.plan.rates import ConvRate, OpRate


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
    devices: Measured  # what the compute was measured on
    comm_devices: Measured  # what the communication was measured on (2 CPU workers where one GPU had no peer)

    @property
    def measured(self) -> str:
        """``measured: 2 CPU workers on 2 cores (cpu, gloo)``, ``measured: 4 × NVIDIA H100 80GB HBM3 (cuda, nccl)``."""
        return measured_line(self.devices, self.comm_devices)


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


def to_calibration(result: dict, nproc: int, settings: Settings, notes: list[str]) -> Calibration:
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
    host, compute = socket.gethostname(), result["compute_measured"]
    spec = ClusterSpec(
        name=f"calibrated-{host}-{compute.spec_suffix}", num_nodes=1, devices_per_node=nproc,
        device_memory=result["device_memory"], reserved_memory=result["reserved_memory"],
        peak_flops={settings.dtype: result["matmul_flops"]}, efficiency={"matmul": 1.0, "conv": min(conv, 1.0)},
        memory_bandwidth=result["memory_bandwidth"], intra_node=link, inter_node=link,
        conv_rates=tuple(ConvRate(settings.dtype, *row) for row in result["conv_rates"]),
        op_rates=tuple(OpRate(*row) for row in result["op_rates"]),
        fast_conv_min=FAST_CONV_MIN if result["slow_conv_rates"] else 0,  # no slow kernel measured on a GPU
        slow_conv_rates=tuple(ConvRate(settings.dtype, *row) for row in result["slow_conv_rates"]),
    )
    when = datetime.datetime.now().isoformat(timespec="seconds")
    comm = result["comm_measured"]
    comment = (f"Measured by `hybridpar calibrate --nproc {nproc} --dtype {settings.dtype}"
               f"{' --quick' if settings.quick else ''}` on {host}, {when}:\nthis machine as {nproc} device(s), one "
               f"worker process each, all measured at once (docs/cluster.md).\n{measured_line(compute, comm)}\n"
               + "\n".join(notes))
    return Calibration(spec, result["matmul_flops"], result["conv_flops"], sizes, tuple(result["p2p_times"]),
                       {k: tuple(v) for k, v in result["collective_times"].items()}, n, tuple(notes), comment,
                       compute, comm)

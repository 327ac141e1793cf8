"""The table ``hybridpar calibrate`` prints: what was measured, per worker (on what: ``Calibration.measured``)."""

from __future__ import annotations

from hybridpar.calibrate.device import method_for
from hybridpar.calibrate.fit import Calibration
from hybridpar.calibrate.settings import COLLECTIVES
from hybridpar.plan.cluster import Link


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
    memory = "MemTotal / N" if method_for(cal.devices.device_type).memory == "proc" else "the GPU total"
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
        (f"device memory ({memory})", f"{spec.device_memory / 2**30:.2f}", "GiB"),
        ("reserved memory (a training worker before its model)", f"{spec.reserved_memory / 2**30:.3f}", "GiB"),
    ]

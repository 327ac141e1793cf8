"""Predicted weak and strong scaling: the planner's best plan of each family of strategies at each device
count, from one model analysis. Pure: no printing, no files.

- **weak**: the work per device stays fixed; the global batch grows with the device count,
  ``global_batch(n) = batch * n / n0`` where ``n0`` is the smallest count (so ``batch`` is the global batch
  at ``n0`` devices, however the family shares its samples among devices);
- **strong**: the same global batch ``batch`` at every count.

Efficiency is throughput per device relative to the family's first point that has a plan (its
*baseline*, ``b`` devices): ``(samples_per_second(n) / n) / (samples_per_second(b) / b)``. For strong scaling
this is the speedup over the baseline divided by ``n / b``; for weak scaling, the throughput per device
kept. The baseline's efficiency is 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hybridpar.errors import HybridparError, PlanError
from hybridpar.plan import ClusterSpec, Constraints, ModelGraph, Plan, cluster_of, search_plans
from hybridpar.plan.space import FAMILY_ORDER, ONE_DEVICE

MODES = ("weak", "strong")


@dataclass(frozen=True)
class Point:
    """One device count of one family: its best plan and predictions, or ``reason`` why it has none."""

    devices: int
    family: str
    global_batch: int
    plan: Plan | None
    step_time: float | None  # seconds
    samples_per_second: float | None
    efficiency: float | None  # relative to the family's baseline, 1.0 there
    reason: str = ""  # why there is no plan
    even_step_time: float | None = None  # on a mixed cluster: the plan's step split evenly (before sizing)

    def to_dict(self) -> dict:
        return {"devices": self.devices, "family": self.family, "global_batch": self.global_batch,
                "step_time": self.step_time, "samples_per_second": self.samples_per_second,
                "efficiency": self.efficiency, "reason": self.reason, "even_step_time": self.even_step_time,
                "plan": self.plan.to_dict() if self.plan is not None else None}


def family_name(text: str) -> str:
    """``"spatial x dp"`` -> ``"dp x spatial"``: the name the planner gives that family."""
    if text.strip().lower() == ONE_DEVICE:
        return ONE_DEVICE
    parts = [p.strip().lower() for p in text.split("x")]
    if not all(p in FAMILY_ORDER for p in parts) or len(set(parts)) != len(parts):
        raise HybridparError(f"family {text!r}: name the kinds of parallelism it uses among {', '.join(FAMILY_ORDER)}, "
                             f"joined by ' x ' (e.g. 'dp', 'dp x spatial', 'dp x tp x pp'), or {ONE_DEVICE!r}")
    return " x ".join(a for a in FAMILY_ORDER if a in parts)


def default_families(graph: ModelGraph) -> tuple[str, ...]:
    """Data x spatial for a model that takes a volume; data, tensor and pipeline for one that does not."""
    return ("dp", "dp x spatial") if graph.spatial_ndim else ("dp", "dp x tp", "dp x tp x pp")


def check_devices(device_counts, cluster: ClusterSpec) -> tuple[int, ...]:
    """Sorted, distinct device counts, each a whole number of the cluster's nodes (else a ``ClusterError``)."""
    counts = tuple(sorted(set(device_counts)))
    if not counts:
        raise HybridparError("no device counts: give at least one, e.g. 8, 16, 32")
    for n in counts:
        cluster.with_devices(n)
    return counts


def global_batches(counts: tuple[int, ...], batch: int, mode: str) -> dict[int, int]:
    """The global batch at each count: ``batch`` (strong) or ``batch * n / counts[0]`` (weak)."""
    if mode not in MODES:
        raise HybridparError(f"mode {mode!r}: use one of {', '.join(MODES)}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise HybridparError(f"batch = {batch!r}: give a whole number of samples >= 1")
    if mode == "strong":
        return {n: batch for n in counts}
    n0 = counts[0]
    bad = [n for n in counts if batch * n % n0]
    if bad:
        raise HybridparError(f"weak scaling from batch {batch} at {n0} devices gives {batch} x {bad[0]} / {n0} = "
                             f"{batch * bad[0] / n0:g} samples at {bad[0]} devices; use device counts that are "
                             f"multiples of {n0}, or a batch that makes them whole")
    return {n: batch * n // n0 for n in counts}


def scaling(graph: ModelGraph, cluster: ClusterSpec | str, device_counts, *, mode: str, batch: int,
            families: tuple[str, ...] | None = None, dtype: str = "float32", **constraints) -> list[Point]:
    """The best plan of each family at each device count, family by family, counts ascending.

    ``graph`` comes from ``graph_of(model, example_input, dtype)`` with the same ``dtype``; ``batch`` is the
    global batch at the smallest count (``mode="weak"``) or at every count (``"strong"``); ``families``
    defaults to :func:`default_families`; ``constraints`` are the planner's (``sharding``, ``optimizer``, ...)."""
    allowed = sorted(set(Constraints.__dataclass_fields__) - {"global_batch", "dtype", "families", "top"})
    unknown = sorted(set(constraints) - set(allowed))
    if unknown:
        raise HybridparError(f"unknown constraint {unknown[0]!r}; use {', '.join(allowed)}")
    spec = cluster_of(cluster)
    counts = check_devices(device_counts, spec)
    batches = global_batches(counts, batch, mode)
    names = tuple(dict.fromkeys(family_name(f) for f in (families or default_families(graph))))
    if not graph.spatial_ndim and any("spatial" in f for f in names):
        raise HybridparError(f"family {next(f for f in names if 'spatial' in f)!r}: the model takes no volume "
                             f"(input {graph.input_shape}), so it has no spatial parallelism")
    points = []
    for name in names:
        raw = [_point(graph, spec, n, name, batches[n], dtype, constraints) for n in counts]
        points.extend(_with_efficiency(raw))
    return points


def _point(graph, spec, n, name, global_batch, dtype, constraints) -> Point:
    try:
        result = search_plans(graph, None, spec.with_devices(n), global_batch=global_batch, dtype=dtype,
                              **{**constraints, "families": (name,), "top": 1})
    except PlanError as err:  # no mesh at all for these arguments (batch, fixed degrees): no plan here
        devices = f"{n} device{'s' if n > 1 else ''}"
        return Point(n, name, global_batch, None, None, None, None, f"no {name} arrangement of {devices}: {err}")
    if not result.plans:
        # one family searched: ``closest`` is its candidate nearest the memory limit (``rejected`` keeps the first
        # failure, often a cheaper setting, e.g. no sharding, that fails by far more)
        reason = result.closest or result.rejected.get(name) or "no plan of this family fits"
        return Point(n, name, global_batch, None, None, None, None, reason)
    best = result.plans[0]
    even = result.sized[0].even.prediction.step_time if result.sized else None
    return Point(n, name, global_batch, best, best.prediction.step_time, best.prediction.samples_per_second, None,
                 even_step_time=even)


def _with_efficiency(points: list[Point]) -> list[Point]:
    base = next((p for p in points if p.plan is not None), None)
    if base is None:
        return points
    per_device = base.samples_per_second / base.devices
    return [p if p.plan is None else replace(p, efficiency=p.samples_per_second / p.devices / per_device)
            for p in points]

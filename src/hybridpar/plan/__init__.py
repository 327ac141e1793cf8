"""The planner, pure: model analysis on the meta device, cluster specs, the cost model, the search and
the Plan. It needs no GPUs and no process group; a laptop plans for thousands of devices.

``plan(model, example_input, cluster, **constraints)`` returns the fastest plan that fits;
``search_plans`` returns the ranked plans and why the other strategies lost; ``validate`` checks and
prices a hand-written plan with the same code.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from hybridpar.errors import HybridparError, PlanError
from hybridpar.ir.graph import Layer, ModelGraph
from hybridpar.ir.rules import check_grid
from hybridpar.ir.types import SCHEMA_VERSION, Plan, Prediction
from hybridpar.plan.cluster import PRESETS, ClusterSpec, Link, preset
from hybridpar.plan.mixed import MixedCluster, priced, sized_plan
from hybridpar.plan.search import SearchResult, search
from hybridpar.plan.space import Constraints
from hybridpar.plan.validate import validate as validate_on

if TYPE_CHECKING:
    import torch.nn as nn

LAZY = ("analyse", "graph_of")  # the model analysis imports torch: loaded on first use


def cluster_of(cluster: ClusterSpec | MixedCluster | str) -> ClusterSpec | MixedCluster:
    """A spec as given, or a preset name or TOML file (read by ``plan.io``)."""
    if isinstance(cluster, (ClusterSpec, MixedCluster)):
        return cluster
    from hybridpar.plan.io import load_cluster

    return load_cluster(cluster)


def validate(plan: Plan, graph: ModelGraph, cluster: ClusterSpec | MixedCluster, *, overlap_halo: bool = True) -> Plan:
    """``plan`` with its prediction, if it fits ``graph`` on ``cluster``; a ``PlanError`` naming what does not. On a
    mixed cluster, priced on its devices with the plan's shares and slabs as they are (``mixed.priced``)."""
    if isinstance(cluster, MixedCluster):
        return priced(cluster, plan, graph)
    return validate_on(plan, graph, cluster, overlap_halo=overlap_halo)


def _graph(model: nn.Module | ModelGraph, example_input, dtype: str) -> ModelGraph:
    """A graph as given, or the model analysed (``analysis.graph_of``: the one place the planner imports torch)."""
    if isinstance(model, ModelGraph):
        return model
    from hybridpar.ir.analysis import graph_of

    return graph_of(model, example_input, dtype)


def search_plans(model: nn.Module | ModelGraph, example_input, cluster: ClusterSpec | str, *,
                 global_batch: int | None = None, dtype: str = "float32", **constraints) -> SearchResult:
    """Ranked plans (fastest first) and, per family of strategies, why it lost or did not fit.
    ``constraints``: the fields of :class:`Constraints` (``dp``, ``spatial``, ``tp``, ``pp``, ``sharding``,
    ``checkpointing``, ``optimizer``, ``max_micro_batches``, ``overlap_halo``, ``top``)."""
    graph = _graph(model, example_input, dtype)
    c = _constraints(graph, global_batch, dtype, constraints)
    return _search(graph, cluster_of(cluster), c)


def _search(graph: ModelGraph, spec: ClusterSpec | MixedCluster, c: Constraints) -> SearchResult:
    """``search``; on a mixed cluster, on its reference, and each plan then sized to the devices' speeds
    (``mixed.sized_plan``) and ranked again."""
    if not isinstance(spec, MixedCluster):
        return search(graph, spec, c)
    result = search(graph, spec.reference(c.dtype), c)
    sized = sorted((sized_plan(spec, p, graph) for p in result.plans), key=lambda s: s.plan.prediction.step_time)
    return replace(result, plans=[s.plan for s in sized], sized=tuple(sized))


HINTS = ("devices", "batch", "constraints")  # what a no-fit message may suggest changing


def plan(model: nn.Module | ModelGraph, example_input, cluster: ClusterSpec | str, *,
         global_batch: int | None = None, dtype: str = "float32", hints: tuple[str, ...] = HINTS,
         **constraints) -> Plan:
    """The fastest plan that fits ``cluster`` (all of its devices), or a ``PlanError`` saying what would fit.
    ``global_batch`` defaults to the example input's batch. ``hints`` limits what that message may suggest
    (``devices``, ``batch``, ``constraints``): leave out ``constraints`` when the caller, not the user, set them."""
    graph = _graph(model, example_input, dtype)
    spec = cluster_of(cluster)
    c = _constraints(graph, global_batch, dtype, constraints)
    result = _search(graph, spec, c)
    if not result.plans:
        raise PlanError(no_fit_message(graph, spec.reference(dtype) if isinstance(spec, MixedCluster) else spec, c,
                                       result, hints))
    return result.plans[0]


def _constraints(graph: ModelGraph, global_batch: int | None, dtype: str, constraints: dict) -> Constraints:
    unknown = sorted(set(constraints) - set(Constraints.__dataclass_fields__))
    if unknown:
        raise PlanError(f"unknown constraint {unknown[0]!r}; use {', '.join(sorted(Constraints.__dataclass_fields__))}")
    batch = graph.batch if global_batch is None else global_batch
    if not isinstance(batch, int) or batch < 1:
        raise PlanError(f"global_batch = {batch!r}: give a whole number of samples >= 1")
    return Constraints(global_batch=batch, dtype=dtype, **constraints)


def no_fit_message(graph: ModelGraph, cluster: ClusterSpec, c: Constraints, result: SearchResult,
                   hints: tuple[str, ...] = HINTS) -> str:
    """One message: why nothing fits, and what would: more devices, a smaller or larger batch, the
    constraints relaxed (each only if named in ``hints``)."""
    lines = [f"no plan fits {cluster.num_devices} {cluster.name} devices "
             f"({cluster.device_memory / 2**30:.3g} GiB each) with global batch {c.global_batch}"]
    if result.closest:
        lines.append(f"closest: {result.closest}")
    else:
        lines.extend(f"{name}: {why}" for name, why in list(result.rejected.items())[:3])
    found = []
    if "devices" in hints:
        found += _more_devices(graph, cluster, c)
    if "batch" in hints:
        found += _other_batch(graph, cluster, c)
    if "constraints" in hints:
        if tuple(c.sharding) != (0, 1, 2, 3) or tuple(c.checkpointing) != (False, True):
            found.append("allowing every sharding level and activation checkpointing")
        if any(v is not None for v in (c.dp, c.spatial, c.tp, c.pp)):
            found.append("leaving the parallel degrees to the search")
    if found:
        lines.append("would fit with " + ", or ".join(found))
    return "; ".join(lines)


def _fits(graph: ModelGraph, cluster: ClusterSpec, c: Constraints) -> bool:
    try:
        return bool(search(graph, cluster, c).plans)
    except HybridparError:  # not a whole number of nodes, or no arrangement of the devices
        return False


def _more_devices(graph: ModelGraph, cluster: ClusterSpec, c: Constraints) -> list[str]:
    for factor in (2, 4, 8, 16, 32, 64):
        n = cluster.num_devices * factor
        try:
            bigger = cluster.with_devices(n)
        except HybridparError:
            continue
        if _fits(graph, bigger, c):
            return [f"{n} devices"]
    return []


def _other_batch(graph: ModelGraph, cluster: ClusterSpec, c: Constraints) -> list[str]:
    out = []
    batch = c.global_batch // 2
    while batch >= 1:
        if _fits(graph, cluster, replace(c, global_batch=batch)):
            out.append(f"a global batch of {batch}")
            break
        batch //= 2
    for factor in (2, 4, 8, 16, 32, 64, 128, 256):
        if _fits(graph, cluster, replace(c, global_batch=c.global_batch * factor)):
            out.append(f"a global batch of {c.global_batch * factor} (more samples for data parallelism)")
            break
    return out


def __getattr__(name: str):
    if name in LAZY:
        from hybridpar.ir import analysis

        return getattr(analysis, name)
    raise AttributeError(f"module 'hybridpar.plan' has no attribute {name!r}")


__all__ = ["HINTS", "PRESETS", "SCHEMA_VERSION", "ClusterSpec", "Constraints", "Layer", "Link", "MixedCluster",
           "ModelGraph", "Plan",
           "Prediction", "SearchResult", "analyse", "check_grid", "cluster_of", "graph_of", "no_fit_message", "plan",
           "preset", "search", "search_plans", "validate"]

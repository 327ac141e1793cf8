"""Clusters of mixed devices (Asteroid, HierTrain): nodes of several kinds, say half A100 and half H100 nodes. An
even split runs every step at the pace of the slowest kind; sized to each device's speed (``plan.sizing``:
thicker slabs and more samples for the faster devices), the step approaches the cluster's total speed.

The search plans on the *reference*: every device as the slowest kind's compute, the least memory and the slowest
links, so that the plan it finds fits every device. Each kind's speed is then the cost model's own prediction:
the plan's compute time on the reference over its compute time on that kind (conv rates, memory-bound layers and
all). The plan is sized to those speeds among the splits that keep every device within its memory and the grid's
halo rules; its prediction is the even plan's with the compute scaled by ``sizing.step_time``. Pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hybridpar.errors import ClusterError, PlanError
from hybridpar.ir.rules import check_grid
from hybridpar.ir.types import Plan
from hybridpar.plan import sizing
from hybridpar.plan.cluster import MAX_DEVICES, ClusterSpec, check_devices
from hybridpar.plan.validate import validate


@dataclass(frozen=True)
class MixedCluster:
    """``groups`` of nodes, in rank order (ranks fill the first group's nodes first): each a ``ClusterSpec`` of its
    nodes (a preset or a calibrated spec with ``num_nodes`` set). Every node has the same number of devices."""

    name: str
    groups: tuple[ClusterSpec, ...]

    def __post_init__(self):
        object.__setattr__(self, "groups", tuple(self.groups))
        if not self.groups:
            raise ClusterError(f"mixed cluster {self.name!r}: give at least one [[group]] of nodes")
        per_node = {g.devices_per_node for g in self.groups}
        if len(per_node) > 1:
            raise ClusterError(f"mixed cluster {self.name!r}: its groups have {sorted(per_node)} devices per node; "
                               "give groups whose nodes have the same number of devices")
        if self.num_devices > MAX_DEVICES:
            raise ClusterError(f"mixed cluster {self.name!r}: its groups make {self.num_devices:,} devices, more than "
                               f"{MAX_DEVICES:,} (ten times the largest machines built); give the nodes of the "
                               "cluster you mean")

    @property
    def num_devices(self) -> int:
        return sum(g.num_devices for g in self.groups)

    @property
    def device_memory(self) -> float:
        return min(g.device_memory for g in self.groups)

    def with_devices(self, n: int) -> MixedCluster:
        """The same kinds in the same proportions with ``n`` devices in all (each group's nodes scaled alike)."""
        nodes = [g.num_nodes for g in self.groups]
        total, per_node = sum(nodes), self.groups[0].devices_per_node
        smallest = total // math.gcd(*nodes) * per_node  # the fewest devices that keep the proportions
        check_devices(n)
        if n % smallest:
            raise ClusterError(f"{n!r} devices: the mixed cluster {self.name!r} ({self.describe()}) keeps its "
                               f"proportions on multiples of {smallest} devices; use one of those")
        return replace(self, groups=tuple(replace(g, num_nodes=g.num_nodes * n // self.num_devices)
                                          for g in self.groups))

    def describe(self) -> str:
        return " + ".join(f"{g.num_nodes} x {g.devices_per_node} {g.name}" for g in self.groups)

    def check_dtype(self, dtype: str) -> None:
        """Refuse a dtype some kind of device has no peak FLOP/s for (before a model is analysed to be priced)."""
        self.reference(dtype)

    def group_of_rank(self, rank: int) -> int:
        first = 0
        for index, group in enumerate(self.groups):
            if rank < first + group.num_devices:
                return index
            first += group.num_devices
        raise ClusterError(f"rank {rank} is beyond the {self.num_devices} devices of {self.name!r}")

    def reference(self, dtype: str = "float32") -> ClusterSpec:
        """What the search plans on: all the nodes, each device as slow as the slowest kind's in ``dtype``, with
        the least memory and the slowest links of any kind."""
        missing = [g.name for g in self.groups if dtype not in g.peak_flops]
        if missing:
            raise ClusterError(f"mixed cluster {self.name!r}: {missing[0]} has no peak FLOP/s for {dtype}; give its "
                               f"[peak_tflops] {dtype}, or plan in a dtype every kind has")
        slowest = min(self.groups, key=lambda g: g.peak_flops[dtype] * min(g.efficiency.values()))
        return replace(slowest, name=f"{self.name} (as {slowest.name})",
                       num_nodes=sum(g.num_nodes for g in self.groups),
                       device_memory=min(g.device_memory for g in self.groups),
                       reserved_memory=max(g.reserved_memory for g in self.groups),
                       intra_node=min((g.intra_node for g in self.groups), key=lambda link: link.bandwidth),
                       inter_node=min((g.inter_node for g in self.groups), key=lambda link: link.bandwidth))


@dataclass(frozen=True)
class Sized:
    """A plan sized to a mixed cluster, the even plan it came from, each group's speed, and the explanation."""

    plan: Plan
    even: Plan
    speeds: tuple[float, ...]  # per group, relative to the reference (the slowest kind: 1)
    rows: tuple[tuple[str, int, float, float, float], ...]  # group: name, devices, speed, work even, work sized


def group_speeds(mixed: MixedCluster, plan: Plan, graph) -> tuple[float, ...]:
    """Each group's speed on ``plan``: the plan's predicted compute time on the reference over on that kind."""
    nodes, spec = sum(g.num_nodes for g in mixed.groups), mixed.reference(plan.dtype)
    reference = validate(plan, graph, spec).prediction.compute_time
    speeds = []
    for group in mixed.groups:
        kind = replace(group, num_nodes=nodes, device_memory=spec.device_memory)
        speeds.append(reference / validate(plan, graph, kind).prediction.compute_time)
    return tuple(speeds)


def sized_plan(mixed: MixedCluster, plan: Plan, graph) -> Sized:
    """``plan`` (found on ``mixed.reference``, with its prediction) sized to the groups' speeds."""
    per_group = group_speeds(mixed, plan, graph)
    speeds = tuple(per_group[mixed.group_of_rank(r)] for r in range(plan.world_size))
    layers = sizing.Layers.of(graph) if plan.pp > 1 else None
    sized = sizing.sized(plan, speeds, lambda candidate: _fits(mixed, candidate, graph) is None, layers)
    rows = tuple((g.name, g.num_devices, per_group[i], *(_group_work(p, mixed, i, layers) for p in (plan, sized)))
                 for i, g in enumerate(mixed.groups))
    return Sized(_priced(mixed, sized, speeds, layers), replace(plan, cluster=mixed.name), per_group, rows)


def priced(mixed: MixedCluster, plan: Plan, graph) -> Plan:
    """``plan`` with its shares and slabs as they are, checked and priced on ``mixed`` (``validate`` of a plan
    file on a mixed cluster), or a ``PlanError`` naming what does not fit."""
    even = validate(replace(plan, shares=(), slabs=()), graph, mixed.reference(plan.dtype))
    plan = replace(plan, prediction=even.prediction)
    problem = _fits(mixed, plan, graph)
    if problem:
        raise PlanError(problem)
    per_group = group_speeds(mixed, even, graph)
    return _priced(mixed, plan, tuple(per_group[mixed.group_of_rank(r)] for r in range(plan.world_size)),
                   sizing.Layers.of(graph) if plan.pp > 1 else None)


def _fits(mixed: MixedCluster, plan: Plan, graph) -> str | None:
    """Why ``plan`` (with the even split's prediction) cannot run on ``mixed``: its shares or slabs, the grid's halo
    rules, a device's memory; ``None`` where it can."""
    try:
        plan.check_uneven()
        check_grid(graph, plan.grid)
        if plan.pp > 1:  # its stages: where the model may be cut, and what each holds, on the least memory
            validate(replace(plan, shares=(), slabs=()), graph, mixed.reference(plan.dtype))
    except PlanError as err:
        return str(err)
    for rank in range(plan.world_size):
        group = mixed.groups[mixed.group_of_rank(rank)]
        if _memory(plan, rank) > group.device_memory:
            return (f"rank {rank} ({group.name}) needs {_memory(plan, rank) / 2**30:.3g} GiB with its work of "
                    f"{sizing.rank_work(plan, rank):.2f} even shares, more than its {group.device_memory / 2**30:.3g} "
                    "GiB; give it a smaller share")
    return None


def _priced(mixed: MixedCluster, plan: Plan, speeds: tuple[float, ...], layers: sizing.Layers | None) -> Plan:
    """``plan`` (with the even split's prediction) predicted on ranks of ``speeds``: the compute scaled by
    ``sizing.step_time``, the fullest device's memory."""
    pred = plan.prediction
    compute = pred.compute_time * sizing.step_time(plan, speeds, layers)
    step = pred.step_time - pred.compute_time + compute
    fullest = max(range(plan.world_size), key=lambda r: _memory(plan, r))
    memory = dict(pred.memory, total=_memory(plan, fullest),
                  activations=pred.memory["activations"] * sizing.rank_work(plan, fullest))
    return replace(plan, cluster=mixed.name, prediction=replace(pred, step_time=step, compute_time=compute,
                                                                memory=memory,
                                                                samples_per_second=plan.global_batch / step))


def _memory(plan: Plan, rank: int) -> float:
    """Rank ``rank``'s bytes: the even plan's, its activations scaled by the rank's work."""
    memory = plan.prediction.memory
    return memory["total"] + memory["activations"] * (sizing.rank_work(plan, rank) - 1)


def _group_work(plan: Plan, mixed: MixedCluster, group: int, layers: sizing.Layers | None) -> float:
    """The largest work of a device of ``group`` under ``plan`` (1: an even share)."""
    return max(sizing.rank_work(plan, r, layers) for r in range(plan.world_size) if mixed.group_of_rank(r) == group)

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
from hybridpar.plan import sizing
from hybridpar.plan.cluster import ClusterSpec
from hybridpar.plan.types import Plan


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
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n % smallest:
            raise ClusterError(f"{n!r} devices: the mixed cluster {self.name!r} ({self.describe()}) keeps its "
                               f"proportions on multiples of {smallest} devices; use one of those")
        return replace(self, groups=tuple(replace(g, num_nodes=g.num_nodes * n // self.num_devices)
                                          for g in self.groups))

    def describe(self) -> str:
        return " + ".join(f"{g.num_nodes} x {g.devices_per_node} {g.name}" for g in self.groups)

    def group_of_rank(self, rank: int) -> int:
        for index, group in enumerate(self.groups):
            if rank < group.num_devices:
                return index
            rank -= group.num_devices
        raise ClusterError(f"rank {rank} is beyond the {self.num_devices} devices of {self.name!r}")

    @property
    def reference(self) -> ClusterSpec:
        """What the search plans on: all the nodes, each device as slow as the slowest kind's, with the least
        memory and the slowest links of any kind."""
        slowest = min(self.groups, key=lambda g: min(g.peak_flops.get(d, 0) * min(g.efficiency.values())
                                                     for d in g.peak_flops))
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
    from hybridpar.plan.validate import validate

    nodes = sum(g.num_nodes for g in mixed.groups)
    reference = validate(plan, graph, mixed.reference).prediction.compute_time
    speeds = []
    for group in mixed.groups:
        kind = replace(group, num_nodes=nodes, device_memory=mixed.reference.device_memory)
        speeds.append(reference / validate(plan, graph, kind).prediction.compute_time)
    return tuple(speeds)


def sized_plan(mixed: MixedCluster, plan: Plan, graph) -> Sized:
    """``plan`` (found on ``mixed.reference``, with its prediction) sized to the groups' speeds; its prediction
    the even one's with the compute scaled (``sizing.step_time``) and the fullest device's memory."""
    from hybridpar.plan.options import check_grid

    per_group = group_speeds(mixed, plan, graph)
    speeds = tuple(per_group[mixed.group_of_rank(r)] for r in range(plan.world_size))

    def fits(candidate: Plan) -> bool:
        try:
            candidate.check_uneven()
            check_grid(graph, candidate.grid)
        except PlanError:
            return False
        return all(_memory(candidate, r) <= mixed.groups[mixed.group_of_rank(r)].device_memory
                   for r in range(candidate.world_size))

    sized = sizing.sized(plan, speeds, fits)
    pred = plan.prediction
    compute = pred.compute_time * sizing.step_time(sized, speeds)
    step = pred.step_time - pred.compute_time + compute
    fullest = max(range(sized.world_size), key=lambda r: _memory(sized, r))
    memory = dict(pred.memory, total=_memory(sized, fullest),
                  activations=pred.memory["activations"] * sizing.rank_work(sized, fullest))
    sized = replace(sized, cluster=mixed.name, prediction=replace(pred, step_time=step, compute_time=compute,
                                                                  memory=memory,
                                                                  samples_per_second=sized.global_batch / step))
    rows = tuple((g.name, g.num_devices, per_group[i], *(_group_work(p, mixed, i) for p in (plan, sized)))
                 for i, g in enumerate(mixed.groups))
    return Sized(sized, replace(plan, cluster=mixed.name), per_group, rows)


def _memory(plan: Plan, rank: int) -> float:
    """Rank ``rank``'s bytes: the even plan's, its activations scaled by the rank's work."""
    memory = plan.prediction.memory
    return memory["total"] + memory["activations"] * (sizing.rank_work(plan, rank) - 1)


def _group_work(plan: Plan, mixed: MixedCluster, group: int) -> float:
    """The largest work of a device of ``group`` under ``plan`` (1: an even share)."""
    return max(sizing.rank_work(plan, r) for r in range(plan.world_size) if mixed.group_of_rank(r) == group)

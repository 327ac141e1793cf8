"""The search space of the planner: the constraints a user fixes, the meshes (``ParallelDims``) that multiply to
the device count, the settings tried on each (micro-batches, ZeRO level, checkpointing), and the family of
strategies a mesh belongs to (``dp x spatial``, ``dp x tp x pp``, ...)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridpar.dims import ParallelDims
from hybridpar.ir.graph import ModelGraph

SHARDING_LEVELS = (0, 1, 2, 3)
FAMILY_ORDER = ("dp", "spatial", "tp", "pp")  # the order of the kinds of parallelism in a family's name
ONE_DEVICE = "one device"  # the family of a plan that uses none


@dataclass(frozen=True)
class Constraints:
    """What the user fixes or limits; ``None`` leaves a choice to the search."""

    global_batch: int
    dtype: str = "float32"
    optimizer: str = "adam"
    dp: int | None = None
    spatial: tuple[int, ...] | None = None
    tp: int | None = None
    pp: int | None = None
    sharding: tuple[int, ...] = SHARDING_LEVELS
    checkpointing: tuple[bool, ...] = (False, True)
    max_micro_batches: int = 8  # per pipeline stage: m runs from pp to this many times pp
    overlap_halo: bool = True
    max_tp: int | None = None  # largest tp degree; None: one node's devices (tp groups stay inside a node)
    top: int = 5
    families: tuple[str, ...] | None = None  # only these families, e.g. ("dp", "dp x spatial"); None: all


@dataclass(frozen=True)
class Setting:
    """What the search tries on each mesh: micro-batches per step, ZeRO level, activation checkpointing."""

    micro_batches: int
    sharding: int
    checkpointing: bool


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def grids(parts: int, ndim: int) -> list[tuple[int, ...]]:
    """Every way to split ``parts`` over ``ndim`` spatial dims."""
    if ndim == 0:
        return [()] if parts == 1 else []
    if ndim == 1:
        return [(parts,)]
    return [(d,) + rest for d in divisors(parts) for rest in grids(parts // d, ndim - 1)]


def meshes(world: int, graph: ModelGraph, c: Constraints, cluster_devices_per_node: int) -> list[ParallelDims]:
    """The degrees with ``dp * prod(spatial) * tp * pp == world`` that the constraints allow."""
    ndim = graph.spatial_ndim
    max_tp = c.max_tp or cluster_devices_per_node
    out = []
    for pp in divisors(world):
        for tp in [t for t in divisors(world // pp) if t <= max_tp or t == c.tp]:
            for dp in divisors(world // (pp * tp)):
                s = world // (pp * tp * dp)
                if c.global_batch % dp or any(v is not None and v != x for v, x in ((c.dp, dp), (c.tp, tp),
                                                                                   (c.pp, pp))):
                    continue
                options = grids(s, ndim) if ndim else ([()] if s == 1 else [])
                if graph.isotropic:  # permuted grids cost the same: keep one, split depth first
                    options = [g for g in options if list(g) == sorted(g, reverse=True)]
                for grid in options:
                    full = grid or (1,)
                    if c.spatial is not None and tuple(c.spatial) != full:
                        continue
                    out.append(ParallelDims(dp=dp, spatial=full, tp=tp, pp=pp))
    return out


def micro_batch_counts(per_replica: int, pp: int, c: Constraints) -> list[int]:
    if pp == 1:
        return [1]
    return [m for m in divisors(per_replica) if pp <= m <= c.max_micro_batches * pp]


def family(dims: ParallelDims) -> str:
    """The family of a mesh: the kinds of parallelism it uses, in ``FAMILY_ORDER``, e.g. ``dp x spatial``."""
    sizes = {"dp": dims.dp, "spatial": dims.num_spatial, "tp": dims.tp, "pp": dims.pp}
    return " x ".join(name for name in FAMILY_ORDER if sizes[name] > 1) or ONE_DEVICE

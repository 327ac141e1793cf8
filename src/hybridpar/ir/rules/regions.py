"""Regions: layers that tensor parallelism splits together and whose edges are whole (Megatron MLPs, attention
with grouped KV heads and rotary products, SwiGLU, conv pairs), and how a layer runs alone (``standalone``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridpar.errors import PlanError
from hybridpar.ir.rules.splits import check_assignment, tp_refusal


@dataclass(frozen=True)
class Region:
    """Layers split together over tp: column layers whose split outputs reach row layers through shard
    layers only, whole at its edges (its inputs whole, its rows' outputs summed whole, nothing outside it
    reading a split tensor)."""

    layers: tuple[int, ...]  # in order, consecutive
    strategies: tuple[str, ...]

    @property
    def start(self) -> int:
        return self.layers[0]

    @property
    def stop(self) -> int:
        return self.layers[-1] + 1


def regions(graph, tp: int, *, spatial: bool = False, sharded: bool = False) -> list[Region]:
    """Every region of ``graph`` that splits exactly over ``tp`` ranks (``check_assignment``), found from each
    layer that could be a row layer by walking back through shard-able layers to column-able ones: a
    Megatron MLP (column, shard..., row), attention (its query, key and value projections, the rotary
    products and the attention on this rank's heads, the output projection), a gated MLP (gate and up
    columns, their product, down row), a filter-parallel conv and the channel-parallel conv after it.
    Regions may overlap (a conv is the row of one region and the column of the next): a plan takes some
    that do not."""
    options = dict(spatial=spatial, sharded=sharded)
    cones: list[dict[int, str]] = []
    for i, layer in enumerate(graph.layers):
        if layer.kind != "embedding" and tp_refusal(layer, "row", tp, **options) is None:
            cone = _cone(graph, i, tp, options)
            if cone is not None:
                cones.append(cone)
    found, seen = [], set()
    for cone in _merge(cones):
        members = tuple(sorted(cone))
        if members in seen or members != tuple(range(members[0], members[-1] + 1)):
            continue
        seen.add(members)
        try:
            check_assignment(graph, {graph.layers[i].name: cone[i] for i in members}, tp, only=members, **options)
        except PlanError:
            continue
        found.append(Region(members, tuple(cone[i] for i in members)))
    return sorted(found, key=lambda r: (r.start, r.stop))


def _cone(graph, row: int, tp: int, options: dict) -> dict[int, str] | None:
    members = {row: "row"}
    stack = [r.source for r in graph.layers[row].reads if r.source >= 0]
    if not stack:
        return None
    while stack:
        p = stack.pop()
        if p in members:
            continue
        layer = graph.layers[p]
        if tp_refusal(layer, "column", tp, **options) is None:
            members[p] = "column"
        elif tp_refusal(layer, "shard", tp, **options) is None:
            members[p] = "shard"
            stack.extend(r.source for r in _split_operands(layer) if r.source >= 0)
        else:
            return None
    return members


def _split_operands(layer) -> list:
    """The reads of a shard layer that must be split (the others broadcast whole): the query, key and value of
    attention, the operands of a pointwise operation as large as its output, and all of any other's."""
    if layer.kind == "attention":
        return list(layer.reads[:3])
    if layer.kind == "pointwise":
        size = math.prod(layer.out_shape)
        return [r for r in layer.reads if math.prod(r.shape) == size]
    return [r for r in layer.reads if math.prod(r.shape)]


def _merge(cones: list[dict[int, str]]) -> list[dict[int, str]]:
    """Cones that share a layer in the same role are one region (two rows fed by one column); a group whose
    cones give one layer two roles stays apart (alternatives: a conv that is one pair's row and the next's
    column)."""
    parent = list(range(len(cones)))

    def find(c: int) -> int:
        while parent[c] != c:
            parent[c] = parent[parent[c]]
            c = parent[c]
        return c

    owner: dict[tuple[int, str], int] = {}
    for c, cone in enumerate(cones):
        for item in cone.items():
            if item in owner:
                parent[find(c)] = find(owner[item])
            else:
                owner[item] = c
    groups: dict[int, list[int]] = {}
    for c in range(len(cones)):
        groups.setdefault(find(c), []).append(c)
    out = []
    for members in groups.values():
        merged: dict[int, str] = {}
        for c in members:
            merged.update(cones[c])
        roles = {(i, s) for c in members for i, s in cones[c].items()}
        out.extend([merged] if len(roles) == len(merged) else [cones[c] for c in members])
    return out


def standalone(layer, tp: int, *, spatial: bool = False, sharded: bool = False) -> tuple[str, ...]:
    """The strategies ``layer`` can run alone, whole at its edges: replicate; a column layer gathering its
    output (for every reader: a row reader then slices it); a row layer slicing its input (or an embedding
    split by vocabulary)."""
    out = ["replicate"]
    for strategy in ("column", "row"):
        if tp > 1 and tp_refusal(layer, strategy, tp, spatial=spatial, sharded=sharded) is None:
            if strategy == "row" and layer.kind != "embedding" and sum(r.source >= -1 for r in layer.reads) != 1:
                continue
            out.append(strategy)
    return tuple(out)

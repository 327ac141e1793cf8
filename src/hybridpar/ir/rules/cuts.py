"""Pipelines: where a model can be cut into stages (``stage_cut_refusal``), which tensors cross each cut and where
they come from (``passes``, ``crossing_sources``, ``stage_interfaces``), and when checkpointed stages cannot run."""

from __future__ import annotations

import math
from dataclasses import dataclass


def _origins(graph) -> tuple[list[float], list[float]]:
    """For each layer, the first and the last block a stage must hold to compute it: its own block, or for a
    layer of the model's own code, the earliest and the latest block it depends on (``-1``: the model input,
    which only the first stage has; ``inf`` and ``-inf``: nothing, a constant every stage computes)."""
    lo: list[float] = []
    hi: list[float] = []
    for i, layer in enumerate(graph.layers):
        block = graph.block_index[i]
        if block is not None:
            lo.append(block)
            hi.append(block)
            continue
        deps = [(-1, -1) if p == -1 else (lo[p], hi[p]) for p in layer.inputs]
        lo.append(min((a for a, _ in deps), default=math.inf))
        hi.append(max((b for _, b in deps), default=-math.inf))
    return lo, hi


def passes(graph) -> list[tuple[int, int, int, float, float, bool]]:
    """``(value, block, source, first, latest, needs a gradient)`` for each tensor passed to a block call: the block
    it is passed to, the layer that made it, and the first and latest block a stage must hold to compute it
    (``_origins``). A stage that starts at block ``b`` must receive it where ``first < b <= block`` (and cannot
    compute it at all where ``first < b <= latest``). One tensor may be passed on (a dropout of zero returns its
    input): each pass counts with its own source."""
    if "_passes" in graph.__dict__:
        return graph.__dict__["_passes"]
    lo, hi = _origins(graph)
    out = []
    for call in graph.block_calls:
        for arg in call.args:
            if arg.source == -1:
                first, latest = -1, -1
            elif arg.source >= 0:
                first, latest = lo[arg.source], hi[arg.source]
            else:
                continue  # a constant or a parameter: every stage has it
            out.append((arg.value, call.block, arg.source, first, latest, arg.requires_grad))
    graph.__dict__["_passes"] = out
    return out


def _crossing(graph, b: int) -> list[tuple[int, int, int, float, float, bool]]:
    """The passes a stage starting at block ``b`` must receive (those of its own blocks and later ones)."""
    return [p for p in passes(graph) if p[3] < b <= p[1]]


def crossing_sources(graph) -> dict[int, frozenset[int]]:
    """``{block: the layers whose outputs (or views of them) cross a cut before it}`` (cached on the graph): a
    stage may start there only where each is whole over tp."""
    if "_sources" not in graph.__dict__:
        graph.__dict__["_sources"] = {b: frozenset(p[2] for p in _crossing(graph, b)) for b in graph.block_starts}
    return graph.__dict__["_sources"]


def stage_cut_refusal(graph, block: int) -> str | None:
    """Why the model cannot be cut before ``graph.blocks[block]`` (``None`` if it can)."""
    return _cut_table(graph).get(block, f"block {graph.blocks[block]!r} runs no layer")


def _cut_table(graph) -> dict[int, str | None]:
    """``{block: why a cut before it is impossible, or None}`` for every block after the first that runs a
    layer (cached on the graph): each cut is possible or not on its own, whatever the other cuts."""
    if "_cuts" in graph.__dict__:
        return graph.__dict__["_cuts"]
    starts = [b for b, first in graph.block_starts.items() if first > 0]
    table: dict[int, str | None] = dict.fromkeys(starts)

    def refuse(b: int, why: str) -> None:
        if table[b] is None:
            table[b] = why

    for call in graph.block_calls:
        what = _not_rebuilt(call.output)
        for b in starts if what else ():
            refuse(b, f"block {graph.blocks[call.block]!r} returns a {what}, which a stage that skips the block "
                      "cannot stand in for; make it return tensors (or tuples of them)")
    for outer in graph.block_calls:
        inner = next((c for c in graph.block_calls if c is not outer and outer.layers[0] <= c.layers[0]
                      and c.layers[1] <= outer.layers[1] and c.layers[0] < c.layers[1]), None)
        for b in starts if inner is not None else ():
            refuse(b, f"block {graph.blocks[outer.block]!r} calls block {graph.blocks[inner.block]!r} inside its own "
                      "forward, so a stage cannot hold one without the other")
    order = [c.block for c in graph.block_calls]
    for j, block in enumerate(order):
        later = max(order[:j], default=-1)
        for b in starts:
            if block < b <= later:
                refuse(b, f"block {graph.blocks[block]!r} runs again after {graph.blocks[later]!r}: the model does "
                          "not call its blocks one after another")
    for b in starts:
        crossing = _crossing(graph, b)
        grads = {value for value, _, _, _, _, grad in crossing if grad}
        if len(grads) > 1:
            refuse(b, f"{len(grads)} tensors that need a gradient cross there (a skip connection; a pipeline sends "
                      "one activation and its gradient)")
        if any(first < b <= latest for _, _, _, first, latest, _ in crossing):
            refuse(b, "the model's own code combines values from blocks on both sides of the cut; cut where its "
                      "forward passes one block's output to the next")
    lo, _ = _origins(graph)
    out = min((lo[i] for i in graph.outputs), default=math.inf)
    for b in starts:
        if b > out:
            refuse(b, f"the model's output is computed from {graph.blocks[int(out)] if out >= 0 else 'the input'!r} "
                      "outside the blocks, before the cut")
    graph.__dict__["_cuts"] = table
    return table


def checkpointed_stages_refusal(graph) -> str | None:
    """Why pipeline stages of this model cannot recompute their blocks in backward (activation checkpointing): a
    stage replaces what a block is passed by what the stage before sent, and a block the forward calls more
    than once could not be told apart from its own recomputation. ``None`` if they can."""
    if graph.is_chain:
        return None
    counts: dict[int, int] = {}
    for call in graph.block_calls:
        counts[call.block] = counts.get(call.block, 0) + 1
    again = next((b for b, n in counts.items() if n > 1), None)
    if again is None:
        return None
    return (f"block {graph.blocks[again]!r} runs {counts[again]} times in a forward, so pipeline stages cannot "
            "recompute it with activation checkpointing; turn checkpointing off, or use no pipeline")


def _not_rebuilt(structure) -> str | None:
    """The type a stage could not stand in for within a block's returned ``structure``, or ``None``."""
    kind, rest = structure[0], structure[1:]
    if kind == "other":
        return rest[0]
    if kind in ("tuple", "list"):
        return next((t for t in map(_not_rebuilt, rest[0]) if t), None)
    if kind == "dict":
        return next((t for t in (_not_rebuilt(v) for _, v in rest[0]) if t), None)
    return None


@dataclass(frozen=True)
class StageInterface:
    """The values a stage receives from the stage before it and sends to the next (``BlockArg.value`` ids, in
    order). The first stage takes the model input (and receives none); the last returns the model's output
    (and sends none)."""

    receives: tuple[int, ...]
    sends: tuple[int, ...]


def stage_interfaces(graph, groups: list[list[str]]) -> list[StageInterface]:
    """What crosses each cut between the stages holding the blocks ``groups`` (checked by ``_cut_table``), in the
    order of ``_first_passed``, on which the two ranks of a cut agree."""
    index = {name: i for i, name in enumerate(graph.blocks)}
    starts = [min(index[name] for name in group) for group in groups[1:]]
    first = _first_passed(graph)
    receives: list[list[int]] = [[]]
    for b in starts:
        receives.append(sorted({p[0] for p in _crossing(graph, b)}, key=first.__getitem__))
    return [StageInterface(tuple(receives[s]), tuple(receives[s + 1]) if s + 1 < len(receives) else ())
            for s in range(len(receives))]


def _first_passed(graph) -> dict[int, tuple[int, int, int]]:
    """``{value: (block, the block's call, leaf)}``: where each tensor passed to a block is first passed. A value's
    number in the analysis follows the order in which the model's code made it, which may differ between processes
    (a loop over a set of strings, as ModernBERT's over its attention kinds for their rotary tables, runs in the
    order of Python's salted string hashes); where a tensor is passed does not, so the two stages of a cut order
    what crosses it alike."""
    first: dict[int, tuple[int, int, int]] = {}
    calls: dict[int, int] = {}
    for call in graph.block_calls:
        k = calls[call.block] = calls.get(call.block, -1) + 1
        for arg in call.args:
            place = (call.block, k, arg.leaf)
            first[arg.value] = min(first.get(arg.value, place), place)
    return first


def stage_io(graph, groups: list[list[str]]) -> list[tuple[tuple, tuple]]:
    """For each stage of ``groups``, what it takes and what it returns, each ``(shape, dtype, requires_grad, made by
    a layer, partitioned)`` as the analysis saw it (global shapes; ``partitioned``: a volume split in slabs): the first
    stage the model input, the others what the stage before sends (``stage_interfaces``); the last stage the tensor
    a loss reads (``ModelGraph.output``), the others what they send. A pipeline's stages exchange these without
    running a forward to find them."""
    metas = {a.value: (a.shape, a.dtype, a.requires_grad, a.source >= 0, a.partitioned)
             for call in graph.block_calls for a in call.args}
    interfaces = stage_interfaces(graph, groups)
    first = ((graph.input_shape, graph.input_dtype, False, False, graph.spatial_ndim > 0),)
    shape, dtype, grad, partitioned = graph.output[:4]
    last = ((shape, dtype, grad, False, partitioned),)
    out = []
    for s, face in enumerate(interfaces):
        inputs = first if s == 0 else tuple(metas[v] for v in face.receives)
        outputs = last if s == len(interfaces) - 1 else tuple(metas[v] for v in face.sends)
        out.append((inputs, outputs))
    return out

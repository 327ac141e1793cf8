"""Pipeline stages of a plan: how many its schedule runs (``check_stage_count``), where they may start
(``legal_starts``: a block's first layer where the model can be cut and nothing split over tp crosses), the blocks
each holds (``stage_groups``), the micro-batches the schedule takes (``check_micro_batches``) and the stage that
holds each parameter and buffer (``holding_stages``), and the blocks whose parameters are theirs alone (``own_units``:
what FSDP gathers block by block). The search, ``validate``, the runtime's check and the
pipeline runtime read these, and nothing else, about stages."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from hybridpar.errors import PlanError
from hybridpar.ir.rules.cuts import crossing_sources, stage_cut_refusal
from hybridpar.ir.sources import PARAM
from hybridpar.ir.types import SCHEDULES


def some(names: list[str], limit: int = 8) -> str:
    head = ", ".join(names[:limit])
    return head + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def check_stage_count(schedule: str, boundaries: int, pp: int) -> None:
    """The plan's ``schedule`` is known and its ``boundaries`` stage boundaries make the stages it runs:
    ``pp`` of them, or under interleaved 1F1B a multiple of ``pp``, at least ``2 pp``."""
    if schedule not in SCHEDULES:
        raise PlanError(f"schedule = {schedule!r}: use one of {', '.join(SCHEDULES)}")
    stages = boundaries + 1
    if schedule == "interleaved-1f1b" and pp > 1:
        if stages % pp or stages < 2 * pp:
            raise PlanError(f"interleaved-1f1b with pp={pp} needs a multiple of {pp} stages, at least {2 * pp}, "
                            f"but the plan's {boundaries} stage boundaries make {stages}")
    elif stages != pp:
        raise PlanError(f"pp={pp} needs {pp - 1} stage boundaries (the first layer of each stage after the first), "
                        f"but the plan lists {boundaries}; interleaved-1f1b runs several stages per rank")


def check_micro_batches(micro_batches: int, num_stages: int, pp: int, schedule: str) -> None:
    """The micro-batch counts PyTorch's schedules take: 1F1B at least one per stage; interleaved 1F1B a
    multiple of its rounds (``max(1, m // pp)``)."""
    if schedule == "1f1b" and micro_batches < num_stages:
        raise PlanError(f"micro_batches = {micro_batches}: 1F1B over {num_stages} stages needs at least "
                        f"{num_stages}; use more micro-batches, or the gpipe schedule")
    rounds = max(1, micro_batches // pp)
    if schedule == "interleaved-1f1b" and micro_batches % rounds:
        raise PlanError(f"micro_batches = {micro_batches}: interleaved 1F1B with pp={pp} needs a multiple of "
                        f"{rounds}; use a multiple of {pp}")


def pipeline_norm_refusal(graph, micro_batches: int) -> str | None:
    """Why a pipeline of ``micro_batches`` micro-batches would not compute what one process computes on the batch: a
    batch norm in training takes its statistics over what it is given, one micro-batch. ``None`` if it would."""
    norm = next((layer for layer in graph.layers if layer.kind == "batch_norm"), None)
    if norm is None or micro_batches == 1:
        return None
    return (f"layer {norm.name!r} ({norm.op}) would take its statistics over each of the {micro_batches} "
            "micro-batches of a pipeline, not over the batch one process normalises; use micro_batches = 1 (the "
            "gpipe schedule), or no pipeline")


def legal_starts(graph, split: Callable[[int], bool] = lambda i: False) -> list[int]:
    """Layers a stage may start at: 0, and each of the graph's stage starts (``ModelGraph.stage_starts``: a block's
    first layer where the rules allow a cut) where nothing that crosses is split over tp (``split(i)``: layer ``i``
    leaves its output split; a graph built by hand, without blocks: the layer before the start)."""
    if not graph.blocks:
        return [0] + [i for i in graph.stage_starts if not split(i - 1)]
    sources = crossing_sources(graph)
    block_of = {first: b for b, first in graph.block_starts.items()}
    return [0] + [i for i in graph.stage_starts if not any(split(p) for p in sources[block_of[i]])]


def stage_starts(graph, starts: Iterable[str], split: Callable[[int], bool] = lambda i: False) -> tuple[int, ...]:
    """The layer indices of the plan's ``stages`` (the first layer of each stage after the first), each a legal
    start (``legal_starts``), distinct and in order; a ``PlanError`` naming the first that is not."""
    starts = list(starts)
    if graph.blocks and len(starts) + 1 > len(graph.blocks):
        raise PlanError(f"{len(starts) + 1} pipeline stages, but {graph.name} has {len(graph.blocks)} blocks "
                        f"({some(list(graph.blocks))}); use at most {len(graph.blocks)} stages")
    firsts = {graph.layers[i].name: b for b, i in graph.block_starts.items()} if graph.blocks else {}
    legal = set(legal_starts(graph, split)) - {0}
    out = []
    for name in starts:
        index = _index(graph, name, firsts)
        if index not in legal:
            raise PlanError(f"a stage cannot start at {name!r}: {_why_not(graph, index, firsts.get(name), split)}")
        out.append(index)
    if out != sorted(set(out)):
        raise PlanError(f"stage boundaries {list(starts)} must be distinct and in the model's order")
    return tuple(out)


def _index(graph, name: str, firsts: dict[str, int]) -> int:
    names = graph.__dict__.get("_names") or {layer.name: layer.index for layer in graph.layers}
    if name not in names:
        raise PlanError(f"stage boundary {name!r} is not a layer of the model ({graph.name})")
    if graph.blocks and name not in firsts:
        starts = [graph.layers[i].name for i in graph.stage_starts]
        if not starts:
            why = next((stage_cut_refusal(graph, b) for b, i in graph.block_starts.items() if b > 0 and i > 0),
                       "it has one block")
            raise PlanError(f"a stage cannot start at {name!r}, nor anywhere in {graph.name}: {why}; use pp=1")
        raise PlanError(f"a stage cannot start at {name!r}: stages start where a block starts, at one of "
                        f"{some(starts)}")
    return names[name]


def _why_not(graph, index: int, block: int | None, split) -> str:
    if block is not None:
        if block == 0:
            return "it is the first block"
        refused = stage_cut_refusal(graph, block)
        if refused:
            return refused
        inside = sorted(p for p in crossing_sources(graph)[block] if split(p))
        if inside:
            return (f"{graph.layers[inside[0]].name!r} leaves its output split over tp there; cut outside the layers "
                    "that split together")
    starts = [graph.layers[i].name for i in legal_starts(graph, split)[1:]]
    return f"more than one tensor (or a tp-split one) crosses there; stages can start at {some(starts)}"


def stage_groups(graph, cuts: tuple[int, ...]) -> list[list[str]]:
    """The block names of each stage, for stages starting at the layers ``cuts`` (``stage_starts``)."""
    names = list(graph.blocks)
    first_block = {i: b for b, i in graph.block_starts.items()}
    bounds = [0] + [first_block[i] for i in cuts] + [len(names)]
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


def holding_stages(names: Iterable[str], groups: list[list[str]], pp: int) -> dict[str, tuple[int, ...]]:
    """The pipeline stages that hold a copy of each state-dict entry (pp rank: the stage modulo ``pp``): the stage
    of the block it belongs to; every stage for what belongs to no block (registered on a module the blocks were
    expanded from, as a wrapper's parameter or a ViT's class token: each stage runs the model's own code, and the
    copies' gradients are summed over the stages, as a tied weight's)."""
    if pp == 1:
        return dict.fromkeys(names, (0,))
    stage_of = {unit: i for i, group in enumerate(groups) for unit in group}
    every = tuple(range(len(groups)))
    out = {}
    for name in names:
        unit = next((u for u in stage_of if name.startswith(u + ".")), None)
        out[name] = every if unit is None else (stage_of[unit],)
    return out


def own_units(graph) -> tuple[str, ...]:
    """The blocks, of those the forward calls, whose parameters only their own forward reads and no other name
    shares: FSDP gathers each of these in its own forward. A block whose weight another module reads (DeBERTa's
    relative-position table, read by its encoder; a head that reads the embedding's weight) or that shares a
    parameter with another module (a tied head, a module registered twice) stays with the root, which gathers
    it once for all its uses."""
    def block_of(name: str) -> str | None:
        return next((b for b in graph.blocks if name.startswith(b + ".")), None)

    def inside(owner: str, block: str) -> bool:
        return owner == block or owner.startswith(block + ".")

    foreign = {block_of(n) for names in graph.shared for n in names}
    for layer in graph.layers:
        read = set(layer.params) | {n for r in layer.reads if r.source == PARAM for n in r.params}
        foreign.update(b for b in map(block_of, read) if b is not None and not inside(layer.owner, b))
    return tuple(b for b in graph.blocks if b not in foreign)

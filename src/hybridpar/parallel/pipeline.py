"""Pipeline parallelism on PyTorch's ``torch.distributed.pipelining``: stages cut from a model's top-level
sequence of blocks, built by hand as ``PipelineStage``s, run by its GPipe, 1F1B or interleaved 1F1B schedule.

A model pipelines if its forward is the composition of its top-level *blocks* in order, each reading only
the output of the one before (``hybridpar.plan.graph.blocks``: the top-level children, with an
``nn.Sequential`` or ``nn.ModuleList`` child expanded into its entries; a GPT: ``embed``, ``blocks.0`` ...
``blocks.N-1``, ``ln_f``, ``lm_head``; CosmoFlow: the layers of ``features`` and of ``head``).
``stage_units`` checks this on the layer graph (every layer runs in a block, in order, and one tensor
crosses each cut) before anything is built; the planner cuts only there too. A stage's module is a copy of
the model in which every block of other stages is an ``nn.Identity``: it runs the model's own forward,
keeps the original parameter names, and holds only its own blocks' parameters.

With ``S`` stages on ``pp`` ranks, rank ``r`` of the pp axis holds stage ``r`` (GPipe, 1F1B: ``S = pp``) or
stages ``r, r + pp, r + 2 pp, ...`` (interleaved 1F1B: ``S`` a multiple of ``pp``, at least ``2 pp``).
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from hybridpar.errors import PlanError
from hybridpar.plan.graph import ModelGraph, blocks
from hybridpar.plan.types import SCHEDULES as PLAN_SCHEDULES
from hybridpar.plan.validate import check_stage_count, some

SCHEDULES = dict(zip(PLAN_SCHEDULES, (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B)))


def stage_units(graph: ModelGraph, starts: tuple[str, ...], pp: int, schedule: str) -> list[list[str]]:
    """The block names of each stage, for stages starting at the layers named in ``starts`` (the plan's
    ``stages``: the first layer of each stage after the first); checked against the graph."""
    check_stage_count(schedule, len(starts), pp)
    num_stages = len(starts) + 1
    names = list(graph.blocks)
    if num_stages > len(names):
        raise PlanError(f"{num_stages} pipeline stages, but {graph.name} has {len(names)} top-level blocks "
                        f"({some(names)}); use at most {len(names)} stages")
    if graph.unordered_layer is not None:
        raise PlanError(f"layer {graph.unordered_layer.name!r} runs outside the top-level blocks of {graph.name} "
                        f"in order ({some(names)}), so the model cannot be cut into pipeline stages; write its "
                        "forward as those blocks applied one after another (move that work into a block)")
    firsts = {layer.name: layer.index for layer in graph.layers
              if layer.index == 0 or graph.block_index[layer.index] != graph.block_index[layer.index - 1]}
    bounds = [0]
    for start in starts:
        if start not in firsts:
            raise PlanError(f"a stage cannot start at {start!r}: stages start where a top-level block starts, "
                            f"at one of {some(list(firsts))}")
        if firsts[start] not in graph.stage_starts:
            raise PlanError(f"a stage cannot start at {start!r}: more than one tensor crosses there; move the "
                            "boundary to another block")
        block = graph.block_index[firsts[start]]
        if block <= bounds[-1]:
            raise PlanError(f"stage boundaries {list(starts)} must be distinct and in the model's order")
        bounds.append(block)
    bounds.append(len(names))
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


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


def stage_module(model: nn.Module, keep: list[str]) -> nn.Module:
    """A copy of ``model`` with the units in ``keep`` and ``nn.Identity`` for every other unit (whose
    parameters are not copied)."""
    others = {id(module): nn.Identity() for name, module in blocks(model) if name not in keep}
    return copy.deepcopy(model, memo=others)


def stages_of_rank(num_stages: int, pp: int, rank: int) -> list[int]:
    """The stage indices pp-rank ``rank`` holds (loop-style: ``rank, rank + pp, ...``)."""
    return list(range(rank, num_stages, pp))


def build_schedule(modules: dict[int, nn.Module], num_stages: int, schedule: str, micro_batches: int,
                   loss_fn, group, device: torch.device):
    """The plan's ``schedule`` over this rank's stage ``modules`` (``{stage index: module}``)."""
    stages = [PipelineStage(module, index, num_stages, device, group=group) for index, module in modules.items()]
    if schedule == "interleaved-1f1b":
        return SCHEDULES[schedule](stages, micro_batches, loss_fn=loss_fn)
    return SCHEDULES[schedule](stages[0], micro_batches, loss_fn=loss_fn)

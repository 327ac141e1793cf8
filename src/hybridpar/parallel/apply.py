"""``hybridpar.parallelize``: a Plan applied to an ordinary model, in one fixed order, as a ``ParallelModel``.

The order (each step only where the plan asks for it):

1. **check** everything that can be wrong (mesh against plan, layer names and strategies, divisibility,
   heads, splits followed to every reader, shared parameters, the spatial grid, pipeline cuts and what
   crosses them, batch sizes) by the rules the planner reads (``hybridpar.ir.rules``), identically on
   every rank and before any communication;
2. **pipeline stages**: this rank's stage module(s), cut between the model's blocks (``parallel.pipeline``);
   without pipelining, the model itself;
3. **tensor** parallelism: column / row / shard per layer (``parallel.tensor``: DTensor for Linear and
   Embedding layers, filter / channel splits for convolutions, which keep an ordinary conv of their channels);
4. **spatial** parallelism: convolutions (split ones included), pooling and normalisations on slabs
   (``spatial.parallelize``);
5. **activation checkpointing** of each block;
6. **data** parallelism over the ``dp x spatial`` ranks: DDP (sharding 0), FSDP2 ``fully_shard`` per block
   and at the root (sharding 1 and 2 keep the gathered parameters from forward to backward, 3 frees them);
7. the pipeline **schedule** (GPipe, 1F1B, interleaved 1F1B) over the stages.

DDP cannot wrap DTensor parameters, and its reducer fails on a stage that runs several micro-batches'
forwards before their backwards (GPipe, interleaved 1F1B); so with tensor or pipeline parallelism and
sharding 0 the ``ParallelModel`` all-reduces the gradients over ``dp x spatial`` itself after the step's
backward: the same mean DDP takes, without its overlap of communication and backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from hybridpar.errors import PlanError
from hybridpar.geometry import Grid
from hybridpar.ir import rules
from hybridpar.ir.analysis import blocks
from hybridpar.ir.check import Checked, replica_batch
from hybridpar.ir.graph import ModelGraph
from hybridpar.ir.types import Plan
from hybridpar.mesh import build_mesh, device_of, flat_mesh
from hybridpar.parallel import pipeline
from hybridpar.parallel.data import data_parallel
from hybridpar.parallel.model import ParallelModel
from hybridpar.parallel.plan_check import check_mesh, check_plan
from hybridpar.parallel.tensor import apply_splits

BATCH_NORM_SCOPES = {"global": ("dp", "spatial"), "spatial": ("spatial",)}  # the mesh axes of the statistics


def parallelize(model: nn.Module, plan: Plan, mesh: DeviceMesh | None = None, *,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                example_input: torch.Tensor | None = None, batch_norm: str = "global",
                graph: ModelGraph | None = None) -> ParallelModel:
    """``model`` run as ``plan`` says over ``mesh`` (axes ``pp, dp, spatial, tp``; built from the plan if
    ``None``). ``loss_fn(output, target)`` must be a mean over the samples. ``example_input`` (a tensor of
    one step's global batch, or any batch) is what the model is analysed with; by default a tensor of
    ``plan.input_shape``, of token ids for a model that starts with an ``nn.Embedding``. Under spatial
    parallelism, batch-norm statistics are taken over the global batch (``batch_norm="global"``: the
    ``dp x spatial`` ranks) or over each replica's (``"spatial"``: its spatial ranks). ``model`` is
    consumed: use the returned model's ``full_state_dict()`` to read its weights. ``graph``: the model's analysis for
    ``example_input`` (``hybridpar.ir.graph_of``), where the caller has it already: a model is analysed once."""
    if batch_norm not in BATCH_NORM_SCOPES:
        raise PlanError(f"batch_norm = {batch_norm!r}: use one of {', '.join(BATCH_NORM_SCOPES)}")
    checked = check_plan(model, plan, example_input, graph)
    graph, groups = checked.graph, [list(g) for g in checked.groups]
    shape = graph.input_shape
    grid = plan.grid if math.prod(plan.spatial) > 1 else Grid((1,) * max(len(shape) - 2, 1))  # one part per dim
    names = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict(keep_vars=True).items()}
    params = {name for name, _ in model.named_parameters()}
    holders = {name: tuple(dict.fromkeys(s % plan.pp for s in stages)) for name, stages in checked.holders.items()}
    owners = {name: ranks[0] for name, ranks in holders.items()}
    mesh = mesh if mesh is not None else build_mesh(plan.dims, dist.get_world_size())  # the first collective
    check_mesh(plan, mesh)
    pp_rank = mesh["pp"].get_local_rank()
    held = pipeline.stages_of_rank(len(groups), plan.pp, pp_rank) if plan.pp > 1 else [0]
    device = device_of(mesh)
    modules, manual_sync = {}, False
    for index in held:
        module, run = pipeline.stage_module(model, checked.micro_graph, groups, index, device) if plan.pp > 1 \
            else (model, None)
        modules[index], manual = _build(module.to(device), plan, grid, mesh, checked, BATCH_NORM_SCOPES[batch_norm],
                                        run)
        manual_sync = manual_sync or manual
    schedule, loss_fn = None, _ScheduleLoss(loss_fn)
    if plan.pp > 1:
        schedule = pipeline.build_schedule(modules, checked.micro_graph, groups, plan.schedule, plan.micro_batches,
                                           loss_fn, mesh["pp"].get_group(), device, _local_shape(plan, grid, mesh))
    tied = _tied_groups(_copied(graph.shared, params, checked.holders), holders, mesh, plan.pp) if plan.pp > 1 \
        else []
    batch = replica_batch(plan, shape[0])
    return ParallelModel(modules, schedule, plan, mesh, loss_fn, names, params, owners, manual_sync, batch, tied)


def _local_shape(plan: Plan, grid: Grid, mesh: DeviceMesh):
    """What this rank holds of a tensor a pipeline stage exchanges, given its global shape, whether a layer made it
    and whether it is a volume split in slabs: its slab (spatial parallelism), its share of the sequence (sequence
    parallelism splits every activation the tp ranks would hold whole along its dim -2), or all of it."""
    rank = mesh["spatial"].get_local_rank()

    def local(shape: tuple[int, ...], made: bool, partitioned: bool) -> tuple[int, ...]:
        if partitioned and grid.size > 1:
            return tuple(shape[:2]) + tuple(b - a for a, b in grid.slab(tuple(shape[2:]), rank))
        if plan.sequence_parallel and made:
            return tuple(shape[:-2]) + (shape[-2] // plan.tp,) + tuple(shape[-1:])
        return tuple(shape)

    return local


class _ScheduleLoss:
    """The loss function a pipeline's last stage calls per micro-batch, switched off (a zero) while
    ``ParallelModel.predict`` runs the schedule for its outputs: PyTorch's schedules compute the loss
    whenever they have a loss function, even in ``eval``."""

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.fn, self.off = fn, False

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return output.new_zeros(()) if self.off else self.fn(output, target)


def _copied(shared: tuple[tuple[str, ...], ...], params: set[str], stages: dict[str, tuple[int, ...]]) -> list:
    """The names of each parameter that several pipeline stages hold a copy of: one used by blocks of several stages
    (a head tied to the token embedding), or one that belongs to no block (every stage holds it)."""
    groups = list(shared) + [(name,) for name in sorted(params) if not any(name in g for g in shared)]
    return [names for names in groups if len({r for n in names for r in stages.get(n, ())}) > 1]


def _tied_groups(tied: list[tuple[str, ...]], holders: dict[str, tuple[int, ...]], mesh: DeviceMesh, pp: int) -> list:
    """For each parameter that several pipeline ranks hold a copy of: ``(its names, the process group of the pp ranks
    of this rank's pipeline that hold a copy)``, or no group where one rank holds them all (its stages' copies are
    summed locally); left out where this rank holds no copy. Every rank creates every group, in the same order
    (``new_group`` asks it)."""
    lines = mesh.mesh.movedim(0, -1).reshape(-1, pp).tolist()  # the global ranks of each pipeline
    me, out = dist.get_rank(), []
    for names in tied:
        ranks = sorted({r for n in names for r in holders.get(n, ())})
        mine = None
        for line in lines:
            group = dist.new_group([line[r] for r in ranks]) if len(ranks) > 1 else None
            if me in line and line.index(me) in ranks:
                mine = (names, group)
        if mine is not None:
            out.append(mine)
    return out


def _build(module: nn.Module, plan: Plan, grid: Grid, mesh: DeviceMesh, checked: Checked,
           norm_axes: tuple[str, ...], run) -> tuple[nn.Module, bool]:
    """Steps 3-6 of the module doc on one module (the model, or one pipeline stage, connected to its ``run``
    once its splits are made); also whether the gradients need a manual all-reduce (tensor or pipeline
    parallelism under sharding 0). ``grid`` is the plan's spatial grid with one part per spatial dim of the
    input where the plan splits none."""
    if checked.splits:
        module = apply_splits(module, checked.splits, mesh["tp"], checked.graph.shared)
    if run is not None:
        pipeline.connect(module, run)
    shared_norms = _has_batch_norm(module) and mesh[norm_axes].size() > 1
    if grid.size > 1 or shared_norms:  # the spatial runtime also sums batch-norm statistics over ranks
        from hybridpar import spatial

        module = spatial.parallelize(module, mesh["spatial"], grid=grid, batch_norm_mesh=mesh[norm_axes])
    held = [(name, m) for name, m in blocks(module) if not getattr(m, "stands_in", False)]
    if plan.checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        wrapped = {id(b) for _, b in held}
        apply_activation_checkpointing(module, check_fn=lambda m: id(m) in wrapped)
    if plan.dp * math.prod(plan.spatial) == 1:
        return module, False
    if plan.sharding:
        from torch.distributed.fsdp import fully_shard

        dp_mesh = flat_mesh(mesh, ("dp", "spatial"))
        units = set(rules.own_units(checked.graph))
        for name, block in held:
            if name in units and any(True for _ in block.parameters()):
                fully_shard(block, mesh=dp_mesh, reshard_after_forward=plan.sharding == 3)
        return fully_shard(module, mesh=dp_mesh, reshard_after_forward=plan.sharding == 3), False
    if checked.splits or plan.pp > 1:
        return module, True
    # parameters the forward never uses leave their DDP bucket unfinished: told so, DDP reduces it anyway
    return data_parallel(module, mesh, find_unused_parameters=bool(checked.graph.unused)), False


def _has_batch_norm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


__all__ = ["ParallelModel", "check_plan", "parallelize"]

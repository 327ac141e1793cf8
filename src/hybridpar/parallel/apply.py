"""``hybridpar.parallelize``: a Plan applied to an ordinary model, in one fixed order, as a ``ParallelModel``.

The order (each step only where the plan asks for it):

1. **check** everything that can be wrong (mesh against plan, layer names and strategies, divisibility,
   heads, splits followed to every reader, shared parameters, the spatial grid, pipeline cuts and what
   crosses them, batch sizes) by the rules the planner reads (``hybridpar.plan.rules``), identically on
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

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from hybridpar.errors import PlanError
from hybridpar.mesh import AXES, build_mesh
from hybridpar.parallel import pipeline
from hybridpar.parallel.channels import _SplitConv, gather_parameter
from hybridpar.parallel.data import flat_group, flat_mesh
from hybridpar.parallel.tensor import apply_splits, check_strategies
from hybridpar.parallel.pipeline import model_output
from hybridpar.plan import check_grid, graph_of, rules
from hybridpar.plan.graph import ModelGraph, blocks, input_dtype_of
from hybridpar.plan.types import SHARDING_NAMES, Plan

WRAPPER_PARTS = ("_checkpoint_wrapped_module.",)
BATCH_NORM_SCOPES = {"global": ("dp", "spatial"), "spatial": ("spatial",)}  # the mesh axes of the statistics


def parallelize(model: nn.Module, plan: Plan, mesh: DeviceMesh | None = None, *,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                example_input: torch.Tensor | None = None, batch_norm: str = "global") -> "ParallelModel":
    """``model`` run as ``plan`` says over ``mesh`` (axes ``pp, dp, spatial, tp``; built from the plan if
    ``None``). ``loss_fn(output, target)`` must be a mean over the samples. ``example_input`` (a tensor of
    one step's global batch, or any batch) is what the model is analysed with; by default a tensor of
    ``plan.input_shape``, of token ids for a model that starts with an ``nn.Embedding``. Under spatial
    parallelism, batch-norm statistics are taken over the global batch (``batch_norm="global"``: the
    ``dp x spatial`` ranks) or over each replica's (``"spatial"``: its spatial ranks). ``model`` is
    consumed: use the returned model's ``full_state_dict()`` to read its weights."""
    if batch_norm not in BATCH_NORM_SCOPES:
        raise PlanError(f"batch_norm = {batch_norm!r}: use one of {', '.join(BATCH_NORM_SCOPES)}")
    checked = check_plan(model, plan, example_input)
    graph, groups = checked.graph, checked.groups
    shape = graph.input_shape
    grid = plan.spatial if math.prod(plan.spatial) > 1 else (1,) * max(len(shape) - 2, 1)  # one part per dim
    names = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict(keep_vars=True).items()}
    params = {name for name, _ in model.named_parameters()}
    stages = _stages(names, groups, plan.pp)
    owners = {name: stage % plan.pp for name, stage in stages.items()}
    mesh = mesh if mesh is not None else build_mesh(plan.dims, dist.get_world_size())  # the first collective
    _check_mesh(plan, mesh)
    pp_rank = mesh["pp"].get_local_rank()
    held = pipeline.stages_of_rank(len(groups), plan.pp, pp_rank) if plan.pp > 1 else [0]
    device = _device(mesh)
    modules, manual_sync = {}, False
    for index in held:
        module, run = pipeline.stage_module(model, checked.micro_graph, groups, index, device) if plan.pp > 1 \
            else (model, None)
        modules[index], manual = _build(module.to(device), plan, grid, mesh, checked, BATCH_NORM_SCOPES[batch_norm],
                                        run)
        manual_sync = manual_sync or manual
    schedule, loss_fn = None, _ScheduleLoss(loss_fn)
    if plan.pp > 1:
        schedule = pipeline.build_schedule(modules, len(groups), plan.schedule, plan.micro_batches, loss_fn,
                                           mesh["pp"].get_group(), device)
    tied = _tied_groups([names for names in graph.shared if len({stages.get(n) for n in names}) > 1]
                        if plan.pp > 1 else [], stages, mesh, plan.pp)
    batch = replica_batch(plan, shape[0])
    return ParallelModel(modules, schedule, plan, mesh, loss_fn, names, params, owners, manual_sync, batch, tied)


class _ScheduleLoss:
    """The loss function a pipeline's last stage calls per micro-batch, switched off (a zero) while
    ``ParallelModel.predict`` runs the schedule for its outputs: PyTorch's schedules compute the loss
    whenever they have a loss function, even in ``eval``."""

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.fn, self.off = fn, False

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return output.new_zeros(()) if self.off else self.fn(output, target)


@dataclass(frozen=True)
class Checked:
    """What ``check_plan`` found: the model's graph (and, for a pipeline, its graph for one micro-batch, whose
    shapes the stages exchange), the tensor-parallel splits, the block names of each pipeline stage."""

    graph: ModelGraph
    splits: dict
    groups: list
    micro_graph: ModelGraph | None = None


def check_plan(model: nn.Module, plan: Plan, example_input: torch.Tensor | None = None,
               graph: ModelGraph | None = None) -> Checked:
    """Every check of ``plan`` against ``model`` that needs no process group, identical on every rank (``model``
    may live on the meta device; ``graph``: its layer graph, if the caller has analysed it already): the
    rules the planner reads (``hybridpar.plan.rules``), or a ``PlanError``."""
    if plan.sharding not in SHARDING_NAMES:
        raise PlanError(f"sharding = {plan.sharding!r}: use 0 (DDP), 1, 2 or 3 (FSDP)")
    if plan.pp == 1 and plan.micro_batches != 1:
        raise PlanError(f"micro_batches = {plan.micro_batches}: use 1 without pipeline stages (pp=1)")
    if plan.sequence_parallel and plan.tp == 1:
        raise PlanError("sequence_parallel = true needs tp > 1: it splits along the sequence what the "
                        "tensor-parallel ranks would otherwise each hold whole")
    if plan.tp == 1 and plan.layers and any(s != "replicate" for _, s in plan.layers):
        raise PlanError(f"the plan splits layers over tp ({dict(plan.layers)}) but tp=1; set tp, or drop layers")
    example = _example(model, plan, example_input)  # its shape and dtype: every rank analyses the same zeros
    example = torch.zeros(example.shape, dtype=example.dtype, device="meta")
    graph = graph or graph_of(model, example, dtype=_dtype_name(model))
    spatial, sharded = math.prod(plan.spatial) > 1, plan.sharding > 0 and math.prod(plan.spatial) * plan.dp > 1
    if spatial:
        check_grid(graph, plan.spatial)  # the spatial runtime's rules, before its first exchange
    splits = check_strategies(dict(plan.layers), graph, plan.tp, sequence_parallel=plan.sequence_parallel,
                              spatial=spatial, sharded=sharded) if plan.tp > 1 else {}
    idle = rules.idle_tp_refusal(graph, plan.tp, [s.strategy for s in splits.values()])
    if idle:
        raise PlanError(f"{idle}; list the layers to split (hybridpar.parallel.tensor.pair_strategies finds them), "
                        "or use dp instead")
    groups = _stage_groups(model, graph, plan)
    _stages(model.state_dict(), groups, plan.pp)  # every parameter and buffer in a block
    _check_cuts_whole(graph, plan, splits)
    micro = None
    if plan.pp > 1 and plan.checkpointing and rules.checkpointed_stages_refusal(graph):
        raise PlanError(rules.checkpointed_stages_refusal(graph))
    if plan.pp > 1:
        if spatial and not graph.is_chain:
            raise PlanError(f"pipeline stages with spatial={plan.spatial} need a model whose forward applies its "
                            f"blocks one after another to each other's output ({graph.name} passes them other "
                            "values too); use spatial or pipeline parallelism, not both")
        micro = _micro_graph(model, plan, graph, example, groups)
    return Checked(graph, splits, groups, micro)


def _check_cuts_whole(graph: ModelGraph, plan: Plan, splits: dict) -> None:
    """What crosses a pipeline cut is whole over tp (a stage receives the global shapes of the analysis)."""
    split = {graph.index_of(name) for name, s in splits.items()
             if s.strategy == "shard" or (s.strategy == "column" and not s.gather_output)}
    sources = rules.crossing_sources(graph) if split and graph.blocks else {}
    for start in plan.stages:
        block = graph.block_index[graph.index_of(start)]
        inside = sorted(sources.get(block, frozenset()) & split)
        if inside:
            raise PlanError(f"a stage cannot start at {start!r}: {graph.layers[inside[0]].name!r} leaves its output "
                            "split over tp there; cut outside the layers that split together")


def _micro_graph(model: nn.Module, plan: Plan, graph: ModelGraph, example, groups: list[list[str]]) -> ModelGraph:
    """The graph of one micro-batch: the shapes the pipeline stages exchange and stand in for; each stage is
    run on the meta device, as it will run, so that a forward the stages cannot run fails here."""
    size = replica_batch(plan, graph.input_shape[0]) // plan.micro_batches
    piece = torch.zeros((size,) + tuple(example.shape[1:]), dtype=example.dtype, device="meta")
    micro = graph_of(model, piece, dtype=_dtype_name(model))
    pipeline.check_stages(model, micro, groups)
    return micro


def _check_mesh(plan: Plan, mesh: DeviceMesh) -> None:
    names = tuple(mesh.mesh_dim_names or ())
    if names != AXES:
        raise PlanError(f"mesh axes {names}: hybridpar.parallelize takes a mesh with axes {AXES} "
                        "(hybridpar.mesh.build_mesh builds it)")
    sizes = dict(zip(names, mesh.shape))
    wanted = plan.dims.sizes()
    if sizes != wanted:
        raise PlanError(f"the mesh has {sizes} ranks per axis, but the plan ({plan.describe()}) needs {wanted}; "
                        "build the mesh from the plan's degrees (hybridpar.mesh.build_mesh(plan.dims, world_size))")


def _example(model: nn.Module, plan: Plan, example_input: torch.Tensor | None):
    if example_input is not None:
        return example_input
    if not plan.input_shape:
        raise PlanError("the plan has no input_shape; pass example_input= (one batch of the model's input)")
    return torch.zeros(plan.input_shape, dtype=input_dtype_of(model))


def _dtype_name(model: nn.Module) -> str:
    param = next(model.parameters(), None)
    return str(param.dtype).removeprefix("torch.") if param is not None else "float32"


def _stage_groups(model: nn.Module, graph: ModelGraph, plan: Plan) -> list[list[str]]:
    if plan.pp == 1:
        if plan.stages:
            raise PlanError(f"the plan lists stage boundaries {list(plan.stages)} but pp=1; set pp or drop stages")
        return [list(graph.blocks)]
    batch = replica_batch(plan, graph.input_shape[0])
    if batch % plan.micro_batches:
        raise PlanError(f"a replica's batch of {batch} does not split into micro_batches={plan.micro_batches} "
                        "equal micro-batches; use a batch that is a multiple of micro_batches")
    groups = pipeline.stage_units(graph, plan.stages, plan.pp, plan.schedule)
    pipeline.check_micro_batches(plan.micro_batches, len(groups), plan.pp, plan.schedule)
    return groups


def replica_batch(plan: Plan, example_batch: int) -> int:
    """The samples of one replica per step: of the plan's global batch, or of the example input's."""
    return (example_batch if plan.global_batch <= 1 else plan.global_batch) // plan.dp


def _tied_groups(tied: list[tuple[str, ...]], stages: dict[str, int], mesh: DeviceMesh, pp: int) -> list:
    """For each parameter that several pipeline stages hold a copy of: ``(its names, the process group of the pp
    ranks of this rank's pipeline that hold a copy)``, or no group where one rank holds them all (its stages'
    copies are summed locally); left out where this rank holds no copy. Every rank creates every group, in
    the same order (``new_group`` asks it)."""
    lines = mesh.mesh.movedim(0, -1).reshape(-1, pp).tolist()  # the global ranks of each pipeline
    me, out = dist.get_rank(), []
    for names in tied:
        holders = sorted({stages[n] % pp for n in names if n in stages})
        mine = None
        for line in lines:
            group = dist.new_group([line[r] for r in holders]) if len(holders) > 1 else None
            if me in line and line.index(me) in holders:
                mine = (names, group)
        if mine is not None:
            out.append(mine)
    return out


def _stages(names, groups: list[list[str]], pp: int) -> dict[str, int]:
    """The pipeline stage that holds each state-dict entry (pp rank: the stage modulo ``pp``)."""
    if pp == 1:
        return dict.fromkeys(names, 0)
    stage_of = {unit: i for i, group in enumerate(groups) for unit in group}
    out = {}
    for name in names:
        unit = next((u for u in stage_of if name.startswith(u + ".")), None)
        if unit is None:
            raise PlanError(f"{name!r} belongs to none of the model's blocks; hybridpar.parallelize needs every "
                            "parameter and buffer of a pipelined model inside a block (a child module)")
        out[name] = stage_of[unit]
    return out


def _device(mesh: DeviceMesh) -> torch.device:
    return torch.device("cpu") if mesh.device_type == "cpu" else torch.device(mesh.device_type,
                                                                              torch.cuda.current_device())


def _build(module: nn.Module, plan: Plan, grid: tuple[int, ...], mesh: DeviceMesh, checked: Checked,
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
    if math.prod(grid) > 1 or shared_norms:  # the spatial runtime also sums batch-norm statistics over ranks
        from hybridpar import spatial

        module = spatial.parallelize(module, mesh["spatial"], grid=grid, batch_norm_mesh=mesh[norm_axes])
    held = [m for _, m in blocks(module) if not getattr(m, "stands_in", False)]
    if plan.checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        wrapped = {id(b) for b in held}
        apply_activation_checkpointing(module, check_fn=lambda m: id(m) in wrapped)
    if plan.dp * math.prod(plan.spatial) == 1:
        return module, False
    if plan.sharding:
        from torch.distributed.fsdp import fully_shard

        dp_mesh = flat_mesh(mesh, ("dp", "spatial"))
        for block in _fsdp_units(module, held):
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=plan.sharding == 3)
        return fully_shard(module, mesh=dp_mesh, reshard_after_forward=plan.sharding == 3), False
    if checked.splits or plan.pp > 1:
        return module, True
    # parameters the forward never uses leave their DDP bucket unfinished: told so, DDP reduces it anyway
    return DistributedDataParallel(module, process_group=flat_group(mesh, ("dp", "spatial")),
                                   find_unused_parameters=bool(checked.graph.unused)), False


def _fsdp_units(module: nn.Module, held: list[nn.Module]) -> list[nn.Module]:
    """The blocks FSDP shards one by one: those with parameters, each registered once (a parameter under two
    names, a head tied to the token embedding or a module registered twice, stays with the root, which
    gathers it once for all its uses)."""
    count: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        count[id(p)] = count.get(id(p), 0) + 1
    return [block for block in held if any(True for _ in block.parameters())
            and all(count[id(p)] == 1 for p in block.parameters())]


def _has_batch_norm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


class ParallelModel:
    """A model parallelized by a plan: ``train_step`` runs one step's forward and backward (all
    micro-batches), leaving the gradients on the local parameters for any torch optimizer."""

    def __init__(self, modules: dict[int, nn.Module], schedule, plan: Plan, mesh: DeviceMesh, loss_fn,
                 names: dict, params: set[str], owners: dict[str, int], manual_sync: bool, replica_batch: int,
                 tied: list = ()):
        self.modules, self.schedule, self.plan, self.mesh = modules, schedule, plan, mesh
        self._tied = list(tied)  # (names, group) of each parameter that several pipeline stages hold a copy of
        self.loss_fn, self._manual_sync = loss_fn, manual_sync
        self._replica_batch = replica_batch  # the batch the pipeline stages' buffers are shaped for
        self._names, self._params, self._owners = names, params, owners  # of the original model
        self._num_stages = len(modules) * plan.pp if plan.pp > 1 else 1
        self.device = _device(mesh)

    @property
    def module(self) -> nn.Module:
        """The parallel module (without pipelining; with it, this rank's first stage)."""
        return self.modules[min(self.modules)]

    def parameters(self):
        """This rank's parameters (local shards, DTensors where PyTorch's engines keep them so)."""
        for module in self.modules.values():
            yield from module.parameters()

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one step on this replica's batch; returns its loss (the mean over its
        micro-batches, the same on every rank of the replica). Gradients accumulate: zero them between
        steps (``optimizer.zero_grad()``)."""
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        if self.schedule is None:
            loss = self.loss_fn(model_output(self.module(inputs)), targets)
            loss.backward()
            loss = loss.detach()
        else:
            loss = self._pipeline_step(inputs, targets)
        if self._tied:
            self._sum_tied_gradients()
        if self._manual_sync:
            self._all_reduce_gradients()
        return loss

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of this replica's batch in evaluation mode (dropout off), forward only; the same on
        every rank of the replica."""
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        with self._evaluating():
            if self.schedule is None:
                return self.loss_fn(model_output(self.module(inputs)), targets).detach()
            return self._pipeline_step(inputs, targets, self.schedule.eval)

    def predict(self, inputs: torch.Tensor) -> torch.Tensor:
        """The model's output for this replica's ``inputs`` (any number of samples) in evaluation mode,
        forward only, on every rank: a pipeline runs them in batches of the training step's size (its
        stages' buffers have that shape) and its last stage broadcasts the output to the others."""
        inputs = inputs.to(self.device)
        with self._evaluating():
            if self.schedule is None:
                return model_output(self.module(inputs))
            per, outputs = self._replica_batch, []
            first, last = 0 in self.modules, self._num_stages - 1 in self.modules
            self.loss_fn.off = True
            try:
                for start in range(0, len(inputs), per):
                    chunk = inputs[start:start + per]
                    padded = torch.cat([chunk, chunk[-1:].expand(per - len(chunk), *chunk.shape[1:])])
                    output = self.schedule.eval(*((padded,) if first else ()),
                                                target=torch.zeros(per, device=self.device) if last else None)
                    outputs.append(self._from_last_stage(output)[:len(chunk)])
            finally:
                self.loss_fn.off = False
            return torch.cat(outputs)

    @contextlib.contextmanager
    def _evaluating(self):
        """Evaluation mode and no autograd; afterwards each module's mode as it was, FSDP resharded."""
        modes = [(m, m.training) for module in self.modules.values() for m in module.modules()]
        for module in self.modules.values():
            module.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            for m, training in modes:
                m.training = training
            self._reshard()

    def _from_last_stage(self, output: torch.Tensor | None) -> torch.Tensor:
        """The last pipeline stage's ``output`` on every rank of the pp group."""
        group, owner = self.mesh["pp"].get_group(), self._last_stage_rank()
        meta = [(tuple(output.shape), output.dtype) if output is not None else None]
        dist.broadcast_object_list(meta, src=owner, group=group)
        if output is None:
            output = torch.empty(meta[0][0], dtype=meta[0][1], device=self.device)
        dist.broadcast(output, src=owner, group=group)
        return output

    def _reshard(self) -> None:
        """Free the parameters FSDP gathered for a forward without a backward (sharding 1 and 2 keep them
        from forward to backward), so that the model holds its shards again (for ``state_dict``, memory)."""
        if not self.plan.sharding:
            return
        from torch.distributed.fsdp import FSDPModule

        for module in self.modules.values():
            for m in module.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def _pipeline_step(self, inputs: torch.Tensor, targets: torch.Tensor, run=None) -> torch.Tensor:
        first, last = 0 in self.modules, self._num_stages - 1 in self.modules
        losses: list[torch.Tensor] = []
        args = (inputs,) if first else ()
        kwargs = {"target": targets, "losses": losses} if last else {}
        (run or self.schedule.step)(*args, return_outputs=False, **kwargs)  # the losses are all we need
        # in the model's dtype on every rank, whatever the loss function returns: one size for the broadcast
        dtype = next(d for _, d in self._names.values() if d.is_floating_point)
        loss = torch.stack(losses).mean().detach() if last else torch.zeros((), device=self.device)
        loss = loss.to(dtype)
        dist.broadcast(loss, src=self._last_stage_rank(), group=self.mesh["pp"].get_group())
        return loss

    def _last_stage_rank(self) -> int:
        """The global rank of this rank's pp group that runs the last pipeline stage."""
        return dist.get_global_rank(self.mesh["pp"].get_group(), (self._num_stages - 1) % self.plan.pp)

    def _sum_tied_gradients(self) -> None:
        """A parameter that several pipeline stages hold a copy of (a head tied to the token embedding) gets the
        sum of the copies' gradients on every copy (over the pp ranks that hold one), as one process's one
        parameter gets both uses'."""
        for names, group in self._tied:
            copies = list({id(p): p for module in self.modules.values() for name, p in
                           module.named_parameters(remove_duplicate=False) if original_name(name) in names}.values())
            total = None
            for p in copies:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grad = _local_grad(p)
                total = grad.clone() if total is None else total + grad
            if group is not None:
                dist.all_reduce(total, group=group)
            for p in copies:
                _local_grad(p).copy_(total)

    def _all_reduce_gradients(self) -> None:
        """The mean of every local gradient over ``dp x spatial``, flattened into buckets of at most
        ``BUCKET_BYTES`` (as DDP does): one all-reduce per bucket, not one per parameter."""
        group = flat_group(self.mesh, ("dp", "spatial"))
        size = dist.get_world_size(group)
        grads = [_local_grad(p) for p in self.parameters() if p.grad is not None]
        for bucket in _buckets(grads):
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=group)
            flat.div_(size)
            for grad, part in zip(bucket, flat.split([g.numel() for g in bucket])):
                grad.copy_(part.view_as(grad))

    def gather_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole gradient, keyed by the original model's names, on every rank (zeros
        where a parameter got none). Collective over all ranks."""
        return self._gather(grads=True)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole, unsharded state dict (parameters and buffers), keyed by the original model's names,
        on every rank. Collective over all ranks."""
        return self._gather(grads=False)

    def _gather(self, grads: bool) -> dict[str, torch.Tensor]:
        local: dict[str, torch.Tensor] = {}
        for module in self.modules.values():
            local.update(_whole_tensors(module, grads))
        group = self.mesh["pp"].get_group() if self.plan.pp > 1 else None
        out = {}
        for name, (shape, dtype) in self._names.items():
            if grads and name not in self._params:
                continue
            mine = self.plan.pp == 1 or self._owners[name] == self.mesh["pp"].get_local_rank()
            value = local.get(name)
            if value is None and (grads or not mine):
                value = torch.zeros(shape, dtype=dtype, device=self.device)  # none, or another stage's: filled below
            if group is not None:
                value = value.contiguous()
                dist.broadcast(value, src=dist.get_global_rank(group, self._owners[name]), group=group)
            out[name] = value
        return out


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


def _buckets(tensors: list[torch.Tensor]):
    """Consecutive runs of ``tensors`` of one dtype and device, each at most ``BUCKET_BYTES`` (or one tensor)."""
    bucket, size = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > BUCKET_BYTES or (t.dtype, t.device) != (bucket[0].dtype, bucket[0].device)):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def _local_grad(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``p``'s gradient, laid out as ``p`` is (DTensor may leave the gradient of a split
    parameter whole on every rank; it is then made split as the parameter, which slices it locally)."""
    grad = p.grad
    if hasattr(grad, "placements") and grad.placements != p.placements:
        p.grad = grad = grad.redistribute(p.device_mesh, p.placements)
    return grad.to_local() if hasattr(grad, "to_local") else grad


def local_tensors(module: nn.Module, buffers: bool = True):
    """``(original name, tensor, split conv or None, its parameter name)`` for each parameter (and persistent
    buffer) of a parallel ``module``, under each of its names (a tied weight, a module registered twice): through
    DDP and checkpoint wrappers, a channel-split conv's shards under the original conv's names."""
    module = module.module if isinstance(module, DistributedDataParallel) else module
    inner = {id(m.conv) for m in module.modules() if isinstance(m, _SplitConv)}
    for prefix, sub in module.named_modules(remove_duplicate=False):
        if id(sub) in inner:
            continue  # its shards are named as the _SplitConv's
        split = sub if isinstance(sub, _SplitConv) else None
        tensors = sub.local_parameters() if split else dict(sub.named_parameters(recurse=False))
        if buffers:
            tensors.update((n, b) for n, b in sub.named_buffers(recurse=False)
                           if n not in sub._non_persistent_buffers_set)
        for name, tensor in tensors.items():
            if tensor is not None:
                yield original_name(f"{prefix}.{name}" if prefix else name), tensor, split, name


def _whole_tensors(module: nn.Module, grads: bool) -> dict[str, torch.Tensor]:
    """Whole parameters (or their gradients) and buffers of ``module``, by their original names: DTensors
    gathered, channel-split convolutions reassembled. Collective over the tp and dp ranks."""
    out = {}
    for key, tensor, split, name in local_tensors(module, buffers=not grads):
        value = tensor.grad if grads else tensor.detach()
        if value is None:
            continue
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[key] = gather_parameter(value, split, name) if split else value
    return out


def original_name(name: str) -> str:
    for part in WRAPPER_PARTS:
        name = name.replace(part, "")
    return name

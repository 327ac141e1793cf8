"""``hybridpar.parallelize``: a Plan applied to an ordinary model, in one fixed order, as a ``ParallelModel``.

The order (each step only where the plan asks for it):

1. **check** everything that can be wrong (mesh against plan, layer names and strategies, divisibility,
   heads, layouts between layers, pipeline cuts, batch sizes), identically on every rank and before any
   communication;
2. **pipeline stages**: this rank's stage module(s), cut from the model's top-level blocks
   (``parallel.pipeline``); without pipelining, the model itself;
3. **tensor** parallelism: column / row / shard per layer (``parallel.tensor``: DTensor for Linear and
   Embedding layers, filter / channel splits for convolutions, which keep an ordinary conv of their channels);
4. **spatial** parallelism: convolutions (split ones included), pooling and normalisations on slabs
   (``spatial.parallelize``);
5. **activation checkpointing** of each top-level block;
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
from hybridpar.parallel.tensor import Split, apply_splits, check_strategies
from hybridpar.plan import graph_of
from hybridpar.plan.graph import ModelGraph, blocks
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
    splits, groups = check_plan(model, plan, example_input)
    shape = tuple(example_input.shape if example_input is not None else plan.input_shape)
    grid = plan.spatial if math.prod(plan.spatial) > 1 else (1,) * max(len(shape) - 2, 1)  # one part per dim
    names = {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    params = {name for name, _ in model.named_parameters()}
    owners = _owners(names, groups, plan.pp)
    mesh = mesh if mesh is not None else build_mesh(plan.dims, dist.get_world_size())  # the first collective
    _check_mesh(plan, mesh)
    pp_rank = mesh["pp"].get_local_rank()
    held = pipeline.stages_of_rank(len(groups), plan.pp, pp_rank) if plan.pp > 1 else [0]
    device = _device(mesh)
    modules = {i: (pipeline.stage_module(model, groups[i]) if plan.pp > 1 else model).to(device) for i in held}
    manual_sync = False
    for index, module in modules.items():
        modules[index], manual = _build(module, plan, grid, mesh, splits, BATCH_NORM_SCOPES[batch_norm])
        manual_sync = manual_sync or manual
    schedule, loss_fn = None, _ScheduleLoss(loss_fn)
    if plan.pp > 1:
        schedule = pipeline.build_schedule(modules, len(groups), plan.schedule, plan.micro_batches, loss_fn,
                                           mesh["pp"].get_group(), device)
    batch = replica_batch(plan, shape[0])
    return ParallelModel(modules, schedule, plan, mesh, loss_fn, names, params, owners, manual_sync, batch)


class _ScheduleLoss:
    """The loss function a pipeline's last stage calls per micro-batch, switched off (a zero) while
    ``ParallelModel.predict`` runs the schedule for its outputs: PyTorch's schedules compute the loss
    whenever they have a loss function, even in ``eval``."""

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.fn, self.off = fn, False

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return output.new_zeros(()) if self.off else self.fn(output, target)


def check_plan(model: nn.Module, plan: Plan, example_input: torch.Tensor | None = None,
               graph: ModelGraph | None = None):
    """Every check of ``plan`` against ``model`` that needs no process group (``model`` may live on the meta
    device; ``graph``: its layer graph, if the caller has analysed it already): ``(the tensor-parallel splits,
    the block names of each pipeline stage)``, or a ``PlanError``."""
    if plan.sharding not in SHARDING_NAMES:
        raise PlanError(f"sharding = {plan.sharding!r}: use 0 (DDP), 1, 2 or 3 (FSDP)")
    if plan.pp == 1 and plan.micro_batches != 1:
        raise PlanError(f"micro_batches = {plan.micro_batches}: use 1 without pipeline stages (pp=1)")
    if plan.sequence_parallel and plan.tp == 1:
        raise PlanError("sequence_parallel = true needs tp > 1: it splits along the sequence what the "
                        "tensor-parallel ranks would otherwise each hold whole")
    graph = graph or graph_of(model, _example(model, plan, example_input), dtype=_dtype_name(model))
    splits = check_strategies(model, dict(plan.layers), graph, plan.tp,
                              sequence_parallel=plan.sequence_parallel) if plan.tp > 1 else {}
    convs = [name for name, split in splits.items() if split.kind == "conv" and split.strategy in ("column", "row")]
    if convs and plan.sharding and math.prod(plan.spatial) * plan.dp > 1:
        raise PlanError(f"layer {convs[0]!r}: a channel-split convolution with sharding {plan.sharding} (FSDP) "
                        "is not supported yet; use sharding 0 (DDP) with filter / channel splits")
    if plan.tp == 1 and plan.layers and any(s != "replicate" for _, s in plan.layers):
        raise PlanError(f"the plan splits layers over tp ({dict(plan.layers)}) but tp=1; set tp, or drop layers")
    dense = [name for name, split in splits.items() if split.kind in ("linear", "embedding")]
    if dense and math.prod(plan.spatial) > 1:
        raise PlanError(f"layer {dense[0]!r}: spatial={plan.spatial} combines with filter / channel splits of "
                        "convolutions, not with tensor-parallel Linear or Embedding layers; replicate it")
    groups = _stage_groups(model, graph, plan)
    _owners(dict.fromkeys(model.state_dict()), groups, plan.pp)  # every parameter and buffer in a block
    return splits, groups


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
    first = next((m for m in model.modules() if not list(m.children())), None)
    dtype = torch.long if isinstance(first, nn.Embedding) else torch.float32
    return torch.zeros(plan.input_shape, dtype=dtype)


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


def _owners(names: dict, groups: list[list[str]], pp: int) -> dict[str, int]:
    """The pp rank that holds each state-dict entry."""
    if pp == 1:
        return dict.fromkeys(names, 0)
    stage_of = {unit: i for i, group in enumerate(groups) for unit in group}
    out = {}
    for name in names:
        unit = next((u for u in stage_of if name.startswith(u + ".")), None)
        if unit is None:
            raise PlanError(f"{name!r} belongs to none of the model's top-level blocks; hybridpar.parallelize "
                            "needs every parameter and buffer inside a block (a child module)")
        out[name] = stage_of[unit] % pp
    return out


def _device(mesh: DeviceMesh) -> torch.device:
    return torch.device("cpu") if mesh.device_type == "cpu" else torch.device(mesh.device_type,
                                                                              torch.cuda.current_device())


def _build(module: nn.Module, plan: Plan, grid: tuple[int, ...], mesh: DeviceMesh, splits: dict[str, Split],
           norm_axes: tuple[str, ...]) -> tuple[nn.Module, bool]:
    """Steps 3-6 of the module doc on one module (the model, or one pipeline stage); also whether the
    gradients need a manual all-reduce (tensor or pipeline parallelism under sharding 0). ``grid`` is the
    plan's spatial grid with one part per spatial dim of the input where the plan splits none."""
    if splits:
        module = apply_splits(module, splits, mesh["tp"])
    shared_norms = _has_batch_norm(module) and mesh[norm_axes].size() > 1
    if math.prod(grid) > 1 or shared_norms:  # the spatial runtime also sums batch-norm statistics over ranks
        from hybridpar import spatial

        module = spatial.parallelize(module, mesh["spatial"], grid=grid, batch_norm_mesh=mesh[norm_axes])
    held = [m for _, m in blocks(module) if not isinstance(m, nn.Identity)]
    if plan.checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        wrapped = {id(b) for b in held}
        apply_activation_checkpointing(module, check_fn=lambda m: id(m) in wrapped)
    if plan.dp * math.prod(plan.spatial) == 1:
        return module, False
    if plan.sharding:
        from torch.distributed.fsdp import fully_shard

        dp_mesh = flat_mesh(mesh, ("dp", "spatial"))
        for block in held:
            if any(True for _ in block.parameters()):
                fully_shard(block, mesh=dp_mesh, reshard_after_forward=plan.sharding == 3)
        return fully_shard(module, mesh=dp_mesh, reshard_after_forward=plan.sharding == 3), False
    if splits or plan.pp > 1:
        return module, True
    return DistributedDataParallel(module, process_group=flat_group(mesh, ("dp", "spatial"))), False


def _has_batch_norm(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


class ParallelModel:
    """A model parallelized by a plan: ``train_step`` runs one step's forward and backward (all
    micro-batches), leaving the gradients on the local parameters for any torch optimizer."""

    def __init__(self, modules: dict[int, nn.Module], schedule, plan: Plan, mesh: DeviceMesh, loss_fn,
                 names: dict, params: set[str], owners: dict[str, int], manual_sync: bool, replica_batch: int):
        self.modules, self.schedule, self.plan, self.mesh = modules, schedule, plan, mesh
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
            loss = self.loss_fn(self.module(inputs), targets)
            loss.backward()
            loss = loss.detach()
        else:
            loss = self._pipeline_step(inputs, targets)
        if self._manual_sync:
            self._all_reduce_gradients()
        return loss

    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of this replica's batch in evaluation mode (dropout off), forward only; the same on
        every rank of the replica."""
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        with self._evaluating():
            if self.schedule is None:
                return self.loss_fn(self.module(inputs), targets).detach()
            return self._pipeline_step(inputs, targets, self.schedule.eval)

    def predict(self, inputs: torch.Tensor) -> torch.Tensor:
        """The model's output for this replica's ``inputs`` (any number of samples) in evaluation mode,
        forward only, on every rank: a pipeline runs them in batches of the training step's size (its
        stages' buffers have that shape) and its last stage broadcasts the output to the others."""
        inputs = inputs.to(self.device)
        with self._evaluating():
            if self.schedule is None:
                return self.module(inputs)
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

    def _all_reduce_gradients(self) -> None:
        """The mean of every local gradient over ``dp x spatial``, flattened into buckets of at most
        ``BUCKET_BYTES`` (as DDP does): one all-reduce per bucket, not one per parameter."""
        group = flat_group(self.mesh, ("dp", "spatial"))
        size = dist.get_world_size(group)
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for p in self.parameters() if p.grad is not None]
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


def local_tensors(module: nn.Module, buffers: bool = True):
    """``(original name, tensor, split conv or None, its parameter name)`` for each parameter (and persistent
    buffer) of a parallel ``module``: through DDP and checkpoint wrappers, a channel-split conv's shards under
    the original conv's names."""
    module = module.module if isinstance(module, DistributedDataParallel) else module
    inner = {id(m.conv) for m in module.modules() if isinstance(m, _SplitConv)}
    for prefix, sub in module.named_modules():
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

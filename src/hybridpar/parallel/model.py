"""``ParallelModel``: a model parallelized by a plan (``hybridpar.parallelize``). It runs a step's forward and
backward (the pipeline schedule's micro-batches included), evaluation and prediction on every rank, keeps the
gradients in step with one process's (tied copies summed, a manual all-reduce where DDP cannot wrap), and
gathers the whole state dict and gradients under the original model's names.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from hybridpar.ir.analysis import model_output
from hybridpar.ir.types import Plan
from hybridpar.mesh import device_of, flat_group
from hybridpar.parallel.grads import all_reduce_gradients, sum_tied_gradients
from hybridpar.parallel.state import whole_tensors


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
        self.device = device_of(mesh)
        # uneven dp shares (plan.shares): this replica's loss scaled so that the replicas' mean of gradients is the
        # global batch's mean (pipelines take even shares only: plan.check_uneven)
        self.loss_weight = plan.loss_weight(mesh["dp"].get_local_rank())

    @property
    def module(self) -> nn.Module:
        """The parallel module (without pipelining; with it, this rank's first stage)."""
        return self.modules[min(self.modules)]

    def computing_modules(self):
        """The modules whose forward computes this rank's part: the parallel modules, and under DDP the module it
        wraps (DDP's own forward also broadcasts buffers, a wait on the other ranks)."""
        from torch.nn.parallel import DistributedDataParallel

        for module in self.modules.values():
            yield module.module if isinstance(module, DistributedDataParallel) else module

    def parameters(self):
        """This rank's parameters (local shards, DTensors where PyTorch's engines keep them so)."""
        for module in self.modules.values():
            yield from module.parameters()

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one step on this replica's batch (``plan.batch_rows`` of the global batch);
        returns its loss (the mean over its micro-batches, the same on every rank of the replica; the global
        batch's: ``hybridpar.train.agree.mean_over_dp`` with ``loss_weight``). Gradients accumulate: zero them between
        steps (``optimizer.zero_grad()``)."""
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        if self.schedule is None:
            loss = self.loss_fn(model_output(self.module(inputs)), targets)
            (loss * self.loss_weight if self.loss_weight != 1.0 else loss).backward()
            loss = loss.detach()
        else:
            loss = self._pipeline_step(inputs, targets)
        if self._tied:
            sum_tied_gradients(self.modules.values(), self._tied)
        if self._manual_sync:
            all_reduce_gradients(list(self.parameters()), flat_group(self.mesh, ("dp", "spatial")))
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
            local.update(whole_tensors(module, grads))
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

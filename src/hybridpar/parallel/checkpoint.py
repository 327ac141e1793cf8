"""Checkpoints of a ``ParallelModel`` and its optimizer that resume under any other plan and world size.

``save(parallel, optimizer, path)`` writes, with ``torch.distributed.checkpoint`` (DCP), every parameter,
buffer and optimizer-state tensor under the original model's names and in its *global* shapes: a tensor
sharded by FSDP or tensor parallelism is a DTensor (DCP stores each rank's shard with where it lies), a
channel-split convolution's shard is presented as one too, a replicated tensor is stored once, and each
pipeline rank stores its own blocks. ``load`` builds the same description of the *new* job (its plan, its
world size) and lets DCP read into each rank's shards the pieces they cover, in place: weights and
optimizer state are resharded, no rank ever holds the whole model. The optimizer's hyperparameters are the
new optimizer's; its state (Adam's moments and step) is the checkpoint's.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor, Shard

from hybridpar.errors import CheckpointError
from hybridpar.parallel import checkpoint_files as files
from hybridpar.parallel.channels import _SplitConv
from hybridpar.parallel.model import ParallelModel
from hybridpar.parallel.state import local_tensors


def save(parallel: ParallelModel, optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """Write the model and optimizer state to the directory ``path`` (collective over all ranks)."""
    write(state_dict(parallel, optimizer), Path(path))


def load(parallel: ParallelModel, optimizer: torch.optim.Optimizer, path: str | Path) -> None:
    """Read a checkpoint written by ``save`` under any plan into this job's shards (collective); a damaged or
    crafted one is refused (``CheckpointError``, naming the file)."""
    problem = files.verify(Path(path))
    if problem:
        raise CheckpointError(f"checkpoint {path} is damaged: {problem}")
    init_optimizer_state(optimizer)
    read(state_dict(parallel, optimizer), Path(path))


def write(state: dict, path: Path) -> None:
    """Write ``state`` (tensors, DTensors) with DCP to the folder ``path``, then its manifest (collective)."""
    dcp.save(state, checkpoint_id=path)
    files.write_manifest(path)


def stager() -> DefaultStager:
    """What copies a state into memory to be written in the background, in a thread of its own: into the same
    buffers each time (the pages of a fresh copy cost as much as the copy), pinned where there is a GPU."""
    return DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                        use_async_staging=True, use_non_blocking_copy=False))


def write_in_background(state: dict, path: Path, group, staging: DefaultStager, then=None) -> tuple[Future, Future]:
    """Stage ``state`` with ``staging`` (``stager()``: copied in memory, in the background; the copy of the save
    before is overwritten, so that one must be finished) and write it with DCP to the folder ``path``, then its
    manifest, then ``then()``, in the background; their collectives run on ``group``, a process group of every
    rank that training's collectives do not use. Returns two futures: the copy's, until which no tensor of
    ``state`` may change, and the whole save's, whose result is ``then()``'s (its exception DCP's
    ``CheckpointException``, or a ``CheckpointError``, where the state could not be written: the same on every
    rank)."""
    response = dcp.async_save(state, checkpoint_id=path, process_group=group, async_stager=staging)
    written = response.upload_completion
    done: Future = Future()

    def manifest(_) -> None:
        try:
            written.result()
            files.write_manifest(path, group)
            result = then() if then is not None else None
        except BaseException as err:  # noqa: BLE001 - the caller's to raise, on its thread (DCP's is a BaseException)
            done.set_exception(err)
        else:
            done.set_result(result)

    written.add_done_callback(lambda f: threading.Thread(target=manifest, args=(f,), daemon=True).start())
    return response.staging_completion, done


def read(state: dict, path: Path) -> None:
    """Read the checkpoint folder ``path`` into the tensors of ``state`` in place, its metadata unpickled with
    DCP's types only (collective)."""
    files.read_metadata(path)  # a crafted file is refused here in words (DCP folds a reader's error into its own)
    dcp.load(state, storage_reader=files.SafeReader(path))


def state_dict(parallel: ParallelModel, optimizer: torch.optim.Optimizer, buffers_copied: bool = False) -> dict:
    """``{"model": {name: tensor}, "optimizer": {name: {key: tensor}}}``: views of this rank's tensors (DCP
    writes from them and reads into them), by the original names, sharded ones as DTensors of their global
    shape; ``buffers_copied``: the buffers (batch norm's statistics, which a forward pass changes) as copies."""
    model, optim = {}, {}
    tp_mesh = parallel.mesh["tp"]
    for module in parallel.modules.values():
        for key, tensor, split, name in local_tensors(module):
            if not isinstance(tensor, nn.Parameter):
                model[key] = tensor.clone() if buffers_copied else tensor  # a buffer
                continue
            placement = _conv_placement(split, name) if split else None
            model[key] = _view(tensor.detach(), placement, tp_mesh)
            state = optimizer.state.get(tensor, {})
            optim[key] = {k: _view(v, placement if v.shape == tensor.shape else None, tp_mesh)
                          for k, v in state.items() if isinstance(v, torch.Tensor)}
    return {"model": model, "optimizer": optim}


def _conv_placement(conv: _SplitConv, name: str) -> Shard | None:
    if name == "bias" and conv.split_dim == 1:
        return None  # whole on every rank
    return Shard(conv.split_dim if name == "weight" else 0)


def _view(tensor: torch.Tensor, placement: Shard | None, mesh) -> torch.Tensor:
    """``tensor`` as DCP should see it: a channel shard as a DTensor over the tp ranks (sharing memory).
    (``hybridpar.parallelize`` refuses channel splits under FSDP, whose shards would be DTensors already.)"""
    if placement is None:
        return tensor
    return DTensor.from_local(tensor, mesh, [placement], run_check=False)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors (zeros), so that DCP has somewhere to read them into: one
    step with zero gradients and a zero learning rate (the parameters do not move)."""
    if all(p in optimizer.state for group in optimizer.param_groups for p in group["params"]):
        return
    saved = [(group["lr"], [p.grad for p in group["params"]]) for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, (lr, grads) in zip(optimizer.param_groups, saved):
        group["lr"] = lr
        for p, grad in zip(group["params"], grads):
            p.grad = grad


"""Data parallelism over the ``dp x spatial`` ranks with PyTorch's DDP.

Under spatial parallelism every rank of a spatial group computes the same global loss, and autograd
through the halo exchanges and collectives gives each rank ``P`` times its share of each gradient
(see ``hybridpar.spatial.collectives``). Averaging over the ``P`` spatial ranks therefore *sums* the
true shares, and averaging over the ``dp`` replicas averages the per-replica gradients: one DDP
all-reduce-mean over the flattened ``dp x spatial`` group is exactly one process on the global
batch (for equal per-replica batches and a mean loss).
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from hybridpar.mesh import flat_group, flat_mesh
from hybridpar.parallel.grads import mean_of_each_gradient


def data_parallel(module: nn.Module, mesh: DeviceMesh, *, axes: tuple[str, ...] = ("dp", "spatial"),
                  kind: str = "ddp", **kwargs):
    """Data parallelism over the ``axes`` of ``mesh``, flattened: ``kind="ddp"`` wraps the module in
    DDP (and returns the wrapper), over more than two ranks each gradient averaged on its own
    (``grads.mean_of_each_gradient``: the same order of sums in every step, whenever the DDP was built);
    ``kind="fsdp"`` shards it in place with FSDP2 ``fully_shard`` (parameters become DTensors sharded over
    those ranks; gradients are reduce-scattered)."""
    if kind == "ddp":
        group = flat_group(mesh, tuple(axes))
        ddp = DistributedDataParallel(module, process_group=group, **kwargs)
        if dist.get_world_size(group) > 2:  # a sum of two is the same in either order: DDP's buckets are cheaper
            ddp.register_comm_hook(group, mean_of_each_gradient)
        return ddp
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard  # imported here: it costs ~44 MiB per process

        return fully_shard(module, mesh=flat_mesh(mesh, tuple(axes)), **kwargs)
    raise ValueError(f"data_parallel kind={kind!r}: use 'ddp' or 'fsdp'")

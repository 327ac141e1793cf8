"""Data parallelism over the ``dp x spatial`` ranks with PyTorch's DDP.

Under spatial parallelism every rank of a spatial group computes the same global loss, and autograd
through the halo exchanges and collectives gives each rank ``P`` times its share of each gradient
(see ``hybridpar.spatial.collectives``). Averaging over the ``P`` spatial ranks therefore *sums* the
true shares, and averaging over the ``dp`` replicas averages the per-replica gradients: one DDP
all-reduce-mean over the flattened ``dp x spatial`` group is exactly one process on the global
batch (for equal per-replica batches and a mean loss).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from hybridpar.errors import MeshError


def flat_group(mesh: DeviceMesh, axes: tuple[str, ...]):
    """One process group spanning ``axes`` of ``mesh`` (the mesh itself if it is 1-D)."""
    names = mesh.mesh_dim_names or ()
    missing = [a for a in axes if a not in names]
    if missing:
        raise MeshError(f"mesh axes {names} lack {missing}; build the mesh with hybridpar.mesh.build_mesh")
    sub = mesh[axes] if tuple(names) != tuple(axes) else mesh
    return sub.get_group() if sub.ndim == 1 else sub._flatten().get_group()


def data_parallel(module: nn.Module, mesh: DeviceMesh, *, axes: tuple[str, ...] = ("dp", "spatial"), **ddp_kwargs):
    """Wrap a (spatially parallelized) module in DDP over the ``axes`` of ``mesh``, flattened."""
    return DistributedDataParallel(module, process_group=flat_group(mesh, tuple(axes)), **ddp_kwargs)

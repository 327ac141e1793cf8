"""The one DeviceMesh of a run, built from its named parallel degrees (``hybridpar.dims``).

``build_mesh(ParallelDims(dp=2, spatial=(2, 1, 1)), world_size)`` gives a ``DeviceMesh`` whose axes are named
``pp``, ``dp``, ``spatial`` and ``tp``, on the accelerator at hand (``accelerator_type``: a GPU node's meshes are
CUDA meshes, a laptop's CPU ones); ``flat_mesh`` and ``flat_group`` span several of its axes at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from hybridpar.dims import AXES, ParallelDims
from hybridpar.errors import MeshError


def accelerator_type() -> str:
    """The type of the accelerator this process can use (``cuda`` on a GPU node), or ``cpu``: where PyTorch has no
    collective backend of the accelerator's own (an Apple GPU, ``mps``, would run gloo), the CPU."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    kind = accelerator.type if accelerator is not None else "cpu"
    return kind if dist.Backend.default_device_backend_map.get(kind, "gloo") != "gloo" else "cpu"


def build_mesh(dims: ParallelDims, world_size: int, device_type: str | None = None) -> DeviceMesh:
    """One DeviceMesh with axes ``(pp, dp, spatial, tp)``, checked against ``world_size`` first, on
    ``device_type`` (default: the accelerator at hand, else the CPU)."""
    dims.check_world_size(world_size)
    sizes = dims.sizes()
    return init_device_mesh(device_type or accelerator_type(), tuple(sizes[a] for a in AXES), mesh_dim_names=AXES)


def device_of(mesh: DeviceMesh) -> torch.device:
    """The device this rank computes on in ``mesh``: the CPU, or its accelerator's current device."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())


def flat_mesh(mesh: DeviceMesh, axes: tuple[str, ...]) -> DeviceMesh:
    """A 1-D mesh spanning ``axes`` of ``mesh`` (the mesh itself if it is those axes and 1-D)."""
    names = mesh.mesh_dim_names or ()
    missing = [a for a in axes if a not in names]
    if missing:
        raise MeshError(f"mesh axes {names} lack {missing}; build the mesh with hybridpar.mesh.build_mesh")
    sub = mesh[axes] if tuple(names) != tuple(axes) else mesh
    return sub if sub.ndim == 1 else sub._flatten()


def flat_group(mesh: DeviceMesh, axes: tuple[str, ...]):
    """One process group spanning ``axes`` of ``mesh``."""
    return flat_mesh(mesh, axes).get_group()


__all__ = ["AXES", "ParallelDims", "accelerator_type", "build_mesh", "device_of", "flat_group", "flat_mesh"]

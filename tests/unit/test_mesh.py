"""Named parallel degrees: validation messages (single process) and the DeviceMesh that build_mesh
makes from them (4 gloo ranks)."""

import pytest

from hybridpar.errors import HybridparError, MeshError
from hybridpar.mesh import AXES, ParallelDims
from support import cases_extra


@pytest.mark.parametrize("name", ["dp", "tp", "pp"])
@pytest.mark.parametrize("value", [0, -1, 2.0, "2"])
def test_bad_degree_names_the_factor(name, value):
    with pytest.raises(MeshError) as info:
        ParallelDims(**{name: value})
    assert f"{name}={value!r}" in str(info.value) and "integer >= 1" in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, HybridparError)


@pytest.mark.parametrize("spatial", [(), (2, 0, 1), (2, -1), (1.5,), ("2",)])
def test_bad_spatial_grid(spatial):
    with pytest.raises(MeshError) as info:
        ParallelDims(spatial=spatial)
    msg = str(info.value)
    assert f"spatial={tuple(spatial)!r}" in msg and "parts per spatial dim" in msg and "spatial=(2, 1, 1)" in msg


def test_degrees_and_sizes():
    dims = ParallelDims(dp=3, spatial=[2, 2, 1], tp=2, pp=2)
    assert dims.spatial == (2, 2, 1)  # a list is stored as a tuple (frozen, hashable)
    assert hash(dims) == hash(ParallelDims(dp=3, spatial=(2, 2, 1), tp=2, pp=2))
    assert dims.num_spatial == 4 and dims.world_size == 48
    assert dims.sizes() == {"pp": 2, "dp": 3, "spatial": 4, "tp": 2}
    assert dims.describe() == "pp=2 x dp=3 x spatial=2x2x1 (4) x tp=2"
    dims.check_world_size(48)


def test_world_size_mismatch_names_every_factor():
    dims = ParallelDims(dp=3, spatial=(2, 2, 1), tp=2, pp=2)
    with pytest.raises(MeshError) as info:
        dims.check_world_size(32)
    msg = str(info.value)
    for part in ("pp=2", "dp=3", "spatial=2x2x1 (4)", "tp=2", "= 48 ranks", "the world size is 32",
                 "multiply to the world size"):
        assert part in msg, f"{part!r} not in {msg!r}"


def test_build_mesh_refuses_a_wrong_world_size_before_making_groups():
    from hybridpar.mesh import build_mesh

    with pytest.raises(MeshError, match=r"pp=1 x dp=2 x spatial=2 \(2\) x tp=1 = 4 ranks, but the world size is 2"):
        build_mesh(ParallelDims(dp=2, spatial=(2,)), 2)  # no process group exists in this process


def _expected_groups(sizes, rank):
    """Ranks of each axis's group for ``rank`` of a row-major (pp, dp, spatial, tp) mesh."""
    shape = [sizes[a] for a in AXES]
    strides = [1] * 4
    for i in range(2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    coords = [(rank // strides[i]) % shape[i] for i in range(4)]
    groups = {}
    for i, axis in enumerate(AXES):
        base = rank - coords[i] * strides[i]
        groups[axis] = tuple(base + c * strides[i] for c in range(shape[i]))
    return tuple(coords), groups


@pytest.mark.parametrize("dims", [dict(dp=2, spatial=(2, 1, 1)), dict(spatial=(2,), tp=2), dict(pp=2, dp=2),
                                  dict(spatial=(2, 2))], ids=str)
def test_build_mesh_axes(dist4, dims):
    results = dist4.run(cases_extra.built_mesh, dims=dims)
    sizes = ParallelDims(**dims).sizes()
    for rank, got in enumerate(results):
        assert got["names"] == ("pp", "dp", "spatial", "tp")
        assert got["shape"] == tuple(sizes[a] for a in AXES)
        assert got["sizes"] == sizes
        coords, groups = _expected_groups(sizes, rank)
        assert got["coords"] == coords, f"rank {rank}"
        assert got["groups"] == groups, f"rank {rank}"


@pytest.mark.parametrize("accelerator, expected", [(None, "cpu"), ("cuda", "cuda"), ("mps", "cpu")])
def test_meshes_go_to_the_accelerator_that_has_a_collective_backend(monkeypatch, accelerator, expected):
    """A GPU node's meshes are CUDA meshes; an Apple GPU has no collective backend of its own (gloo), so the CPU."""
    import torch

    from hybridpar.mesh import accelerator_type

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: accelerator is not None)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device(accelerator or "cpu"))
    assert accelerator_type() == expected

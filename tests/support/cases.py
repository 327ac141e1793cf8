"""Worker-side checks run on every rank by the harness: a spatially parallel module against one
process with the same weights and the same global input, in float64 (tolerance 1e-10: the only
differences are summation order, ~1e-15 relative)."""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridpar.spatial import collectives, parallelize, shard
from support import harness, models

TOL = dict(rtol=1e-10, atol=1e-10)


def spatial_mesh(parts: int):
    world = dist.get_world_size()
    if world == parts:
        return harness.mesh((world,), ("spatial",))
    return harness.mesh((world // parts, parts), ("dp", "spatial"))["spatial"]


def build(spec):
    """``("Conv3d", {...})`` -> an ``nn`` layer; ``("model", name, {...})`` -> a test model;
    ``("hybridpar", name, {...})`` -> a model of ``hybridpar.models``."""
    if spec[0] == "model":
        return getattr(models, spec[1])(**spec[2])
    if spec[0] == "hybridpar":
        from hybridpar.models import MODELS

        return MODELS[spec[1]](**spec[2])
    return getattr(nn, spec[0])(**spec[1])


def is_partitioned(y_local: torch.Tensor, y_global: torch.Tensor, grid) -> bool:
    return y_local.shape != y_global.shape


def global_loss(y_local, cot_local, partitioned: bool, group):
    local = (y_local * cot_local).sum()
    return collectives.all_reduce_sum(local, group) if partitioned else local


def check_equivalence(spec, shape, grid, train: bool = True, seed: int = 0, overlap: bool | None = None) -> dict:
    """Forward, input gradient and every parameter gradient (and running stats) against one process."""
    grid = tuple(grid)
    parts = math.prod(grid)
    mesh = spatial_mesh(parts)
    torch.manual_seed(seed)
    ref = build(spec).double().train(train)
    model = parallelize(copy.deepcopy(ref), mesh, grid=grid, overlap=overlap)
    x = torch.randn(shape, dtype=torch.float64)
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    cot = torch.randn_like(y_ref)
    (y_ref * cot).sum().backward()

    x_loc = shard(x, mesh, grid=grid).requires_grad_()
    y_loc = model(x_loc)
    part = is_partitioned(y_loc, y_ref, grid)
    expect = shard(y_ref.detach(), mesh, grid=grid) if part else y_ref.detach()
    torch.testing.assert_close(y_loc, expect, **TOL, msg=lambda m: f"forward output differs: {m}")
    cot_loc = shard(cot, mesh, grid=grid) if part else cot
    global_loss(y_loc, cot_loc, part, mesh.get_group()).backward()

    torch.testing.assert_close(x_loc.grad / parts, shard(x_ref.grad, mesh, grid=grid), **TOL,
                               msg=lambda m: f"input gradient differs: {m}")
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=mesh.get_group())
        torch.testing.assert_close(grad / parts, p_ref.grad, **TOL, msg=lambda m: f"gradient of {name}: {m}")
    for (name, b_ref), b in zip(ref.named_buffers(), model.buffers()):
        torch.testing.assert_close(b, b_ref, **TOL, msg=lambda m: f"buffer {name}: {m}")
    return {"partitioned_output": part}


def expect_error(spec, shape, grid, match: str) -> str:
    """The parallelized module raises a ValueError containing ``match`` on every rank."""
    grid = tuple(grid)
    mesh = spatial_mesh(math.prod(grid))
    torch.manual_seed(0)
    model = parallelize(build(spec).double(), mesh, grid=grid)
    x_loc = _local_input(shape, grid, mesh)
    try:
        model(x_loc)
    except ValueError as err:
        assert match in str(err), f"expected {match!r} in: {err}"
        return str(err)
    raise AssertionError(f"no error for {spec} on grid {grid}")


def _local_input(shape, grid, mesh):
    """A slab of the right shape without needing the global tensor to be splittable."""
    try:
        return shard(torch.randn(shape, dtype=torch.float64), mesh, grid=grid)
    except ValueError:
        return torch.randn(shape, dtype=torch.float64)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train_equivalence(model: str, kwargs: dict, shape, grid, dp: int, task: str, steps: int = 3,
                      batch_norm_over_dp: bool = True, kind: str = "ddp") -> list[float]:
    """``steps`` SGD steps of dp x spatial against one process on the global batch: the loss of every
    step and every parameter after every step."""
    import torch.nn.functional as F

    from hybridpar.parallel import data_parallel
    from hybridpar.spatial import cross_entropy

    grid = tuple(grid)
    parts = math.prod(grid)
    mesh = harness.mesh((dp, parts), ("dp", "spatial"))
    torch.manual_seed(0)
    ref = build(("model", model, kwargs)).double()
    net = parallelize(copy.deepcopy(ref), mesh["spatial"], grid=grid,
                      batch_norm_mesh=mesh if batch_norm_over_dp else None)
    ddp = data_parallel(net, mesh, kind=kind)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    n = shape[0] // dp
    dp_rank = mesh["dp"].get_local_rank()
    losses = []
    for step in range(steps):
        x = torch.randn(shape, dtype=torch.float64)
        if task == "regression":
            target = torch.rand(shape[0], 4, dtype=torch.float64) * 2 - 1
            loss_ref = F.mse_loss(ref(x), target)
        else:
            target = torch.randint(0, kwargs.get("classes", 3), (shape[0],) + tuple(shape[2:]))
            loss_ref = F.cross_entropy(ref(x), target)
        opt_ref.zero_grad()
        loss_ref.backward()
        opt_ref.step()

        mine = slice(dp_rank * n, (dp_rank + 1) * n)
        x_loc = shard(x[mine], mesh["spatial"], grid=grid)
        if task == "regression":
            loss = F.mse_loss(ddp(x_loc), target[mine])
        else:
            t_loc = shard(target[mine].unsqueeze(1), mesh["spatial"], grid=grid).squeeze(1)
            loss = cross_entropy(ddp(x_loc), t_loc, mesh["spatial"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=mesh["dp"].get_group())
        torch.testing.assert_close(mean_loss / dp, loss_ref.detach(), **TOL, msg=lambda m: f"loss of step {step}: {m}")
        for (name, p_ref), p in zip(ref.named_parameters(), net.parameters()):
            torch.testing.assert_close(_full(p.detach()), p_ref.detach(), **TOL,
                                       msg=lambda m: f"parameter {name} after step {step}: {m}")
        losses.append(float(loss_ref))
    return losses

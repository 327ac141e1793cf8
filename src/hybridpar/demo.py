"""``hybridpar demo``: train a small 3D CNN with dp x spatial parallelism on local processes and show,
step by step, that its losses, gradients and weights equal one process on the global batch."""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hybridpar.mesh import ParallelDims, build_mesh, device_of
from hybridpar.parallel import data_parallel
from hybridpar.spatial import parallelize, shard


def demo_net(channels: int, size: int) -> nn.Sequential:
    """A CosmoFlow-like regressor: two conv3d / batch-norm / leaky-ReLU / max-pool blocks, a dense head."""
    width = 8
    return nn.Sequential(
        nn.Conv3d(channels, width, 3, padding=1), nn.BatchNorm3d(width), nn.LeakyReLU(0.3), nn.MaxPool3d(2),
        nn.Conv3d(width, width, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2),
        nn.Flatten(), nn.Linear(width * (size // 4) ** 3, 16), nn.LeakyReLU(0.3), nn.Linear(16, 4),
    )


@torch.no_grad()
def _max_diff(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def run(dims: ParallelDims, size: int, steps: int, batch: int) -> list[dict]:
    """One worker's part of the demo; returns, per step, the losses and the largest differences."""
    from hybridpar.launch import init_distributed, shutdown_distributed

    init_distributed()
    mesh = build_mesh(dims, dist.get_world_size())
    device = device_of(mesh)
    torch.manual_seed(0)
    ref = demo_net(4, size).double().to(device)
    model = parallelize(copy.deepcopy(ref), mesh["spatial"], grid=dims.spatial, batch_norm_mesh=mesh["dp", "spatial"])
    ddp = data_parallel(model, mesh)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    dp_rank, n = mesh["dp"].get_local_rank(), batch // dims.dp
    rows = []
    for step in range(steps):
        x = torch.randn(batch, 4, size, size, size, dtype=torch.float64).to(device)
        y = (torch.rand(batch, 4, dtype=torch.float64) * 2 - 1).to(device)
        loss_ref = F.mse_loss(ref(x), y)
        opt_ref.zero_grad()
        loss_ref.backward()
        mine = slice(dp_rank * n, (dp_rank + 1) * n)
        loss = F.mse_loss(ddp(shard(x[mine], mesh["spatial"], grid=dims.spatial)), y[mine])
        opt.zero_grad()
        loss.backward()
        grad_diff = _max_diff([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])
        opt_ref.step()
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, group=mesh["dp"].get_group())
        rows.append({
            "step": step, "loss_one_process": float(loss_ref.detach()), "loss_parallel": float(mean_loss) / dims.dp,
            "grad_diff": grad_diff,
            "weight_diff": _max_diff(list(model.parameters()), list(ref.parameters())),
        })
    del ddp, model, opt
    shutdown_distributed()
    return rows


def check_batch(dims: ParallelDims, batch: int, size: int) -> None:
    from hybridpar.errors import HybridparError

    if batch % dims.dp:
        raise HybridparError(f"--batch {batch} is not divisible by dp={dims.dp}; use a multiple of {dims.dp}")
    if size % 4 or any(size // 4 < p for p in dims.spatial):
        raise HybridparError(
            f"--size {size}: the demo net pools twice, so use a multiple of 4 with size/4 >= every spatial part "
            f"count {dims.spatial}"
        )
    if len(dims.spatial) != 3 or math.prod(dims.spatial) < 1:
        raise HybridparError(f"--spatial {dims.spatial}: give three part counts D,H,W, e.g. 2,1,1")

"""Losses over spatially partitioned outputs: each rank passes its slab of the prediction and the
target, and gets the global loss (the same value on every rank). With ``mesh=None`` they are the
one-process losses, so the same training code runs with and without a spatial split.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from hybridpar.spatial.collectives import all_reduce_sum


def _sum(values: list[torch.Tensor], mesh: DeviceMesh | None) -> list[torch.Tensor]:
    if mesh is None:
        return values
    flat = all_reduce_sum(torch.stack([v.reshape(()) for v in values]), mesh.get_group())
    return list(flat.unbind())


def _reduce(total: torch.Tensor, count: torch.Tensor, reduction: str, mesh) -> torch.Tensor:
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction={reduction!r}: use 'mean' or 'sum' (a distributed 'none' is the local loss)")
    total, count = _sum([total, count.to(total.dtype)], mesh)
    return total / count if reduction == "mean" else total


def mse_loss(input, target, mesh: DeviceMesh | None = None, *, reduction: str = "mean") -> torch.Tensor:
    """Mean (or summed) squared error over the global volume."""
    total = F.mse_loss(input, target, reduction="sum")
    return _reduce(total, torch.tensor(input.numel()), reduction, mesh)


def cross_entropy(
    input,
    target,
    mesh: DeviceMesh | None = None,
    *,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Voxel-wise cross-entropy of ``(N, C, *spatial)`` logits against ``(N, *spatial)`` class indices,
    with PyTorch's weighted mean: divided by the summed weights of the counted voxels."""
    losses = F.cross_entropy(input, target, weight=weight, ignore_index=ignore_index, reduction="none",
                             label_smoothing=label_smoothing)
    kept = target != ignore_index
    if weight is None:
        count = kept.sum()
    else:
        count = (weight[target.masked_fill(~kept, 0)] * kept).sum()
    return _reduce(losses.sum(), count, reduction, mesh)


def dice_loss(input, target, mesh: DeviceMesh | None = None, *, smooth: float = 1e-5) -> torch.Tensor:
    """``1 - mean soft Dice`` over samples and classes, from ``(N, C, *spatial)`` logits and
    ``(N, *spatial)`` class indices; intersections and sums are taken over the global volume."""
    probs = input.softmax(dim=1)
    onehot = F.one_hot(target, input.shape[1]).movedim(-1, 1).to(probs.dtype)
    dims = tuple(range(2, input.dim()))
    inter = (probs * onehot).sum(dims)
    denom = probs.sum(dims) + onehot.sum(dims)
    if mesh is not None:
        inter, denom = all_reduce_sum(torch.stack([inter, denom]), mesh.get_group()).unbind()
    dice = (2 * inter + smooth) / (denom + smooth)
    return 1 - dice.mean()

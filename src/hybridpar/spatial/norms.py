"""Spatial normalisation layers: statistics summed over every slab of the volume (and, for batch norm, over the
batch's other replicas where asked), so each rank normalises its slab as one process normalises the whole."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hybridpar.spatial import collectives
from hybridpar.spatial.base import SpatialLayer, Statistics


def _sync_stats(sums: list[torch.Tensor], group) -> list[torch.Tensor]:
    """All-reduce several statistics in one collective."""
    flat = collectives.all_reduce_sum(torch.cat([s.reshape(-1) for s in sums]), group)
    return [f.view(s.shape) for f, s in zip(flat.split([s.numel() for s in sums]), sums)]


def _channels(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return v.view(1, -1, *([1] * (x.dim() - 2)))


def _affine(module, y: torch.Tensor) -> torch.Tensor:
    return y * _channels(module.weight, y) + _channels(module.bias, y) if module.affine else y


class SpatialBatchNorm(SpatialLayer):
    """``BatchNorm1d/2d/3d``: batch statistics over the whole spatial group (and over data parallelism
    too when the context was given ``batch_norm_mesh`` spanning it), two passes for accuracy; running
    statistics updated as one process would on the whole batch."""

    def _hp_run(self, x, geo: None, ctx):
        use_batch = self.training or not self.track_running_stats
        if not use_batch:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        dims = [0] + list(range(2, x.dim()))
        count = torch.tensor([x.numel() // x.shape[1]], dtype=x.dtype, device=x.device)
        total, count = _sync_stats([x.sum(dims), count], ctx.norm_group)
        mean = total / count
        centred = x - _channels(mean, x)
        (sq,) = _sync_stats([(centred * centred).sum(dims)], ctx.norm_group)
        var = sq / count
        if self.training and self.track_running_stats:
            self._update_running(mean.detach(), var.detach(), count.detach())
        return _affine(self, centred * _channels(torch.rsqrt(var + self.eps), x))

    @torch.no_grad()
    def _update_running(self, mean, var, count):
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * (count / (count - 1).clamp(min=1))
        self.running_mean.mul_(1 - factor).add_(factor * mean.to(self.running_mean.dtype))
        self.running_var.mul_(1 - factor).add_(factor * unbiased.to(self.running_var.dtype))


class SpatialInstanceNorm(SpatialLayer):
    """``InstanceNorm1d/2d/3d``: per-sample, per-channel statistics summed over the spatial group."""

    def _hp_plan(self, in_shape, out_shape, ctx) -> Statistics:
        return Statistics(math.prod(in_shape[2:]))

    def _hp_run(self, x, geo: Statistics, ctx):
        if not self.training and self.track_running_stats:
            return F.instance_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                   False, 0.0, self.eps)
        dims = tuple(range(2, x.dim()))
        count = float(geo.count)
        (total,) = _sync_stats([x.sum(dims, keepdim=True)], ctx.comm.group)
        mean = total / count
        centred = x - mean
        (sq,) = _sync_stats([(centred * centred).sum(dims, keepdim=True)], ctx.comm.group)
        var = sq / count
        if self.training and self.track_running_stats:
            self._update_running(mean.detach().flatten(2).mean(0).squeeze(-1),
                                 var.detach().flatten(2).mean(0).squeeze(-1) * count / max(count - 1, 1))
        return _affine(self, centred * torch.rsqrt(var + self.eps))

    @torch.no_grad()
    def _update_running(self, mean, unbiased_var):
        m = self.momentum
        self.running_mean.mul_(1 - m).add_(m * mean)
        self.running_var.mul_(1 - m).add_(m * unbiased_var)


class SpatialGroupNorm(SpatialLayer):
    """``GroupNorm``: per-sample, per-group statistics (channels of the group x all slabs)."""

    def _hp_plan(self, in_shape, out_shape, ctx) -> Statistics:
        return Statistics((in_shape[1] // self.num_groups) * math.prod(in_shape[2:]))

    def _hp_run(self, x, geo: Statistics, ctx):
        n = x.shape[0]
        grouped = x.reshape(n, self.num_groups, -1)
        (total,) = _sync_stats([grouped.sum(-1, keepdim=True)], ctx.comm.group)
        mean = total / geo.count
        centred = grouped - mean
        (sq,) = _sync_stats([(centred * centred).sum(-1, keepdim=True)], ctx.comm.group)
        return _affine(self, (centred * torch.rsqrt(sq / geo.count + self.eps)).reshape(x.shape))

"""Spatial (domain) parallelism: one sample split into slabs across ranks, halos exchanged at the
borders, every layer computing exactly what one process computes on the whole volume."""

from hybridpar.geometry import Grid, split_bounds
from hybridpar.spatial.convert import exchange_stats, global_shape, parallelize, shard, unshard
from hybridpar.spatial.losses import cross_entropy, dice_loss, mse_loss

__all__ = [
    "Grid", "cross_entropy", "dice_loss", "exchange_stats", "global_shape", "mse_loss", "parallelize", "shard",
    "split_bounds", "unshard",
]

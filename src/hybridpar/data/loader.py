"""Batches of this rank's slabs: each step's global batch is the next run of one shuffled order of the samples
(PyTorch's ``DistributedSampler`` as for one replica), of which each dp replica reads its rows (even, or its
share: ``Plan.batch_rows``); the ranks of a spatial group read the slabs of the same samples, and a background
thread reads the next batches while the current one trains."""

from __future__ import annotations

import math
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.utils.data import DistributedSampler

from hybridpar.data.hdf5 import SlabDataset
from hybridpar.errors import ConfigError
from hybridpar.geometry import Grid


def check_batch_size(num_samples: int, batch_size: int) -> None:
    """Refuse a global batch larger than the training set: each step's batch is a run of one shuffled order of
    the samples, each sample at most once."""
    if batch_size > num_samples:
        raise ConfigError(f"train.batch_size = {batch_size}: the training set has only {num_samples} samples; "
                          f"use a batch of at most {num_samples} or more samples")


def steps_per_epoch(num_samples: int, batch_size: int, dp: int) -> int:
    """Whole batches in one pass over ``num_samples``: each of the ``dp`` replicas takes ``num_samples // dp``
    samples (``DistributedSampler`` with ``drop_last``) in batches of ``batch_size // dp`` (at least one, for a
    batch of at most ``num_samples`` that ``dp`` divides)."""
    check_batch_size(num_samples, batch_size)
    return (num_samples // dp) // (batch_size // dp)


class SlabLoader:
    """Training batches by step number: step ``s`` is batch ``s mod steps_per_epoch`` of epoch
    ``s // steps_per_epoch``, so a resumed run reads exactly what the uninterrupted run would have."""

    def __init__(self, dataset: SlabDataset, *, batch_size: int, dp: int, rows: tuple[int, int], grid: Grid,
                 spatial_rank: int, seed: int, shuffle: bool = True, prefetch: int = 2):
        self.dataset, self.grid, self.spatial_rank, self.prefetch = dataset, grid, spatial_rank, prefetch
        self.batch_size, self.rows = batch_size, rows  # this replica's [start, stop) of each global batch
        self.sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=shuffle, seed=seed, drop_last=True)
        self.steps_per_epoch = steps_per_epoch(len(dataset), batch_size, dp)
        self._epoch, self._order = None, []

    def _indices(self, step: int) -> list[int]:
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._epoch, self._order = epoch, list(self.sampler)
        first = k * self.batch_size
        return self._order[first + self.rows[0]:first + self.rows[1]]

    def _read(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*(self.dataset.read(i, self.grid, self.spatial_rank) for i in indices))
        return torch.stack(xs), torch.stack(ys)

    def batches(self, start: int, stop: int):
        """Yield ``(step, x_slab, target)`` for ``start <= step < stop``, reading ahead in a thread."""
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridpar-read") as pool:
            pending: deque = deque()
            for step in range(start, stop):
                while len(pending) <= self.prefetch and step + len(pending) < stop:
                    pending.append(pool.submit(self._read, self._indices(step + len(pending))))
                x, y = pending.popleft().result()
                yield step, x, y


def eval_batches(dataset: SlabDataset, *, batch_size: int, dp: tuple[int, int], grid: Grid, spatial_rank: int,
                 limit: int = 0):
    """Yield ``(x_slab, target, num_valid)``: every sample (or the first ``limit``) once, dp rank ``r``
    taking samples ``r, r + dp, ...``. Every dp rank yields the same number of batches of the same sizes
    (so that data-parallel collectives in the forward pass, such as FSDP's all-gathers, line up): a rank
    with fewer samples repeats its last one, and only the first ``num_valid`` samples of a batch count."""
    num_dp, dp_rank = dp
    total = min(len(dataset), limit or len(dataset))
    mine = list(range(dp_rank, total, num_dp))
    valid = len(mine)
    mine += [mine[-1] if mine else 0] * (math.ceil(total / num_dp) - valid)
    local = max(1, batch_size // num_dp)
    for start in range(0, len(mine), local):
        xs, ys = zip(*(dataset.read(i, grid, spatial_rank) for i in mine[start:start + local]))
        yield torch.stack(xs), torch.stack(ys), min(local, max(0, valid - start))

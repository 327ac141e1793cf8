"""What a training run learns. A task supplies the model, the data, the loss and the metrics; the trainer
(``hybridpar.train.trainer``) runs the same skeleton (checks, resume, cadence, checkpoints, metrics, summary)
for every task. ``task_for`` is the one place that chooses a task from the config.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from hybridpar.plan import Plan


class Task(Protocol):
    """One run's model, data, loss and metrics, in the order the trainer calls them."""

    has_validation: bool
    reads_files: bool  # its batches may fail on one rank (a file that broke): the trainer agrees on each

    def check(self, world_size: int, rescale: bool = False) -> Plan:
        """The checks that need no process group (data files, the loss, the model on the meta device) and the
        plan for ``world_size`` processes, checked against the model as ``hybridpar.parallelize`` applies it
        (``rescale``: re-planned for ``world_size`` where it was made for another, ``planning.rescaled``). Sets
        ``total_steps``."""

    total_steps: int  # of the whole run
    analysed: tuple  # (the model on the meta device, one step's example input, its graph): analysed once

    def setup(self, plan: Plan, mesh) -> object:
        """The parallel model (``hybridpar.ParallelModel``) of the model built from the seed; the data on
        ``mesh``."""

    def verification(self, plan: Plan) -> tuple:
        """``(model, (inputs, targets), loss_fn)``: the model built from the seed, one step's global batch of
        ``plan`` and the loss one process computes on it, for ``hybridpar.verify`` (after ``check``)."""

    def warnings(self) -> list[str]:
        """What rank 0 reports before training (files left out)."""

    def batches(self, start: int, stop: int) -> Iterable[tuple[int, torch.Tensor, torch.Tensor]]:
        """``(step, x, y)`` of this rank for steps ``start .. stop - 1``."""

    def seed_offset(self) -> int:
        """Added to a step's seed: which dropout masks this rank draws."""

    def record(self) -> dict:
        """What a step's metrics record holds besides the loss and the learning rate."""

    def validate(self) -> dict:
        """The validation metrics, the same on every rank."""

    def finish(self) -> dict:
        """What the run's summary holds besides the trainer's own fields; closes the data."""

    def close(self) -> None:
        """Closes what ``check`` opened."""


def task_for(config) -> Task:
    """The task of ``config``: tokens for a GPT, volumes (regression or segmentation) for the others."""
    if config.model.name == "gpt":
        from hybridpar.train.tasks.tokens import Tokens

        return Tokens(config)
    from hybridpar.train.tasks.volumes import Volumes

    return Volumes(config)


__all__ = ["Task", "task_for"]

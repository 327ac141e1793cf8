"""NaN and infinity in a run: a step whose loss is not finite stops the run before its update (or, with
``train.non_finite = "skip"``, skips the update), and weights that are not finite are never checkpointed, so
the intact checkpoints are never rotated out by broken ones. Each check is one collective over every rank and
names the lowest rank that found the problem, the same on every rank; the check of each step's loss carries
the ranks' stop signals and timed checkpoints too, so that neither costs a collective of its own."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridpar.errors import TrainingError
from hybridpar.train.recovery import last_checkpoint

logger = logging.getLogger(__name__)


def first_bad_rank(tensors, device: torch.device, signal: int = 0, due: bool = False) -> tuple[int | None, int, bool]:
    """The lowest rank holding a NaN or infinite value in ``tensors`` (local shards), or ``None``; the largest
    number of a stop signal any rank received (0: none); whether any rank finds a checkpoint due. One all-reduce
    over every rank."""
    bad = any(not torch.isfinite(t.to_local() if isinstance(t, DTensor) else t).all() for t in tensors)
    flags = torch.tensor([dist.get_rank() if bad else dist.get_world_size(), -signal, -int(due)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    rank = int(flags[0])
    return (None if rank == dist.get_world_size() else rank), -int(flags[1]), bool(flags[2])


def update_allowed(config, step: int, loss: torch.Tensor, signal: int = 0, due: bool = False,
                   settle=None) -> tuple[bool, int, bool]:
    """Whether step ``step`` (1-based) may update the weights: its loss is finite on every rank. Otherwise the
    run stops (``TrainingError``, once ``settle()`` finished the checkpoint in flight, so that the message names
    the last one), or with ``train.non_finite = "skip"`` the step is skipped with a warning. Also agrees on the
    stop signal any rank received (``recovery.Stopping``) and on whether a timed checkpoint is due
    (``checkpoint_dir.Cadence``), returned second and third."""
    rank, signal, due = first_bad_rank([loss.detach()], loss.device, signal, due)
    if rank is None:
        return True, signal, due
    what = f"step {step}: the loss is NaN or infinite on rank {rank}"
    if config.train.non_finite == "skip":
        if dist.get_rank() == 0:
            logger.warning(f"{what}; the step's update is skipped (train.non_finite = \"skip\")")
        return False, signal, due
    if settle is not None:
        settle()
    last = last_checkpoint(Path(config.run_dir))
    raise TrainingError(f"{what}; the run stopped before its update ({last}). Look for the cause (optimizer.lr, "
                        "the data of that step), or set train.non_finite = \"skip\" to skip such steps")


def check_weights(config, step: int, parameters: list, device: torch.device) -> None:
    """Refuse to checkpoint weights that are not finite (collective): the checkpoint of ``step`` is not written
    and the run stops, its intact checkpoints kept."""
    rank, _, _ = first_bad_rank((p.detach() for p in parameters), device)
    if rank is not None:
        raise TrainingError(f"step {step}: the weights became NaN or infinite on rank {rank}; the checkpoint of step "
                            f"{step} was not written ({last_checkpoint(Path(config.run_dir))}). Lower optimizer.lr, "
                            "or look at the data of the steps before")


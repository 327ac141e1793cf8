"""Checkpoints with ``torch.distributed.checkpoint``: every rank writes its part in parallel.

A checkpoint is first written to ``step_XXXXXXXX.partial`` and renamed to ``step_XXXXXXXX`` by rank 0
only once every rank has finished (DCP writes its ``.metadata`` last), so a crash mid-save leaves the
previous checkpoint intact and the half-written one is never mistaken for a finished one. Before the rename
every file's size and SHA-256 go into the checkpoint's manifest (``parallel.checkpoint_files``); a resume
checks them and falls back, newest first, to the last checkpoint that is intact, with a warning naming each
broken one.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from hybridpar.errors import CheckpointError, ConfigError
from hybridpar.parallel import checkpoint as sharded
from hybridpar.parallel import checkpoint_files as files

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d{8})$")


def checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """Finished checkpoints in ``directory``, oldest first, as ``(step, path)``."""
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _NAME.match(path.name)
        if match and (path / ".metadata").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def due(done: int, every: int, stop: int, total: int) -> bool:
    """Whether a periodic action (a checkpoint, a validation) is due after step ``done``: every ``every``
    steps (0: never in between), and at the last step of the run or of this part of it."""
    return (every > 0 and done % every == 0) or done == stop or done == total


def save(directory: Path, step: int, parallel, optimizer, *, keep: int) -> Path:
    """Write the checkpoint of ``step`` of a ``ParallelModel`` and its optimizer in global shapes (any plan
    and world size can resume from it; collective over all ranks)."""
    return save_state(directory, step, sharded.state_dict(parallel, optimizer), keep=keep)


def save_state(directory: Path, step: int, state: dict, *, keep: int) -> Path:
    """Write ``state`` (what DCP writes: tensors, DTensors) as the checkpoint of ``step`` (collective over
    all ranks); keep the newest ``keep``."""
    final = directory / f"step_{step:08d}"
    partial = final.with_name(final.name + ".partial")
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    sharded.write(state | {"progress": {"step": torch.tensor(step)}}, partial)
    if dist.get_rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        for _, old in checkpoints(directory)[:-keep]:
            shutil.rmtree(old)
        for stale in directory.glob("step_*.partial"):  # of saves a stopped run left unfinished
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    return final


def resume(directory: Path, parallel, optimizer) -> int:
    """Load the newest intact checkpoint of ``directory`` into a ``ParallelModel`` and its optimizer, written under
    any plan and resharded (collective); returns its step."""
    path = newest_intact(directory)
    _check_layout(path)
    sharded.init_optimizer_state(optimizer)
    return load_state(path, sharded.state_dict(parallel, optimizer))


def newest_intact(directory: Path) -> Path:
    """The newest finished checkpoint of ``directory`` whose files match its manifest (collective). A damaged one
    (a file missing, short or changed since it was written) is passed over with a warning naming it."""
    found = checkpoints(directory)
    for _, path in reversed(found):
        problem = files.verify(path)
        if problem is None:
            return path
        if dist.get_rank() == 0:
            logger.warning(f"checkpoint {path} is damaged ({problem}); trying the one before it")
    raise CheckpointError(f"no intact checkpoint in {directory} ({len(found)} damaged: the warnings name them); "
                          "start the run again in another run_dir")


def _check_layout(path: Path) -> None:
    """Refuse a checkpoint of the layout before plans (optimizer state under ``optim``), in words."""
    keys = files.read_metadata(path).state_dict_metadata
    if any(key.startswith("optim.") for key in keys) and not any(key.startswith("optimizer.") for key in keys):
        raise ConfigError(f"{path} was written by an earlier hybridpar, in a layout this one cannot resume; "
                          "finish that run with the version that started it, or start a new run")


def load_state(path: Path, state: dict) -> int:
    """Read a checkpoint into the tensors of ``state``, in place (collective); returns its step."""
    progress = {"step": torch.tensor(0)}
    sharded.read(state | {"progress": progress}, path)
    return int(progress["step"])

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
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from hybridpar.errors import CheckpointError, ConfigError
from hybridpar.parallel import checkpoint as sharded
from hybridpar.parallel import checkpoint_files as files
from hybridpar.plan.cost import checkpoint_interval

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^step_(\d{8})$")
ASSUMED_WRITE_RATE = 1e9  # bytes/s a rank writes, for the automatic interval until a save is measured


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


class Cadence:
    """When a run saves: after every ``checkpoint.every`` steps, or (``every = 0``) each time the interval of
    ``plan.cost.checkpoint_interval`` (Young/Daly) has passed, for the measured time of a save (the slowest
    rank's; before the first, the state's bytes at ``ASSUMED_WRITE_RATE``) and the job's mean time between
    failures (``checkpoint.mtbf_hours`` of one device over the number of devices); and always at the run's last
    step and where ``--stop-after`` stops it."""

    def __init__(self, config, world_size: int, state_bytes: float):
        self.every = config.checkpoint.every
        self.mtbf = config.checkpoint.mtbf_hours * 3600 / world_size
        self.save_time = state_bytes / ASSUMED_WRITE_RATE
        self.last = time.monotonic()

    @property
    def interval(self) -> float:
        return checkpoint_interval(self.save_time, self.mtbf)

    def timed(self) -> bool:
        """Whether, to this rank, the automatic interval has passed since the last save (the ranks agree on it in
        the step's check: ``finite.update_allowed``)."""
        return self.every == 0 and time.monotonic() - self.last >= self.interval

    def due(self, done: int, stop: int, total: int, timed: bool) -> bool:
        return due(done, self.every, stop, total) or timed

    def saved(self, seconds: float, device: torch.device) -> None:
        """A save took ``seconds`` on this rank: the slowest rank's time sets the next interval (collective)."""
        slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        self.save_time, self.last = float(slowest), time.monotonic()

    def describe(self) -> str:
        if self.every:
            return f"checkpoints every {self.every} steps"
        return (f"checkpoints every {_duration(self.interval)} (Young/Daly: a save of about {self.save_time:.2g} s "
                f"until one is measured; the devices fail together every {_duration(self.mtbf)} on average, "
                "checkpoint.mtbf_hours)")


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h" if seconds < 360_000 else f"{seconds / 3600:,.0f} h"


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
    all ranks); keep the newest ``keep``. A file that cannot be written (a full disk, a path taken by a file)
    is a ``CheckpointError`` on every rank; the checkpoints before stay intact."""
    final = directory / f"step_{step:08d}"
    partial = final.with_name(final.name + ".partial")
    _agreed_on_rank_0(step, lambda: (shutil.rmtree(partial, ignore_errors=True),
                                     directory.mkdir(parents=True, exist_ok=True)))
    try:
        sharded.write(state | {"progress": {"step": torch.tensor(step)}}, partial)
    except CheckpointException as err:  # raised by DCP on every rank, with each rank's cause
        causes = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]  # (exception, its stack)
        cause = next((c for c in causes if isinstance(c, OSError)), causes[0] if causes else err)
        raise CheckpointError(_cannot_write(step, cause)) from None
    _agreed_on_rank_0(step, lambda: _finish(directory, partial, final, keep))
    return final


def _finish(directory: Path, partial: Path, final: Path, keep: int) -> None:
    """Rank 0, once every rank has written: the rename that makes the checkpoint finished, and the cleanup."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    for _, old in checkpoints(directory)[:-keep]:
        shutil.rmtree(old)
    for stale in directory.glob("step_*.partial"):  # of saves a stopped run left unfinished
        shutil.rmtree(stale, ignore_errors=True)


def _agreed_on_rank_0(step: int, action) -> None:
    """``action()`` on rank 0, its ``OSError`` a ``CheckpointError`` on every rank (collective: a barrier)."""
    problem = None
    if dist.get_rank() == 0:
        try:
            action()
        except OSError as err:
            problem = _cannot_write(step, err)
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise CheckpointError(box[0])


def _cannot_write(step: int, err: BaseException) -> str:
    where = f" ({err.filename})" if getattr(err, "filename", None) else ""
    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    return (f"cannot write the checkpoint of step {step}: {reason}{where}; the checkpoints before it are intact: "
            "free space or fix the path, then continue with --resume")


def resume(directory: Path, parallel, optimizer) -> int:
    """Load the newest intact checkpoint of ``directory`` into a ``ParallelModel`` and its optimizer, written under
    any plan and resharded (collective); returns its step."""
    return load(newest_intact(directory), parallel, optimizer)


def load(path: Path, parallel, optimizer) -> int:
    """Load the checkpoint at ``path`` into a ``ParallelModel`` and its optimizer (collective); returns its step."""
    _check_layout(path)
    sharded.init_optimizer_state(optimizer)
    return load_state(path, sharded.state_dict(parallel, optimizer))


def finished_step(directory: Path, total_steps: int) -> int | None:
    """The step of the newest intact checkpoint of ``directory`` at ``total_steps`` or past it: a run with nothing
    left to train; ``None`` where the newest intact one comes before (or there is none). Only the checkpoints at
    or past ``total_steps`` are checked against their manifests (a damaged one, or one without a manifest, is
    passed over: the run resumes and ``newest_intact`` names it); collective in a process group."""
    for step, path in reversed(checkpoints(directory)):
        if step < total_steps:
            return None
        if files.verify(path) is None:
            return step
    return None


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

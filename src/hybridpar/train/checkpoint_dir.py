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
from concurrent.futures import Future
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
    return save_state(directory, step, state_of(parallel, optimizer), keep=keep)


def state_of(parallel, optimizer, buffers_copied: bool = False) -> dict:
    """What a checkpoint of a ``ParallelModel`` and its optimizer holds: views of this rank's tensors (its buffers
    copied, with ``buffers_copied``)."""
    return sharded.state_dict(parallel, optimizer, buffers_copied)


def save_state(directory: Path, step: int, state: dict, *, keep: int) -> Path:
    """Write ``state`` (what DCP writes: tensors, DTensors) as the checkpoint of ``step`` (collective over
    all ranks); keep the newest ``keep``. A file that cannot be written (a full disk, a path taken by a file)
    is a ``CheckpointError`` on every rank; the checkpoints before stay intact."""
    final, partial = _folders(directory, step)
    try:
        sharded.write(state | {"progress": {"step": torch.tensor(step)}}, partial)
    except CheckpointException as err:
        raise CheckpointError(_cannot_write(step, _cause(err))) from None
    _agreed_on_rank_0(step, lambda: _finish(directory, partial, final, keep))
    return final


class Saver:
    """Checkpoints that do not stall training (``save``): the state is copied in memory in a thread while the next
    step's forward and backward run (``staged`` waits for the copy before anything changes the state: the
    update); DCP writes the copy, every rank hashes its share of the files into the manifest, and rank 0 renames
    the folder finished, in the background, on a process group of their own (made here: collective). One save
    at a time: the next save, a load and the run's end ``wait`` for the one before. A save that could not be
    written is a ``CheckpointError`` there, on every rank; the checkpoints before it stay intact."""

    def __init__(self):
        self.group = dist.new_group(backend="gloo")
        self.staging = sharded.stager()
        self._pending: tuple[int, Future, float] | None = None  # step, its future, when it began
        self._copying: Future | None = None
        self.blocked_s = 0.0  # what the save in flight held its steps up so far
        self.write_s: float | None = None  # the last save's time from its start to its rename

    def save(self, directory: Path, step: int, state: dict, *, keep: int) -> None:
        """Start the checkpoint of ``step`` holding ``state`` (what DCP writes: tensors, DTensors; ``state_of``
        a model's, its buffers copied: a forward pass changes them; collective). No tensor of ``state`` may
        change until ``staged``."""
        self.wait()
        begin = time.monotonic()
        final, partial = _folders(directory, step)
        state = state | {"progress": {"step": torch.tensor(step)}}
        self._copying, future = sharded.write_in_background(
            state, partial, self.group, self.staging,
            then=lambda: _agreed_on_rank_0(step, lambda: _finish(directory, partial, final, keep), self.group) or final)
        self._pending = (step, future, begin)
        self.blocked_s = time.monotonic() - begin

    def staged(self) -> float | None:
        """Wait for the copy of the save in flight, if it is not done; returns the seconds that save held this rank
        up in all (``None``: no copy was in flight)."""
        if self._copying is None:
            return None
        begin = time.monotonic()
        self._copying.result()
        self._copying = None
        self.blocked_s += time.monotonic() - begin
        return self.blocked_s

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def written(self) -> bool:
        """Whether the save in flight, if any, is finished (``wait`` would not wait)."""
        return self._pending is None or self._pending[1].done()

    def wait(self) -> Path | None:
        """The folder of the save in flight once it is finished (``None``: none was); collective where one was."""
        if self._pending is None:
            return None
        self.staged()
        step, future, begin = self._pending
        self._pending = None
        try:
            final = future.result()
        except CheckpointException as err:  # raised by DCP on every rank, with each rank's cause
            raise CheckpointError(_cannot_write(step, _cause(err))) from None
        self.write_s = time.monotonic() - begin
        return final


def _folders(directory: Path, step: int) -> tuple[Path, Path]:
    """The checkpoint of ``step``'s folder and the one it is written in (made empty: collective)."""
    final = directory / f"step_{step:08d}"
    partial = final.with_name(final.name + ".partial")
    _agreed_on_rank_0(step, lambda: (shutil.rmtree(partial, ignore_errors=True),
                                     directory.mkdir(parents=True, exist_ok=True)))
    return final, partial


def _cause(err: CheckpointException) -> BaseException:
    """The first rank's cause of DCP's failure, an ``OSError`` first (each failure is (exception, its stack))."""
    causes = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
    return next((c for c in causes if isinstance(c, OSError)), causes[0] if causes else err)


def _finish(directory: Path, partial: Path, final: Path, keep: int) -> None:
    """Rank 0, once every rank has written: the rename that makes the checkpoint finished, and the cleanup."""
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    for _, old in checkpoints(directory)[:-keep]:
        shutil.rmtree(old)
    for stale in directory.glob("step_*.partial"):  # of saves a stopped run left unfinished
        shutil.rmtree(stale, ignore_errors=True)


def _agreed_on_rank_0(step: int, action, group=None) -> None:
    """``action()`` on rank 0, its ``OSError`` a ``CheckpointError`` on every rank (collective over ``group``, by
    default the default one: a barrier)."""
    problem = None
    if dist.get_rank() == 0:
        try:
            action()
        except OSError as err:
            problem = _cannot_write(step, err)
    box = [problem]
    dist.broadcast_object_list(box, src=0, group=group)
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

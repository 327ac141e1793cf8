"""Runs that are stopped or restarted: SIGTERM and SIGINT asking a run to stop after its step (with a
checkpoint), the elastic agent's restarts (``hybridpar train --max-restarts N``, ``torchrun --max-restarts N``),
and a failure told in one line from what the run directory shows."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

from hybridpar.train import checkpoint_dir
from hybridpar.train.metrics import last_step

# what gloo and NCCL raise on the ranks that survive a dead one (its connections closed)
_LOST_PEER = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")


def attempt() -> int:
    """0 for a run's first start, ``i`` for its ``i``-th restart."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def max_restarts() -> int:
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0"))


def lost_peer(err: BaseException) -> bool:
    """Whether ``err`` is a collective's failure because another rank died (not a fault of this rank)."""
    import torch.distributed as dist

    return isinstance(err, dist.DistError) or any(text in str(err) for text in _LOST_PEER)


def describe(failures: dict, run_dir: Path, note: str = "", hang: str | None = None) -> str:
    """``rank 3 died in step 102 (signal 9, SIGKILL); last checkpoint: step 100`` for the elastic agent's
    ``failures`` (by global rank): a rank ended by a signal first, else the first that failed; where a watchdog
    ended the attempt, ``hung: `` and what it told (``hang``)."""
    if hang:
        return f"hung: {hang}{note}; {last_checkpoint(run_dir, 'no checkpoint yet')}"
    signalled = {rank: f for rank, f in failures.items() if f.exitcode < 0}
    rank, failure = min((signalled or failures).items(), key=lambda item: (item[1].timestamp, item[0]))
    how = (f"signal {-failure.exitcode}, {failure.signal_name()}" if failure.exitcode < 0
           else f"exit code {failure.exitcode}")
    step = last_step(run_dir / "metrics.jsonl")
    return f"rank {rank} died{f' in step {step + 1}' if step is not None else ''} ({how}){note}; " \
        f"{last_checkpoint(run_dir, 'no checkpoint yet')}"


def last_checkpoint(run_dir: Path, none: str = "no checkpoint was written") -> str:
    """``last checkpoint: step 100``, from the run directory's finished checkpoints (``none`` without one)."""
    found = checkpoint_dir.checkpoints(run_dir / "checkpoints")
    return f"last checkpoint: step {found[-1][0]}" if found else none


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Stopping:
    """While a run trains: ``signal`` is the number of the first SIGTERM or SIGINT this process received (0: none
    yet), and the run stops at the end of its step with a checkpoint. Later signals change nothing: the elastic
    agent forwards the signal it received, and a terminal's Ctrl-C reaches every process; the agent kills the
    workers once its grace period is over. Installed in the main thread only (where Python runs handlers)."""

    def __init__(self):
        self.signal = 0
        self._saved: dict = {}

    def __enter__(self) -> Stopping:
        if threading.current_thread() is threading.main_thread():
            self._saved = {number: signal.signal(number, self._received) for number in STOP_SIGNALS}
        return self

    def _received(self, number: int, frame) -> None:
        self.signal = self.signal or number

    def __exit__(self, *exc) -> None:
        for number, handler in self._saved.items():
            signal.signal(number, handler)


def stopped_message(number: int, run_dir: Path) -> str:
    """``stopped by SIGTERM; last checkpoint: step 100 (...); continue with --resume``."""
    found = checkpoint_dir.checkpoints(run_dir / "checkpoints")
    where = f"last checkpoint: step {found[-1][0]} ({found[-1][1]})" if found else "no checkpoint was written"
    return f"stopped by {signal.Signals(number).name}; {where}; continue with --resume"

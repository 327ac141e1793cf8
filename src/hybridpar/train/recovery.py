"""Runs restarted by the elastic agent (``hybridpar train --max-restarts N``, or ``torchrun --max-restarts N``):
which attempt this is, and a failure told in one line from what the run directory shows."""

from __future__ import annotations

import os
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


def describe(failures: dict, run_dir: Path, note: str = "") -> str:
    """``rank 3 died in step 102 (signal 9, SIGKILL); last checkpoint: step 100`` for the elastic agent's
    ``failures`` (by global rank): a rank ended by a signal first, else the first that failed."""
    signalled = {rank: f for rank, f in failures.items() if f.exitcode < 0}
    rank, failure = min((signalled or failures).items(), key=lambda item: (item[1].timestamp, item[0]))
    how = (f"signal {-failure.exitcode}, {failure.signal_name()}" if failure.exitcode < 0
           else f"exit code {failure.exitcode}")
    step = last_step(run_dir / "metrics.jsonl")
    found = checkpoint_dir.checkpoints(run_dir / "checkpoints")
    last = f"last checkpoint: step {found[-1][0]}" if found else "no checkpoint yet"
    return f"rank {rank} died{f' in step {step + 1}' if step is not None else ''} ({how}){note}; {last}"

"""Metrics of a run, written by rank 0: one JSON object per line in ``metrics.jsonl`` (and TensorBoard
scalars when asked for: ``check_tensorboard`` says up front when the package is missing); the ranks' step
timing (``hybridpar.train.pace``) in ``pace.jsonl`` the same way."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
from pathlib import Path

from hybridpar.errors import ConfigError

logger = logging.getLogger(__name__)


class MetricsLog:
    """``log(record)`` appends ``record`` (a dict with ``step`` and ``split``) to the JSONL file ``name``."""

    def __init__(self, run_dir: Path, *, jsonl: bool, tensorboard: bool, resume_step: int | None,
                 name: str = "metrics.jsonl"):
        self.path = run_dir / name if jsonl else None
        if self.path is not None:
            self._start(resume_step)
        self.writer = _tensorboard(run_dir) if tensorboard else None

    def _start(self, resume_step: int | None) -> None:
        """On resume, keep the records up to the checkpoint's step (the steps after it are run again), and drop
        lines cut short (a run killed while writing one). A fresh run creates the file with its first record,
        so a run that fails before any step leaves none."""
        if resume_step is not None and self.path.exists():
            lines = [line for line in self.path.read_text(errors="replace").splitlines() if line.strip()]
            records = [_record(line) for line in lines]
            torn = sum(record is None for record in records)
            if torn:
                logger.warning(f"{self.path}: dropped {torn} line(s) cut short (a run stopped while writing them); "
                               "their steps are trained again")
            kept = [line for line, r in zip(lines, records) if r is not None and r["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, record: dict) -> None:
        """Append ``record``; a NaN or infinite number is written as ``null`` (JSON has no NaN)."""
        if self.path is not None:
            finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
            with self.path.open("a") as f:
                f.write(json.dumps(finite, allow_nan=False) + "\n")
        if self.writer is not None:
            for key, value in record.items():
                if key not in ("step", "split") and isinstance(value, (int, float)):
                    self.writer.add_scalar(f"{record['split']}/{key}", value, record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def check_tensorboard(config) -> None:
    """``metrics.tensorboard = true`` needs the tensorboard package: checked before any worker starts."""
    if config.metrics.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("metrics.tensorboard = true, but the tensorboard package is not installed: "
                          "pip install tensorboard (or hybridpar[tensorboard]), or set metrics.tensorboard = false")


def _tensorboard(run_dir: Path):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(run_dir / "tensorboard"))


def _record(line: str) -> dict | None:
    """The record of one line of ``metrics.jsonl``, or ``None`` for a line cut short."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def last_step(path: Path) -> int | None:
    """The step of the last whole record of a ``metrics.jsonl`` file (``None``: no file, no record)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    return next((r["step"] for line in reversed(lines) if (r := _record(line)) is not None), None)


def read(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

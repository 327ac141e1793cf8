"""Metrics of a run, written by rank 0: one JSON object per line in ``metrics.jsonl`` (and TensorBoard
scalars when asked for: ``check_tensorboard`` says up front when the package is missing)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from hybridpar.errors import ConfigError


class MetricsLog:
    """``log(record)`` appends ``record`` (a dict with ``step`` and ``split``) to the JSONL file."""

    def __init__(self, run_dir: Path, *, jsonl: bool, tensorboard: bool, resume_step: int | None):
        self.path = run_dir / "metrics.jsonl" if jsonl else None
        if self.path is not None:
            self._start(resume_step)
        self.writer = _tensorboard(run_dir) if tensorboard else None

    def _start(self, resume_step: int | None) -> None:
        """On resume, keep the records up to the checkpoint's step (the steps after it are run again). A
        fresh run creates the file with its first record, so a run that fails before any step leaves none."""
        if resume_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, record: dict) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
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


def read(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` file."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

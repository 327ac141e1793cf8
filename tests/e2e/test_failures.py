"""Runs that meet failures, through the command line: a NaN loss stops the run (or skips the step) before any
broken checkpoint is written, and ``metrics.jsonl`` stays JSON."""

import json
from pathlib import Path

import pytest

from hybridpar.train import checkpoint_dir, metrics
from test_train import expect_error, hybridpar
from test_train_gpt import config

pytestmark = pytest.mark.slow  # each test trains through the CLI in fresh worker processes

DP2 = "[mesh]\ndp = 2\n"


def test_a_nan_loss_stops_the_run_before_its_update(tmp_path):
    cfg = config(tmp_path / "c.toml", tmp_path / "run", top=DP2)
    error = expect_error("train", cfg, "--nproc", 2, env={"HYBRIDPAR_FAULTS": "nan:1@5"},
                         match="step 5: the loss is NaN or infinite on rank 1; the run stopped before its update "
                               "(last checkpoint: step 3)")
    assert 'train.non_finite = "skip"' in error
    assert [r["step"] for r in metrics.read(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [s for s, _ in checkpoint_dir.checkpoints(tmp_path / "run" / "checkpoints")] == [3]


def test_a_nan_loss_skips_the_step_when_asked(tmp_path):
    cfg = config(tmp_path / "c.toml", tmp_path / "run", top=DP2, train_extra='non_finite = "skip"')
    proc = hybridpar("train", cfg, "--nproc", 2, env={"HYBRIDPAR_FAULTS": "nan:0@2"})
    assert "step 2: the loss is NaN or infinite on rank 0; the step's update is skipped" in proc.stderr
    text = (tmp_path / "run" / "metrics.jsonl").read_text()
    assert "NaN" not in text
    records = [json.loads(line) for line in text.splitlines()]
    skipped = [r for r in records if r.get("skipped")]
    assert [(r["step"], r["loss"]) for r in skipped] == [(2, None)]
    assert all(isinstance(r["loss"], float) for r in records if r not in skipped)
    assert [s for s, _ in checkpoint_dir.checkpoints(tmp_path / "run" / "checkpoints")] == [3, 6]


def test_weights_that_became_infinite_are_never_checkpointed(tmp_path):
    """A weight of rank 1 turns infinite after the update of step 4 (the loss of step 4 was finite): the run stops
    at the checkpoint of step 4, which is not written, and the checkpoint of step 3 stays."""
    cfg = config(tmp_path / "c.toml", tmp_path / "run", top=DP2)
    Path(cfg).write_text(cfg.read_text().replace("every = 3", "every = 1\nkeep = 1"))
    expect_error("train", cfg, "--nproc", 2, env={"HYBRIDPAR_FAULTS": "inf:1@4"},
                 match="step 4: the weights became NaN or infinite on rank 1; the checkpoint of step 4 was not "
                       "written (last checkpoint: step 3)")
    assert [s for s, _ in checkpoint_dir.checkpoints(tmp_path / "run" / "checkpoints")] == [3]

"""A short chaos run (``benchmarks/chaos.py``): CosmoFlow at dp=2 x spatial 2 on 4 workers under a fault every few
seconds, each kind at least once (SIGKILL, SIGSTOP, a worker slowed 3x, a stalled link, SIGTERM then ``--resume``):
the run finishes by itself, with no traceback, and its final weights, Adam's moments and losses are the
uninterrupted run's, bit for bit."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.harness import limit

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]


def test_a_chaos_run_finishes_by_itself_bitwise_equal(tmp_path):
    out = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "chaos.py"), "--steps", "160", "--every", "10",
                           "--slow-s", "10", "--seed", "1", "--json", str(out)], capture_output=True, text=True,
                          timeout=limit(1400), env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    figures = json.loads(out.read_text())
    assert all(count >= 1 for count in figures["faults"].values()), figures  # every kind, at least once
    assert figures["weights_equal"] and figures["losses_equal"], proc.stdout
    assert figures["tracebacks"] == 0, proc.stdout
    # each kill was told as a death, each stop and stall as a hang, and each restarted; each SIGTERM relaunched it
    faults = figures["faults"]
    assert figures["deaths"] == faults["kill"] and figures["hangs"] == faults["stop"] + faults["stall"], figures
    assert figures["restarts"] == figures["deaths"] + figures["hangs"], figures
    assert figures["launches"] == 1 + faults["term"], figures
    assert 0 < figures["goodput"] < 1, figures

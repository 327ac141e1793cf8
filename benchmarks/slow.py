"""A slow rank, measured side by side in one run: found, and given less work.

CosmoFlow (64^3 synthetic universes, base_channels 8, float32) trains on 4 local workers through the command line
(``hybridpar train``), its step timing written to ``pace.jsonl`` (``hybridpar.train.pace``), in four runs:

- **even**: no slow rank, ``--long`` steps: the step time of an even run, and the false alarms of the detector
  (windows in which some rank's factor passed ``train.slow_factor``, and ranks reported slow: two such windows in
  a row) over a long run that nothing slows;
- **slowed**: rank 1 computing 2x slower from step 1 (``HYBRIDPAR_FAULTS="slow:1@1"``): the step of its report
  and the step time;
- **rebalanced**: the same with ``--rebalance``: the plans it tried, and the step time from its first re-plan on
  (the windows of splits tried and undone included);

once at dp=4 (batch 16: uneven shares of the batch) and once at dp=2 x spatial 2 (batch 8: uneven slabs or
shares). The step times are the medians of the windows' slowest rank (steps after the warm-up); ratios are to the
even run's.

    python benchmarks/slow.py                   # about 12 minutes on 2 cores
    python benchmarks/slow.py --steps 30 --long 60
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = """run_dir = "{run}"
seed = 0
[model]
name = "cosmoflow"
base_channels = 8
fc_sizes = [16]
[data]
format = "cosmoflow"
train = "{data}/train"
val = "{data}/val"
[optimizer]
name = "adam"
lr = 0.001
[mesh]
dp = {dp}
spatial = {spatial}
[train]
steps = {steps}
batch_size = {batch}
log_every = 1000
[validation]
every = 0
[checkpoint]
every = 0
mtbf_hours = 1e9
"""
MESHES = {"dp=4": dict(dp=4, spatial=[1, 1, 1], batch=16), "dp=2 x spatial 2": dict(dp=2, spatial=[1, 2, 1], batch=8)}


def hybridpar(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    proc = subprocess.run([sys.executable, "-m", "hybridpar", *map(str, args)], capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})))
    if proc.returncode:
        raise SystemExit(f"hybridpar {' '.join(map(str, args))} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def run(root: Path, name: str, data: Path, mesh: dict, steps: int, *extra, faults: str = "") -> dict:
    """One training run; its pace windows, slow reports and re-plans."""
    config = root / f"{name}.toml"
    config.write_text(CONFIG.format(run=root / name, data=data, steps=steps, **mesh))
    hybridpar("train", config, "--nproc", 4, *extra, env={"HYBRIDPAR_FAULTS": faults} if faults else None)
    read = lambda file: [json.loads(line) for line in (root / name / file).read_text().splitlines()]  # noqa: E731
    records = read("metrics.jsonl")
    return {"pace": read("pace.jsonl"), "slow": [r for r in records if r["split"] == "slow"],
            "replan": [r for r in records if r["split"] == "replan"]}


def step_time(result: dict, after: int = 0) -> float:
    """The median over the windows after step ``after`` of the slowest rank's median step."""
    times = [max(w["step_s"]) for w in result["pace"] if w["step"] > after]
    return statistics.median(times) if times else float("nan")


def false_alarms(result: dict, threshold: float = 1.5) -> tuple[int, int, int, float]:
    """Windows in which some rank's factor passed ``threshold``; of them, those where its forward was also past
    its expectation by ``pace.MATTERS`` of its step (what counts towards a report); all windows; the largest
    factor seen."""
    from hybridpar.train.pace import MATTERS

    windows = result["pace"]
    over = [(w, r) for w in windows for r, f in enumerate(w["factor"]) if f > threshold]
    matter = {w["step"] for w, r in over
              if w["compute_s"][r] * (1 - 1 / w["factor"][r]) >= MATTERS * w["step_s"][r]}
    return len({w["step"] for w, _ in over}), len(matter), len(windows), max(max(w["factor"]) for w in windows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="steps of the slowed runs (default 60)")
    parser.add_argument("--long", type=int, default=200, help="steps of the even runs (default 200)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for split, count in (("train", 16), ("val", 4)):
            hybridpar("data", "synth-cosmoflow", "--out", root / "data" / split, "--num-samples", count, "--size", 64,
                      "--seed", 1)
        for label, mesh in MESHES.items():
            even = run(root, "even", root / "data", mesh, args.long)
            slowed = run(root, "slowed", root / "data", mesh, args.steps, faults="slow:1@1")
            rebalanced = run(root, "rebalanced", root / "data", mesh, args.steps, "--rebalance", faults="slow:1@1")
            base = step_time(even)
            first = rebalanced["replan"][0]["step"] if rebalanced["replan"] else 0
            over, matter, windows, largest = false_alarms(even)
            print(f"{label}, 4 workers ({windows} windows of 5 steps unslowed):")
            print(f"  even        {base:.3f} s per step; false alarms: {over} of {windows} windows with a factor over "
                  f"1.5 ({matter} also past it by 5% of the step; largest factor {largest:.2f}), "
                  f"{len(even['slow'])} ranks reported slow")
            found = slowed["slow"][0] if slowed["slow"] else None
            print(f"  slowed 2x   {step_time(slowed, 10):.3f} s per step ({step_time(slowed, 10) / base:.2f}x even); "
                  + (f"rank {found['rank']} reported at step {found['step']} ({found['factor']:.2f}x)" if found
                     else "not reported"))
            tried = "; ".join(f"step {r['step']}: {r['plan']} ({r['reason']})" for r in rebalanced["replan"])
            print(f"  rebalanced  {step_time(rebalanced, first):.3f} s per step "
                  f"({step_time(rebalanced, first) / base:.2f}x even) after step {first}; {tried or 'no re-plan'}")
            for name in ("even", "slowed", "rebalanced"):
                subprocess.run(["rm", "-rf", str(root / name)], check=True)


if __name__ == "__main__":
    main()

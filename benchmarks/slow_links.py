"""Slow links named, and no false alarm, measured side by side in one run.

CosmoFlow (32^3, base_channels 2, float64) trains at dp=2 x spatial 2 on 4 local workers through the command
line (``hybridpar train``), validation and the checkpoint at the end only, the default timing window
(``train.slow_window = 5``: links judged over the last 10 steps):

- **named**: with rank 1's link slowed from step ``--onset`` (``HYBRIDPAR_FAULTS="link:1@SxF"`` for each ``F`` of
  ``--factors``), the step at which the link is named, the steps that took (the aim: 10 at most), the link's
  measured factor (its time per byte over its peer link's) and what the slow link adds to a step;
- **false alarms**: ``--clean-steps`` steps with no fault while ``--load`` busy processes share the cores (a
  loaded machine): the links and ranks named slow (the aim: none), and the largest factor any link showed.

    python benchmarks/slow_links.py                      # about 12 minutes on 2 cores
    python benchmarks/slow_links.py --clean-steps 200 --load 0
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = """run_dir = "{run}"
seed = 3
[model]
name = "cosmoflow"
base_channels = 2
fc_sizes = [8]
[data]
format = "cosmoflow"
train = "{data}/train"
val = "{data}/val"
[mesh]
dp = 2
spatial = [1, 2, 1]
[optimizer]
name = "adam"
lr = 0.001
[train]
steps = {steps}
batch_size = 4
dtype = "float64"
log_every = 1000000
[validation]
every = {steps}
[checkpoint]
every = {steps}
"""


def hybridpar(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "hybridpar", *map(str, args)], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    if proc.returncode != 0:
        raise SystemExit(f"hybridpar {' '.join(map(str, args))} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def records(run: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run / name).read_text().splitlines()]


def train(root: Path, name: str, data: Path, steps: int, faults: str = "") -> tuple[Path, float]:
    run = root / name
    config = root / f"{name}.toml"
    config.write_text(CONFIG.format(run=run, data=data, steps=steps))
    begin = time.perf_counter()
    hybridpar("train", config, "--nproc", 4, env={"HYBRIDPAR_FAULTS": faults} if faults else None)
    return run, time.perf_counter() - begin


def busy(stop) -> None:
    while not stop.is_set():
        sum(range(10000))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--factors", type=int, nargs="+", default=[5, 10, 20])
    parser.add_argument("--onset", type=int, default=13, help="the step the link slows from")
    parser.add_argument("--steps", type=int, default=40, help="steps of each run with a slowed link")
    parser.add_argument("--clean-steps", type=int, default=2000)
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the clean run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = root / "data"
        for split, count, seed in (("train", 8, 1), ("val", 3, 2)):
            hybridpar("data", "synth-cosmoflow", "--out", data / split, "--num-samples", count, "--size", 32,
                      "--seed", seed)
        _, clean_s = train(root, "clean", data, args.steps)
        print(f"CosmoFlow 32^3 at dp=2 x spatial 2 on 4 workers, {os.cpu_count()} cores; {args.steps} clean steps: "
              f"{clean_s:.1f} s")
        print(f"{'link fault':<16} {'named at':>9} {'steps':>6} {'factor':>7} {'link s':>7} {'step s':>7}  named")
        for factor in args.factors:
            run, _ = train(root, f"x{factor}", data, args.steps, f"link:1@{args.onset}x{factor}")
            named = [r for r in records(run, "metrics.jsonl") if r["split"] in ("slow-link", "slow")]
            first = next((r for r in named if r["split"] == "slow-link"), None)
            what = ", ".join(f"{r['split']} {r.get('ranks', r.get('rank'))}" for r in named) or "nothing"
            if first is None:
                print(f"link:1@{args.onset}x{factor:<5} {'-':>9} {'-':>6} {'-':>7} {'-':>7} {'-':>7}  {what}")
                continue
            print(f"link:1@{args.onset}x{factor:<5} {first['step']:>9} {first['step'] - args.onset + 1:>6} "
                  f"{first['factor']:>7.2f} {first['seconds']:>7.3f} {first['step_s']:>7.3f}  {what}")
        stop = multiprocessing.Event()
        load = [multiprocessing.Process(target=busy, args=(stop,), daemon=True) for _ in range(args.load)]
        for p in load:
            p.start()
        try:
            run, took = train(root, "quiet", data, args.clean_steps)
        finally:
            stop.set()
            for p in load:
                p.join()
        named = [r for r in records(run, "metrics.jsonl") if r["split"] in ("slow-link", "slow")]
        judged = [r for r in records(run, "pace.jsonl") if r["split"] == "links"]
        factors = [link["factor"] for r in judged for link in r["links"]]
        print(f"{args.clean_steps} clean steps beside {args.load} busy processes ({took:.0f} s, "
              f"{statistics.median(r['step_s'] for r in judged):.3f} s a step): {len(judged)} judgements, "
              f"{len(named)} false alarms{': ' + str(named) if named else ''}; largest link factor "
              f"{max(factors):.2f}")


if __name__ == "__main__":
    main()

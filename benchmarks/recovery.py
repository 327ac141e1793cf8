"""Recovery from killed workers, measured side by side in one run.

A GPT (4 layers, d_model 32, float64) trains 12 steps at tp=2 x pp=2 on 4 local workers, a checkpoint after
every step, through the command line (``hybridpar train``): once uninterrupted, and once with ``--kills``
workers killed by SIGKILL at random steps and ranks (``HYBRIDPAR_FAULTS``) under ``--max-restarts``. Every
line of output is time-stamped as it arrives. Reported:

- **restart**: from the launcher's report of a death (the agent has seen it and stopped the other workers) to
  the restarted rank 0's ``restart i of N: training from step s`` (new workers forked, plan checked, newest
  checkpoint verified and loaded), median and range;
- **cost per kill**: the killed run's extra wall time over the uninterrupted run's, divided by the kills
  (detection, restart, and the step trained again);
- whether the two runs' losses are equal, bit for bit.

Then hangs: the same GPT trains 200 steps, a checkpoint every 10, uninterrupted and with ``--hangs`` workers
stopped by SIGSTOP one after the other (a rank that neither dies nor answers) under ``--max-restarts``:

- **found**: from the SIGSTOP to the launcher's ``hung: ...`` line (the watchdog's deadline, its reading of the
  heartbeats, the other workers killed);
- **training again**: from the SIGSTOP to the restarted rank 0's ``restart i of N: training from step s``;
- whether the losses are the uninterrupted run's, bit for bit.

    python benchmarks/recovery.py               # 10 kills and 3 hangs, about 3 minutes on 2 cores
    python benchmarks/recovery.py --kills 20 --hangs 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "tests")]

from support.processes import workers  # noqa: E402

CONFIG = """run_dir = "{run}"
seed = 0
plan = "{plan}"
[model]
name = "gpt"
vocab_size = 32
seq_len = 16
num_layers = 4
num_heads = 4
d_model = 32
[data]
format = "tokens"
[optimizer]
name = "adam"
lr = 0.01
[train]
steps = 12
batch_size = 8
dtype = "float64"
log_every = 1
[checkpoint]
every = 1
"""


def write_plan(path: Path) -> None:
    import torch

    from hybridpar.models.gpt import gpt
    from hybridpar.parallel.tensor import pair_strategies
    from hybridpar.plan import Plan, graph_of

    with torch.device("meta"):
        model = gpt(vocab_size=32, seq_len=16, num_layers=4, num_heads=4, d_model=32)
    layers = tuple(pair_strategies(graph_of(model, torch.zeros(8, 16, dtype=torch.long)), tp=2).items())
    plan = Plan(global_batch=8, input_shape=(8, 16), dtype="float64", layers=layers, tp=2, pp=2,
                stages=("blocks.2.ln_1",), micro_batches=2)
    path.write_text(plan.to_json())


def timed_run(config: Path, *extra: str, env: dict | None = None) -> tuple[float, list[tuple[float, str]]]:
    """Wall seconds of ``hybridpar train config`` and its output lines with their arrival times."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "hybridpar", "train", str(config), "--nproc", "4", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))
    lines = [(time.perf_counter() - start, line.rstrip()) for line in proc.stdout]
    if proc.wait() != 0:
        sys.exit("\n".join(line for _, line in lines))
    return time.perf_counter() - start, lines


def hung_run(config: Path, hangs: int, seed: int) -> list[tuple[float, float]]:
    """Train ``config`` with ``hangs`` workers stopped (SIGSTOP) one after the other, each once the attempt
    before it has trained 20 steps; per hang, the seconds until the launcher told it and until rank 0 trained
    again."""
    rng = random.Random(seed)
    proc = subprocess.Popen([sys.executable, "-m", "hybridpar", "train", str(config), "--nproc", "4",
                             "--max-restarts", str(hangs)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.perf_counter(), line.rstrip()) for line in proc.stdout))
    reader.start()
    metrics = config.parent / "hung" / "metrics.jsonl"
    measured = []
    for attempt in range(1, hangs + 1):
        begin = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        while (not metrics.exists() or len(metrics.read_text().splitlines()) < begin + 20) and proc.poll() is None:
            time.sleep(0.1)
        stopped_at = time.perf_counter()
        os.kill(rng.choice(workers(proc.pid)), signal.SIGSTOP)
        while not any(line.startswith(f"restart {attempt} of") for _, line in lines) and proc.poll() is None:
            time.sleep(0.05)
        told = next(t for t, line in lines if line.startswith("hung:") and f"restarting ({attempt} of" in line)
        again = next(t for t, line in lines if line.startswith(f"restart {attempt} of"))
        measured.append((told - stopped_at, again - stopped_at))
    if proc.wait() != 0:
        reader.join()
        sys.exit("\n".join(line for _, line in lines))
    reader.join()
    return measured


def kills(count: int, seed: int) -> str:
    rng = random.Random(seed)
    return ",".join(f"kill:{rng.randrange(4)}@{step}" for step in sorted(rng.randint(1, 12) for _ in range(count)))


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["split"] == "train"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--hangs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_plan(tmp / "plan.json")
        configs = {}
        for name in ("full", "killed"):
            configs[name] = tmp / f"{name}.toml"
            configs[name].write_text(CONFIG.format(run=tmp / name, plan=tmp / "plan.json"))
        full_s, _ = timed_run(configs["full"])
        killed_s, lines = timed_run(configs["killed"], "--max-restarts", str(args.kills),
                                    env={"HYBRIDPAR_FAULTS": kills(args.kills, args.seed)})
        deaths = [t for t, line in lines if re.search(r"died.*restarting \(\d+ of", line)]
        resumed = [t for t, line in lines if re.match(r"restart \d+ of \d+: training from step", line)]
        restarts = [b - a for a, b in zip(deaths, resumed, strict=True)]
        same = losses(tmp / "full") == losses(tmp / "killed")
        for name in ("long", "hung"):
            configs[name] = tmp / f"{name}.toml"
            configs[name].write_text(CONFIG.format(run=tmp / name, plan=tmp / "plan.json").replace(
                "steps = 12", "steps = 200").replace("every = 1", "every = 10"))
        long_s, _ = timed_run(configs["long"])
        hangs = hung_run(configs["hung"], args.hangs, args.seed)
        same_hung = losses(tmp / "long") == losses(tmp / "hung")
    print(f"GPT tp=2 x pp=2 on 4 local workers ({os.cpu_count()} cores), 12 steps, a checkpoint every step\n")
    print("| run | wall s | kills | restart s (median, range) | cost per kill s | losses bitwise equal |")
    print("|---|---|---|---|---|---|")
    print(f"| uninterrupted | {full_s:.1f} | 0 | | | |")
    print(f"| killed | {killed_s:.1f} | {len(deaths)} | {statistics.median(restarts):.2f} ({min(restarts):.2f}-"
          f"{max(restarts):.2f}) | {(killed_s - full_s) / len(deaths):.2f} | {'yes' if same else 'NO'} |")
    print(f"\nThe same GPT, 200 steps, a checkpoint every 10; {len(hangs)} workers stopped by SIGSTOP (uninterrupted: "
          f"{long_s:.1f} s)\n")
    print("| hangs | found s (median, range) | training again s (median, range) | losses bitwise equal |")
    print("|---|---|---|---|")
    found, again = [h[0] for h in hangs], [h[1] for h in hangs]
    print(f"| {len(hangs)} | {statistics.median(found):.1f} ({min(found):.1f}-{max(found):.1f}) | "
          f"{statistics.median(again):.1f} ({min(again):.1f}-{max(again):.1f}) | {'yes' if same_hung else 'NO'} |")


if __name__ == "__main__":
    main()

"""A chaos run: CosmoFlow at dp=2 x spatial 2 on 4 local workers, trained once uninterrupted and once under a fault
every ``--every`` seconds, each drawn at random (each kind once in every five, in a shuffled order) from:

- **kill**: SIGKILL to a worker (a crashed process or node);
- **stop**: SIGSTOP to a worker (a frozen process: no exit, no error, its peers wait);
- **slow**: a worker three times slower for ``--slow-s`` seconds (SIGUSR2, armed by ``HYBRIDPAR_FAULTS``:
  ``slow@usr2x3for60``; a throttled device, a noisy neighbour);
- **stall**: a worker that stops sending but lives on, its heartbeat going (SIGUSR1: ``stall@usr1``; a link that
  drops its packets);
- **term**: SIGTERM to ``hybridpar train`` (a scheduler's preemption), then ``hybridpar train --resume``.

Failures come through ``HYBRIDPAR_FAULTS`` and signals only: the run recovers by itself (``--max-restarts``, the
watchdog, the automatic checkpoint interval from ``checkpoint.mtbf_hours``, set to the rate the faults come at);
the only help it gets is the ``--resume`` after a SIGTERM, as a job script gives it. A fault waits until the run
has trained again for ``--settle`` seconds since the one before (a fault during a restart would only lengthen
that restart, and faults that cost more than ``--every`` would leave the run no time to train).
Reported: the faults by kind, the restarts and hangs the run told, the wall time of both runs, goodput (the
uninterrupted run's wall time over the chaos run's: useful steps per second against a fault-free run), the time
each kind cost, and whether the final weights, Adam's moments and the losses are the uninterrupted run's, bit for
bit.

    python benchmarks/chaos.py                       # a 30-minute chaos run and its twin (about 45 minutes here)
    python benchmarks/chaos.py --minutes 3 --every 20 --json out.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
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

KINDS = ("kill", "stop", "slow", "stall", "term")
STEP_S = 0.26  # a step of this config with 4 workers on 2 cores, about: sizes the run to --minutes
GOODPUT = 0.5  # about what the chaos run keeps of its time with a fault every 30 s (measured): sizes it too
CONFIG = """run_dir = "{run}"
seed = 3
[model]
name = "cosmoflow"
base_channels = 2
fc_sizes = [8]
batch_norm = true
dropout = 0.25
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
log_every = 1
[validation]
every = 0
[checkpoint]
every = 0
keep = 2
mtbf_hours = {mtbf_hours}
"""


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl  # found before any fork: the child only calls it
_PR_SET_PDEATHSIG = 1


def _dies_with(parent: int):
    """For ``preexec_fn``: the child gets SIGKILL when ``parent`` (this script's main thread) ends, however it
    ends (a test's timeout kills this script with SIGKILL: its launcher, and the launcher's workers, end too)."""
    def arm() -> None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent ended before the signal was armed
            os._exit(1)
    return arm


class Launch:
    """One ``hybridpar train`` process: its output lines with their arrival times (``time.monotonic``)."""

    def __init__(self, config: Path, *flags: str, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-m", "hybridpar", "train", str(config), "--nproc", "4",
                                      *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True, preexec_fn=_dies_with(os.getpid()))
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip()))

    def wait(self) -> int:
        code = self.proc.wait()
        self.reader.join()
        return code

    def end(self) -> None:
        """SIGKILL to the launcher, if it runs on (this script stopped): its workers die with it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.wait()


def trained(run: Path) -> int:
    """The newest step ``metrics.jsonl`` records (0: none)."""
    try:
        with open(run / "metrics.jsonl", "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 2048))
            tail = f.read().decode(errors="replace").splitlines()[1:]
    except OSError:
        return 0
    steps = []
    for line in tail:
        try:
            steps.append(json.loads(line).get("step", 0))
        except ValueError:  # a line being written
            continue
    return max(steps, default=0)


def chaos(config: Path, run: Path, every: float, slow_s: int, settle: float, seed: int) -> dict:
    """Train ``config`` under a fault every ``every`` seconds until it finishes; what happened."""
    rng = random.Random(seed)
    env = dict(os.environ, OMP_NUM_THREADS="1", HYBRIDPAR_FAULTS=f"stall@usr1,slow@usr2x3for{slow_s}")
    flags = ("--max-restarts", "1000")
    start = time.monotonic()
    launch = Launch(config, *flags, env=env)
    launches, faults, lines = 1, [], []
    # again: when the run first logged a step after the last fault; moved: when it last logged one. A step logged
    # just after a fault may be the failing attempt's last, and a relaunch's metrics.jsonl shows the steps before
    # it until its set-up ends: a fault waits for steps logged since `again + settle` (the run trains now), or it
    # would land in a restart's set-up
    due, seen, bag, again, moved = start + every, 0, [], None, None
    try:
        while True:
            code = launch.proc.poll()
            if code is not None:
                launch.wait()
                lines += launch.lines
                if code == 143 and faults and faults[-1]["kind"] == "term":
                    launch = Launch(config, "--resume", *flags, env=env)
                    launches += 1
                    continue
                if code != 0:
                    raise SystemExit("the chaos run failed:\n" + "\n".join(line for _, line in lines[-40:]))
                break
            now = time.monotonic()
            step = trained(run)
            if step > seen:
                moved, again = now, again or now
            seen = step
            if now >= due and again is not None and moved > again + settle:
                pids = workers(launch.proc.pid)
                if len(pids) != 4:  # between attempts: the next fault waits for the next
                    time.sleep(0.1)
                    continue
                bag = bag or rng.sample(KINDS, len(KINDS))
                kind, pid = bag.pop(), rng.choice(pids)
                if kind == "term":
                    os.kill(launch.proc.pid, signal.SIGTERM)
                else:
                    os.kill(pid, {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "slow": signal.SIGUSR2,
                                  "stall": signal.SIGUSR1}[kind])
                faults.append(dict(kind=kind, at=now, step=step))
                due, again = now + every, None
            time.sleep(0.05)
    finally:  # this script stopped (Ctrl-C, a timeout): the run ends with it
        launch.end()
    return dict(wall_s=time.monotonic() - start, faults=faults, lines=lines, launches=launches, start=start)


def fault_free(config: Path) -> float:
    start = time.monotonic()
    launch = Launch(config, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        code = launch.wait()
    finally:
        launch.end()
    if code != 0:
        raise SystemExit("the uninterrupted run failed:\n" + "\n".join(line for _, line in launch.lines[-40:]))
    return time.monotonic() - start


def last_checkpoint(run: Path) -> dict:
    """Every tensor of the run's last checkpoint (weights, batch norm's statistics, Adam's moments)."""
    from hybridpar.parallel.checkpoint_files import read_tensors
    from hybridpar.train import checkpoint_dir

    return read_tensors(checkpoint_dir.checkpoints(run / "checkpoints")[-1][1])


def losses(run: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["step"], r["loss"]) for r in records if r.get("split") == "train"]


def costs(result: dict, step_s: float) -> dict[str, list[float]]:
    """Per kind, the seconds each fault cost: the steps it should have trained by the next fault (or the end) at the
    uninterrupted pace, less those it did, in seconds of that pace."""
    faults = result["faults"]
    out: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for fault, after in zip(faults, faults[1:] + [None], strict=True):
        end = after["at"] if after else result["start"] + result["wall_s"]
        done = (after["step"] if after else result["steps"]) - fault["step"]
        out[fault["kind"]].append(max(0.0, (end - fault["at"]) - done * step_s))
    return out


def told(lines: list[tuple[float, str]]) -> dict[str, int]:
    text = [line for _, line in lines]
    return dict(deaths=sum(" died" in line and "restarting (" in line for line in text),
                hangs=sum(line.startswith("hung:") for line in text),
                restarts=sum(line.startswith("restart ") and ": training from step" in line for line in text),
                tracebacks=sum("Traceback" in line for line in text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the chaos run trains, about")
    parser.add_argument("--every", type=float, default=30.0, help="seconds between faults")
    parser.add_argument("--slow-s", type=int, default=60, help="how long a slowed worker stays slow")
    parser.add_argument("--steps", type=int, default=0, help="steps to train (0: from --minutes)")
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds the run trains again after a fault before the next may come")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # ``timeout``: the runs end with this script
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for split, count, seed in (("train", 8, 1), ("val", 3, 2)):
            subprocess.run([sys.executable, "-m", "hybridpar", "data", "synth-cosmoflow", "--out", str(tmp / split),
                            "--num-samples", str(count), "--size", "32", "--seed", str(seed)], check=True,
                           capture_output=True)
        steps = args.steps or max(40, int(args.minutes * 60 * GOODPUT / STEP_S))
        mtbf_hours = 4 * args.every / 3600  # a fault every ``every`` seconds among 4 devices
        configs = {}
        for name in ("clean", "chaos"):
            configs[name] = tmp / f"{name}.toml"
            configs[name].write_text(CONFIG.format(run=tmp / name, data=tmp, steps=steps, mtbf_hours=mtbf_hours))
        clean_s = fault_free(configs["clean"])
        result = chaos(configs["chaos"], tmp / "chaos", args.every, args.slow_s, args.settle, args.seed)
        result["steps"] = steps
        expected, got = last_checkpoint(tmp / "clean"), last_checkpoint(tmp / "chaos")
        same = sorted(expected) == sorted(got) and all(torch.equal(got[k], v) for k, v in expected.items())
        same_losses = losses(tmp / "clean") == losses(tmp / "chaos")
    step_s = clean_s / steps
    per_kind = costs(result, step_s)
    counts = told(result["lines"])
    figures = dict(steps=steps, every_s=args.every, clean_s=clean_s, chaos_s=result["wall_s"],
                   goodput=clean_s / result["wall_s"], faults={k: len(v) for k, v in per_kind.items()},
                   cost_s={k: statistics.median(v) if v else None for k, v in per_kind.items()},
                   launches=result["launches"], **counts, weights_equal=same, losses_equal=same_losses,
                   cpus=os.cpu_count(), told=[line for _, line in result["lines"] if " died" in line
                                              or line.startswith(("hung:", "restart "))])
    print(f"CosmoFlow dp=2 x spatial 2, {steps} steps on 4 local workers ({os.cpu_count()} cores); a fault every "
          f"{args.every:.0f} s\n")
    print("| run | wall s | faults | launches | restarts told | hangs found | goodput | weights, moments, losses "
          "bitwise equal |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| uninterrupted | {clean_s:.0f} | 0 | 1 | | | | |")
    print(f"| chaos | {result['wall_s']:.0f} | {len(result['faults'])} | {result['launches']} | {counts['restarts']} | "
          f"{counts['hangs']} | {figures['goodput']:.0%} | {'yes' if same and same_losses else 'NO'} |")
    print("\n| fault | count | time lost s (median, range) |")
    print("|---|---|---|")
    for kind, lost in per_kind.items():
        span = f"{statistics.median(lost):.1f} ({min(lost):.1f}-{max(lost):.1f})" if lost else ""
        print(f"| {kind} | {len(lost)} | {span} |")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    if counts["tracebacks"]:
        print(f"\n{counts['tracebacks']} traceback(s) in the chaos run's output")


if __name__ == "__main__":
    main()

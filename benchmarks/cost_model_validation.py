"""The planner's cost model against measured runs: predicted and measured step time and per-rank peak
memory of every configuration this machine can run, side by side in one run.

Configurations: float32, Adam, one global batch of ``B = 4`` samples, on ``N`` = 1, 2 and 4 worker
processes, every ``dp x spatial grid`` with ``dp * prod(grid) = N`` (grids split depth first: ``2x1x1``,
``4x1x1``, ``2x2x1``), for a CosmoFlow-like regression net and a small 3D U-Net, each at two sample edges.

**Measured.** Each configuration runs twice in fresh workers (``hybridpar.launch.launch_local``, gloo on
127.0.0.1, ``OMP_NUM_THREADS = max(1, cores // N)``): once for time, as a training run would, and once
for memory, with ``MALLOC_MMAP_THRESHOLD_=65536`` (freed tensors go back to the OS, so the peak resident
set measures live tensors; it costs a page fault per fresh page, so it is not timed). Each worker builds
the mesh (``ParallelDims``, ``build_mesh``), the model from seed 0, converts it with
``hybridpar.spatial.parallelize`` when the grid splits, wraps it in DDP over ``dp x spatial``
(``data_parallel``) and takes Adam (``build_optimizer``), as ``hybridpar train`` does; its input is its
slab (``hybridpar.spatial.shard``) of its replica's ``B / dp`` random samples. A step is zero_grad,
forward, loss (CosmoFlow: MSE against a ``(B / dp, 4)`` target; U-Net: the distributed voxel-wise cross
entropy), backward, ``optimizer.step()``, started on all ranks together (a barrier, not timed). After
the warm-up steps the peak RSS is reset (``clear_refs``); step time = the median over timed steps of the
slowest rank's step; memory = the largest ``VmHWM`` over ranks after the timed steps (nothing subtracted).

**Predicted.** ``hybridpar calibrate --nproc N`` (the environment of the timing runs) describes this
machine as N devices; ``hybridpar.plan.validate`` prices each configuration's ``Plan`` on the model's
graph (``graph_of`` on the meta device) without halo overlap (CPU runs do not overlap halos), and
``search_plans`` (tp = pp = 1, no sharding, no checkpointing) ranks the configurations of each N.

**Targets.** Median |relative error| <= 10% for step time and for memory over all configurations; the
configuration the search ranks first measures within 10% of the fastest measured one, for every
(net, S, N).

Besides the main table it prints where the time goes (forward, backward and optimizer phases against the
predicted compute and exposed communication) and the memory (the resident set before the model, what
building the parallel model adds, what the warm-up steps leave behind and the step's own peak, against
the predicted reserve, model state, activations and workspace), so that a miss points at its term.

    python benchmarks/cost_model_validation.py --recalibrate --markdown out.md --json out.json   # ~25 min, 2 cores
    python benchmarks/cost_model_validation.py --quick     # CosmoFlow 32^3 on N = 1, 2 (quick calibration), ~1 min

Calibrations are kept in ``--cluster-dir`` (``cluster-N.toml``) and reused by later runs; pass
``--recalibrate`` for a measured run, so that they come from the same quiet machine and the same hybridpar.
The exit status is 1 when a target is missed (or a configuration failed), 0 when all three are met.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hybridpar import models, spatial
from hybridpar.launch import init_distributed, launch_local, shutdown_distributed
from hybridpar.mesh import ParallelDims, build_mesh
from hybridpar.parallel.data import data_parallel
from hybridpar.train.config import OptimizerConfig
from hybridpar.train.optim import build_optimizer

# The workers re-import this file (spawn), so its top level imports what a training worker imports (the
# hybridpar.train package comes with build_optimizer) and no more: the planner and rich are imported by
# the parent alone, inside functions, and stay out of the workers' resident set.

BATCH = 4  # global batch: dp in {1, 2, 4} divides it
PROCS = (1, 2, 4)
NETS = ("cosmoflow", "unet3d")
SIZES = (32, 64)
MEMORY_STEPS = 2  # timed steps of a memory run (its peak is the same every step)
TARGET = 0.10  # median |relative error|, and the first-ranked plan's distance to the fastest measured
MiB = 2**20
DEFAULT_DIR = Path("runs/cost_model_validation")


# -- the configurations ----------------------------------------------------------------------------


def build_net(net: str, size: int) -> torch.nn.Module:
    """The model of ``net`` for cubic samples of edge ``size``, weights from seed 0 (on the current device,
    the meta device included). Small widths, so that 4 samples of 64^3 take seconds a step here. The deepest
    volume is 4^3 at 32^3 (CosmoFlow, three poolings) or 8^3 (U-Net, depth 3): a 4-way split of a dim leaves
    every slab at least one row, as thick as the 3x3x3 halos (the planner's ``check_grid`` agrees)."""
    torch.manual_seed(0)
    if net == "cosmoflow":
        return models.cosmoflow(size=size, in_channels=4, base_channels=16, fc_sizes=(64, 32), num_blocks=3,
                                pooling="average", batch_norm=False)
    return models.unet3d(in_channels=1, num_classes=3, base_channels=8, depth=3, norm="instance")


def in_channels(net: str) -> int:
    return 4 if net == "cosmoflow" else 1


def strategies(num_procs: int) -> list[tuple[int, tuple[int, int, int]]]:
    """``(dp, grid)`` with ``dp * prod(grid) = num_procs``, grids splitting depth first."""
    grids = {1: [(1, 1, 1)], 2: [(2, 1, 1)], 4: [(4, 1, 1), (2, 2, 1)]}
    return [(dp, grid) for dp in sorted((d for d in (1, 2, 4) if num_procs % d == 0), reverse=True)
            for grid in grids[num_procs // dp]]


@dataclass(frozen=True)
class Config:
    net: str
    size: int  # edge S of the cubic sample
    dp: int
    grid: tuple[int, int, int]

    @property
    def num_procs(self) -> int:
        return self.dp * math.prod(self.grid)

    @property
    def split(self) -> bool:
        return math.prod(self.grid) > 1

    @property
    def strategy(self) -> str:
        parts = [f"dp={self.dp}"] if self.dp > 1 or not self.split else []
        return " x ".join(parts + (["spatial " + "x".join(map(str, self.grid))] if self.split else []))

    @property
    def group(self) -> tuple[str, int, int]:
        return self.net, self.size, self.num_procs


def configs(nets, sizes, procs) -> list[Config]:
    return [Config(net, size, dp, grid) for net in nets for size in sizes for n in procs
            for dp, grid in strategies(n)]


def threads_for(num_procs: int) -> int:
    return max(1, len(os.sched_getaffinity(0)) // num_procs)


def worker_env(num_procs: int, memory: bool = False) -> dict[str, str]:
    """The workers' environment: ``cores // N`` threads, and for a memory run ``MALLOC_MMAP_THRESHOLD_`` (freed
    tensors go back to the OS, so the peak resident set measures live tensors; a timing run leaves glibc
    its default, as a training run does, since a fresh mapping per tensor costs page faults every step)."""
    env = {"OMP_NUM_THREADS": str(threads_for(num_procs))}
    return env | {"MALLOC_MMAP_THRESHOLD_": "65536"} if memory else env


# -- one worker process ----------------------------------------------------------------------------


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> None:
    """Set VmHWM to the current resident set (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _batch(cfg: Config, mesh) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slab of its replica's ``B / dp`` samples, and the target (the same on the spatial group)."""
    per_replica = BATCH // cfg.dp
    torch.manual_seed(1 + mesh["dp"].get_local_rank())
    x = torch.randn(per_replica, in_channels(cfg.net), *(cfg.size,) * 3)  # x_NCDHW, the replica's samples
    if cfg.net == "cosmoflow":
        y = torch.rand(per_replica, 4) * 2 - 1  # the head's output is whole on every spatial rank
    else:
        y = torch.randint(0, 3, (per_replica, 1, *(cfg.size,) * 3))  # class per voxel, sliced like x
    if cfg.split:
        x = spatial.shard(x, mesh["spatial"], grid=cfg.grid)
        if cfg.net != "cosmoflow":
            y = spatial.shard(y, mesh["spatial"], grid=cfg.grid)
    return x, (y if cfg.net == "cosmoflow" else y.squeeze(1))  # U-Net target: (N, D, H, W)


def _loss(cfg: Config, mesh):
    if cfg.net == "cosmoflow":
        return spatial.mse_loss  # replicated output: the one-process loss on every spatial rank
    group = mesh["spatial"] if cfg.split else None
    return lambda out, y: spatial.cross_entropy(out, y, group)


def _step(model, optimizer, x, y, loss_fn) -> tuple[float, float, float]:
    """One training step, started on all ranks together: seconds of (zero_grad + forward + loss,
    backward with DDP's all-reduce, optimizer step)."""
    dist.barrier()
    t0 = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    optimizer.step()
    return t1 - t0, t2 - t1, time.perf_counter() - t2


def _measure(cfg: Config, num_warmup: int, num_steps: int) -> dict:
    baseline_kib = status_kib("VmRSS")  # imports and the process group, before the model
    dims = ParallelDims(dp=cfg.dp, spatial=cfg.grid)
    mesh = build_mesh(dims, dist.get_world_size())
    model = build_net(cfg.net, cfg.size)
    if cfg.split:
        model = spatial.parallelize(model, mesh["spatial"], grid=cfg.grid)
    model = data_parallel(model, mesh)
    optimizer = build_optimizer(model.parameters(), OptimizerConfig(name="adam"))
    x, y = _batch(cfg, mesh)
    loss_fn = _loss(cfg, mesh)
    model.train()
    built_kib = status_kib("VmRSS")  # + mesh, model, DDP, optimizer (no state yet), batch
    phases = []
    for step in range(num_warmup + num_steps):
        if step == num_warmup:
            steady_kib = status_kib("VmRSS")  # + optimizer state, gradients, what the first steps kept
            reset_peak_rss()
        phases.append(_step(model, optimizer, x, y, loss_fn))
    return {"phases": phases[num_warmup:], "peak_kib": status_kib("VmHWM"), "baseline_kib": baseline_kib,
            "built_kib": built_kib, "steady_kib": steady_kib, "threads": torch.get_num_threads()}


def worker(cfg: Config, num_warmup: int, num_steps: int) -> dict:
    """One rank of one configuration (``launch_local``'s entry point). An error ends the process without
    the closing barrier, so the launcher stops the other ranks instead of leaving them waiting."""
    init_distributed()
    result = _measure(cfg, num_warmup, num_steps)
    shutdown_distributed()
    return result


def _launch(cfg: Config, num_warmup: int, num_steps: int, memory: bool) -> list[dict]:
    os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
    os.environ.update(worker_env(cfg.num_procs, memory))
    ranks = launch_local(worker, (cfg, num_warmup, num_steps), cfg.num_procs)
    return [ranks[r] for r in sorted(ranks)]


def run_config(cfg: Config, num_warmup: int, num_steps: int) -> dict:
    """The measured row of ``cfg`` from two launches of fresh workers: a timing run (step time and phases:
    slowest rank per step, median over steps) and a memory run (peak and baseline memory, largest over
    ranks; ``worker_env``)."""
    ranks = _launch(cfg, num_warmup, num_steps, memory=False)
    steps = range(len(ranks[0]["phases"]))
    per_step = [max(sum(r["phases"][i]) for r in ranks) for i in steps]
    phase = [statistics.median(max(r["phases"][i][k] for r in ranks) for i in steps) for k in range(3)]
    timing, ranks = ranks, _launch(cfg, num_warmup, MEMORY_STEPS, memory=True)
    return {
        "step_s": statistics.median(per_step), "steps_s": per_step,
        "forward_s": phase[0], "backward_s": phase[1], "optimizer_s": phase[2],
        "peak_bytes": max(r["peak_kib"] for r in ranks) * 1024,
        "peak_bytes_per_rank": [r["peak_kib"] * 1024 for r in ranks],
        "baseline_bytes": max(r["baseline_kib"] for r in ranks) * 1024,
        # of the rank with the highest peak: what its resident set held before the model, after building
        # everything, and at the start of the timed steps
        "stages_bytes": [v * 1024 for v in max((r["peak_kib"], r["baseline_kib"], r["built_kib"], r["steady_kib"])
                                               for r in ranks)[1:]],
        "threads": timing[0]["threads"],
    }


# -- calibration and predictions (the parent) ------------------------------------------------------


def calibrate(cluster_dir: Path, procs, recalibrate: bool, quick: bool) -> dict[int, Path]:
    """``cluster-N.toml`` per N, measured by ``hybridpar calibrate`` in the runs' environment unless it
    exists already (and ``recalibrate`` is off)."""
    paths = {}
    for n in procs:
        path = cluster_dir / f"cluster-{n}.toml"
        if recalibrate or not path.exists():
            command = [sys.executable, "-m", "hybridpar", "calibrate", "--nproc", str(n), "--out", str(path),
                       "--overwrite"] + (["--quick"] if quick else [])
            start = time.perf_counter()
            env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"} | worker_env(n)
            subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
            log(f"calibrated N={n}{' (quick)' if quick else ''}: {path} ({time.perf_counter() - start:.0f} s)")
        paths[n] = path
    return paths


def graph(net: str, size: int):
    from hybridpar.plan import graph_of

    with torch.device("meta"):
        model = build_net(net, size)
    return graph_of(model, (1, in_channels(net), size, size, size))


def predict(cfg: Config, graph_, cluster):
    from hybridpar.plan import Plan, validate

    plan = Plan(dp=cfg.dp, spatial=cfg.grid, global_batch=BATCH, optimizer="adam", dtype="float32")
    return validate(plan, graph_, cluster, overlap_halo=False).prediction


def ranked(graph_, cluster) -> list:
    """The search's plans for all of ``cluster``'s devices, fastest first (tp = pp = 1, DDP, no checkpointing;
    halos not overlapped, as in ``predict``)."""
    from hybridpar.plan import search_plans

    return search_plans(graph_, None, cluster, global_batch=BATCH, tp=1, pp=1, sharding=(0,),
                        checkpointing=(False,), max_tp=1, overlap_halo=False).plans


def measured_match(plan, rows: list[dict]) -> tuple[dict | None, bool]:
    """The measured row of the search's plan: the same (dp, grid), or else a permutation of the grid (the
    samples are cubic and the nets isotropic, so a permuted grid costs the same); ``(row, exact)``."""
    for exact in (True, False):
        for row in rows:
            cfg = row["cfg"]
            grid = tuple(plan.spatial) + (1,) * (3 - len(plan.spatial))
            same = cfg.grid == grid if exact else sorted(cfg.grid) == sorted(grid)
            if cfg.dp == plan.dp and same:
                return row, exact
    return None, False


def rank_groups(rows: list[dict], searches: dict) -> list[dict]:
    """Per (net, S, N): the first-ranked plan's measured time against the fastest measured (``searches``
    maps each to the search's plans, or to why the search failed)."""
    out = []
    for key, plans in searches.items():
        mine = [r for r in rows if r["cfg"].group == key and "step_s" in r]
        if isinstance(plans, str):
            out.append({"group": key, "ok": False, "why": plans})
            continue
        if not mine or not plans:
            out.append({"group": key, "ok": False, "why": "no measurement" if plans else "no plan fits"})
            continue
        fastest = min(mine, key=lambda r: r["step_s"])
        row, exact = measured_match(plans[0], mine)
        if row is None:
            out.append({"group": key, "ok": False, "first": plans[0].describe(),
                        "why": "the first-ranked plan was not measured"})
            continue
        ratio = row["step_s"] / fastest["step_s"]
        out.append({"group": key, "first": plans[0].describe(), "first_cfg": row["cfg"].strategy, "exact": exact,
                    "first_s": row["step_s"], "fastest": fastest["cfg"].strategy, "fastest_s": fastest["step_s"],
                    "ratio": ratio, "ok": ratio <= 1 + TARGET,
                    "ranking": [(p.describe(), p.prediction.step_time) for p in plans]})
    return out


# -- report ------------------------------------------------------------------------------------------


def rel(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def summary(rows: list[dict], groups: list[dict]) -> dict:
    done = [r for r in rows if "step_s" in r]
    time_err = [abs(rel(r["pred"].step_time, r["step_s"])) for r in done]
    mem_err = [abs(rel(r["pred"].memory["total"], r["peak_bytes"])) for r in done]
    failed = len(rows) - len(done)
    return {
        "time_median": statistics.median(time_err) if time_err else math.inf,
        "memory_median": statistics.median(mem_err) if mem_err else math.inf,
        "ranking_ok": sum(g["ok"] for g in groups), "ranking_groups": len(groups), "failed": failed,
    }


def verdicts(s: dict) -> list[tuple[str, bool]]:
    complete = s["failed"] == 0
    return [
        (f"step time: median |error| {s['time_median']:.1%} (target <= {TARGET:.0%})",
         complete and s["time_median"] <= TARGET),
        (f"peak memory: median |error| {s['memory_median']:.1%} (target <= {TARGET:.0%})",
         complete and s["memory_median"] <= TARGET),
        (f"first-ranked plan within {TARGET:.0%} of the fastest measured: {s['ranking_ok']} of "
         f"{s['ranking_groups']} (net, S, N)", complete and s["ranking_ok"] == s["ranking_groups"]),
    ]


MAIN_COLUMNS = ("net", "S", "N", "strategy", "measured ms", "predicted ms", "error %", "measured MiB",
                "predicted MiB", "error %")
KEY = ("net", "S", "N", "strategy")
TIME_COLUMNS = KEY + ("fwd + loss ms", "bwd ms", "opt ms", "pred compute ms", "pred exposed comm ms")
MEMORY_COLUMNS = KEY + ("baseline", "pred reserved", "setup", "first steps kept", "step peak", "pred state",
                        "pred activations", "pred workspace")
def _key(cfg: Config) -> list[str]:
    return [cfg.net, str(cfg.size), str(cfg.num_procs), cfg.strategy]


def main_cells(r: dict) -> list[str]:
    cfg = r["cfg"]
    head = _key(cfg)
    if "step_s" not in r:
        return head + ["failed"] + [""] * 5
    p = r["pred"]
    return head + [f"{r['step_s'] * 1e3:.1f}", f"{p.step_time * 1e3:.1f}", f"{rel(p.step_time, r['step_s']):+.1%}",
                   f"{r['peak_bytes'] / MiB:.0f}", f"{p.memory['total'] / MiB:.0f}",
                   f"{rel(p.memory['total'], r['peak_bytes']):+.1%}"]


def time_cells(r: dict) -> list[str]:
    p = r["pred"]
    comm = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in p.communication.items()) or "0"
    return _key(r["cfg"]) + [f"{r['forward_s'] * 1e3:.1f}", f"{r['backward_s'] * 1e3:.1f}",
                             f"{r['optimizer_s'] * 1e3:.1f}", f"{p.compute_time * 1e3:.1f}", comm]


def memory_cells(r: dict) -> list[str]:
    m = r["pred"].memory
    baseline, built, steady = r["stages_bytes"]
    state = m["parameters"] + m["gradients"] + m["optimizer"]
    values = (baseline, m["reserved"], built - baseline, steady - built, r["peak_bytes"] - steady, state,
              m["activations"], m["workspace"])
    return _key(r["cfg"]) + [f"{v / MiB:.0f}" if v >= 10 * MiB else f"{v / MiB:.1f}" for v in values]


MEASURED = "step_s"
TABLES = (  # (title, columns, cells of one row, which rows)
    ("Cost model vs measured", MAIN_COLUMNS, main_cells, lambda r: True),
    ("Time: measured phases (slowest rank, median over steps), predicted terms", TIME_COLUMNS, time_cells,
     lambda r: MEASURED in r),
    ("Memory, MiB (the rank with the highest peak): resident set before the model (baseline), then added by "
     "building mesh, model, DDP, optimizer and batch (setup), by the warm-up steps (first steps kept) and by "
     "the timed steps at their peak (step peak); predicted terms", MEMORY_COLUMNS, memory_cells,
     lambda r: MEASURED in r),
)


def group_line(g: dict) -> str:
    net, size, n = g["group"]
    where = f"{net} {size}^3 N={n}"
    if "ratio" not in g:
        return f"{where}: {g['why']}{' (' + g['first'] + ')' if 'first' in g else ''}"
    same = "" if g["exact"] else f" (measured as the equivalent {g['first_cfg']})"
    return (f"{where}: search ranks {g['first']} first{same}: {g['first_s'] * 1e3:.1f} ms measured; fastest measured "
            f"{g['fastest']} {g['fastest_s'] * 1e3:.1f} ms; ratio {g['ratio']:.3f} "
            f"({'within' if g['ok'] else 'NOT within'} {TARGET:.0%})")


def header(args, meta: dict) -> list[str]:
    return [
        f"Command: `{meta['command']}`",
        f"Machine: {meta['cores']} CPU cores ({meta['cpu']}), torch {torch.__version__}, gloo on 127.0.0.1; "
        f"1-minute load average {meta['load_before']:.1f} before, {meta['load_after']:.1f} after; "
        f"run time {meta['run_s'] / 60:.1f} min.",
        f"Global batch {BATCH}, float32, Adam; {args.warmup} warm-up + {args.steps} timed steps per configuration; "
        "step time = slowest rank, median over timed steps; memory = largest VmHWM over ranks (reset after "
        "warm-up). Predictions: `hybridpar.plan.validate(..., overlap_halo=False)` with:",
        *meta["calibrations"],
    ]


def calibration_line(n: int, path: Path, cluster) -> str:
    """What the prediction for N workers rests on: the calibration's date and its main numbers."""
    first = Path(path).read_text().splitlines()[0]
    when = first.rsplit(" on ", 1)[-1].rstrip(":") if first.startswith("#") else "?"
    return (f"- N={n}: `{path}` ({when}): matmul {cluster.peak_flops['float32'] / 1e9:.1f} GFLOP/s, "
            f"efficiency.conv {cluster.efficiency['conv']:.2f}, memory {cluster.memory_bandwidth / 1e9:.2f} GB/s, "
            f"point-to-point latency {cluster.intra_node.latency * 1e6:.0f} us, reserved "
            f"{cluster.reserved_memory / MiB:.0f} MiB")


def print_report(args, meta, rows, groups, s) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(200, Console().width))
    console.print("\n".join(header(args, meta)), highlight=False)
    for title, columns, cells, keep in TABLES:
        table = Table(*columns, title=title)
        for r in filter(keep, rows):
            table.add_row(*cells(r))
        console.print(table)
    for r in (r for r in rows if "error" in r):
        console.print(f"[red]failed[/]: {r['cfg']}: {r['error']}", highlight=False)
    for g in groups:
        console.print(group_line(g), highlight=False, style=None if g["ok"] else "red")
    for text, ok in verdicts(s):
        console.print(f"{'[green]PASS[/]' if ok else '[red]FAIL[/]'} {text}", highlight=False)


def markdown(args, meta, rows, groups, s) -> str:
    def table(columns, cells):
        return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + \
               ["| " + " | ".join(c) + " |" for c in cells]

    date = meta["date"]
    lines = [f"### Cost model validation, {date}", "", *[line + "  " for line in header(args, meta)], ""]
    for title, columns, cells, keep in TABLES:
        lines += [f"{title}:", ""] + table(columns, [cells(r) for r in filter(keep, rows)]) + [""]
    lines += [f"- failed: {r['cfg'].net} {r['cfg'].size}^3 N={r['cfg'].num_procs} {r['cfg'].strategy}: "
              f"{r['error'].splitlines()[0]}" for r in rows if "error" in r]
    lines += [f"- {group_line(g)}" for g in groups] + [""]
    lines += [f"- **{'PASS' if ok else 'FAIL'}** {text}" for text, ok in verdicts(s)]
    return "\n".join(lines) + "\n"


def to_json(args, meta, rows, groups, s) -> dict:
    def row(r):
        out = {k: v for k, v in r.items() if k not in ("cfg", "pred")}
        out["config"] = {**asdict(r["cfg"]), "num_procs": r["cfg"].num_procs, "strategy": r["cfg"].strategy}
        out["prediction"] = asdict(r["pred"]) if r.get("pred") else None
        return out

    clusters = {n: {"path": str(p), "toml": Path(p).read_text()} for n, p in meta["clusters"].items()}
    return {"meta": {**meta, "clusters": clusters, "args": vars(args)}, "rows": [row(r) for r in rows],
            "ranking": [{**g, "group": list(g["group"])} for g in groups], "summary": s}


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- main --------------------------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--nets", nargs="+", choices=NETS, default=list(NETS))
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="sample edges S")
    parser.add_argument("--procs", type=int, nargs="+", choices=PROCS, default=list(PROCS),
                        help="worker process counts N")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration (K)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: cosmoflow, 32^3, N in {1, 2}, quick calibrations in their own folder")
    parser.add_argument("--cluster-dir", type=Path, default=None,
                        help=f"where cluster-N.toml live and are reused (default {DEFAULT_DIR}/clusters)")
    parser.add_argument("--recalibrate", action="store_true", help="run hybridpar calibrate even if the file exists")
    parser.add_argument("--markdown", type=Path, help="write the tables and verdicts as Markdown to this file")
    parser.add_argument("--json", type=Path, help="write the raw numbers as JSON to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.nets, args.sizes, args.procs = ["cosmoflow"], [32], [1, 2]
    args.cluster_dir = args.cluster_dir or DEFAULT_DIR / ("clusters-quick" if args.quick else "clusters")
    bad = [s for s in args.sizes if s % 32]
    if bad or args.steps < 1 or args.warmup < 1:
        parser.error(f"sizes must be multiples of 32 (got {bad}); --steps and --warmup at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    from hybridpar.plan.io import load_cluster

    args = parse_args(argv)
    begin, load_before = time.perf_counter(), os.getloadavg()[0]
    paths = calibrate(args.cluster_dir, sorted(set(args.procs)), args.recalibrate, args.quick)
    clusters = {n: load_cluster(p) for n, p in paths.items()}
    todo = configs(args.nets, args.sizes, sorted(set(args.procs)))
    graphs = {(net, size): graph(net, size) for net in args.nets for size in args.sizes}
    rows, searches = [], {}
    for i, cfg in enumerate(todo):
        g, cluster = graphs[cfg.net, cfg.size], clusters[cfg.num_procs]
        if cfg.group not in searches:
            try:
                searches[cfg.group] = ranked(g, cluster)
            except Exception as err:  # noqa: BLE001 - reported in the ranking lines
                searches[cfg.group] = f"the search failed: {type(err).__name__}: {err}"
        start = time.perf_counter()
        row = {"cfg": cfg, "pred": None}
        try:
            row["pred"] = predict(cfg, g, cluster)
            row |= run_config(cfg, args.warmup, args.steps)
        except Exception as err:  # noqa: BLE001 - a failed configuration is reported, the others still run
            row["error"] = f"{type(err).__name__}: {err}"
        rows.append(row)
        log(f"[{i + 1}/{len(todo)}] {cfg.net} {cfg.size}^3 N={cfg.num_procs} {cfg.strategy}: "
             f"{time.perf_counter() - start:.0f} s{' FAILED' if 'error' in row else ''}")
    groups = rank_groups(rows, searches)
    s = summary(rows, groups)
    meta = {"date": datetime.date.today().isoformat(), "command": " ".join(["python"] + sys.argv),
            "cores": len(os.sched_getaffinity(0)), "cpu": platform.processor() or platform.machine(),
            "load_before": load_before, "load_after": os.getloadavg()[0], "run_s": time.perf_counter() - begin,
            "clusters": {n: str(p) for n, p in paths.items()},
            "calibrations": [calibration_line(n, p, clusters[n]) for n, p in paths.items()]}
    print_report(args, meta, rows, groups, s)
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(markdown(args, meta, rows, groups, s))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(to_json(args, meta, rows, groups, s), indent=1, default=str))
    return 0 if all(ok for _, ok in verdicts(s)) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Tokens per second and per-rank peak memory of a GPT under every plan that runs on 4 local processes, side
by side with plain DDP, and the planner's prediction next to each measurement.

The model: ``hybridpar.models.gpt`` with 4 blocks of width 256 (8 heads), 128 tokens, a vocabulary of 4,096
(5.3 M parameters), float32, Adam, a global batch of 8 sequences. Each plan runs through
``hybridpar.parallelize`` as a user's job would, in fresh workers (``launch_local``, gloo on 127.0.0.1,
``OMP_NUM_THREADS = cores // 4``), twice: a timing run (step = zero_grad, ``train_step``, ``optimizer.step``,
started together after a barrier; the slowest rank's step, median over the timed steps) and a memory run
with ``MALLOC_MMAP_THRESHOLD_`` (the largest ``VmHWM`` over ranks, reset after the warm-up). Tokens per
second = global batch x 128 / step time.

Predictions: ``hybridpar.plan.validate`` of the same plan on the model's graph with the calibration of 4
workers that ``benchmarks/cost_model_validation.py`` keeps (``hybridpar calibrate --nproc 4`` if it is
missing). ``searched`` is the plan ``search_plans`` ranks first for this machine.

    python benchmarks/transformer.py --markdown out.md     # ~6 min on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from cost_model_validation import DEFAULT_DIR, calibrate, log, rel, reset_peak_rss, status_kib, worker_env  # noqa: E402

from hybridpar import parallelize  # noqa: E402
from hybridpar.ir.types import Plan  # noqa: E402
from hybridpar.launch import init_distributed, launch_local, shutdown_distributed  # noqa: E402
from hybridpar.models.gpt import gpt, lm_loss  # noqa: E402

MODEL = dict(vocab_size=4096, seq_len=128, num_layers=4, num_heads=8, d_model=256)
BATCH, PROCS, MiB = 8, 4, 2**20
PP2 = ("blocks.2.ln_1",)
PP4 = ("blocks.1.ln_1", "blocks.2.ln_1", "blocks.3.ln_1")
PLANS = {  # name: plan fields (tp > 1: the layers pair_strategies finds)
    "ddp": dict(dp=4),
    "zero2": dict(dp=4, sharding=2),
    "fsdp": dict(dp=4, sharding=3),
    "tp4": dict(tp=4),
    "dp2-tp2": dict(dp=2, tp=2),
    "fsdp2-tp2": dict(dp=2, tp=2, sharding=3),
    "pp4-1f1b": dict(pp=4, stages=PP4, micro_batches=8),
    "pp4-gpipe": dict(pp=4, stages=PP4, micro_batches=8, schedule="gpipe"),
    "dp2-pp2": dict(dp=2, pp=2, stages=PP2, micro_batches=4),
    "dp2-pp2-interleaved": dict(dp=2, pp=2, stages=PP4, micro_batches=4, schedule="interleaved-1f1b"),
    "fsdp2-pp2": dict(dp=2, pp=2, stages=PP2, micro_batches=4, sharding=3),
    "tp2-pp2": dict(tp=2, pp=2, stages=PP2, micro_batches=4),
    "tp4-sequence": dict(tp=4, sequence_parallel=True),
    "dp2-tp2-sequence": dict(dp=2, tp=2, sequence_parallel=True),
}


def tokens(plan: Plan, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    per = BATCH // plan.dp
    g = torch.Generator().manual_seed(1 + replica)
    window = torch.randint(0, MODEL["vocab_size"], (per, MODEL["seq_len"] + 1), generator=g)
    return window[:, :-1], window[:, 1:]


def analysed():
    """The model on the meta device and its layer graph (the parent's planning; the workers build their own)."""
    from hybridpar.plan import graph_of

    with torch.device("meta"):
        model = gpt(**MODEL)
    return model, graph_of(model, torch.zeros(BATCH, MODEL["seq_len"], dtype=torch.long))


def make_plan(fields: dict, model, graph) -> Plan:
    from hybridpar.parallel.tensor import pair_strategies

    layers = tuple(pair_strategies(graph, tp=fields["tp"]).items()) if fields.get("tp", 1) > 1 else ()
    return Plan(global_batch=BATCH, input_shape=(BATCH, MODEL["seq_len"]), layers=layers, **fields)


# -- one worker process ----------------------------------------------------------------------------


def worker(plan: Plan, num_warmup: int, num_steps: int) -> dict:
    init_distributed()
    torch.manual_seed(0)
    model = gpt(**MODEL)
    parallel = parallelize(model, plan, loss_fn=lm_loss)
    optimizer = torch.optim.Adam(parallel.parameters(), lr=1e-4)
    x, y = tokens(plan, parallel.mesh["dp"].get_local_rank())
    times = []
    for step in range(num_warmup + num_steps):
        if step == num_warmup:
            reset_peak_rss()
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = parallel.train_step(x, y)
        optimizer.step()
        times.append(time.perf_counter() - start)
    result = {"times": times[num_warmup:], "peak_kib": status_kib("VmHWM"), "loss": loss.item()}
    shutdown_distributed()
    return result


def run(plan: Plan, num_warmup: int, num_steps: int) -> dict:
    """Step time (slowest rank, median over steps) from a timing run, peak memory from a memory run."""
    rows = {}
    for memory in (False, True):
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        os.environ.update(worker_env(PROCS, memory))
        ranks = launch_local(worker, (plan, num_warmup, 2 if memory else num_steps), PROCS)
        rows[memory] = [ranks[r] for r in sorted(ranks)]
    timing = rows[False]
    per_step = [max(r["times"][i] for r in timing) for i in range(len(timing[0]["times"]))]
    return {"step_s": statistics.median(per_step), "peak_bytes": max(r["peak_kib"] for r in rows[True]) * 1024,
            "loss": timing[-1]["loss"]}


# -- the parent ------------------------------------------------------------------------------------


def predictions(plans: dict[str, Plan], graph, cluster) -> dict:
    from hybridpar.plan import validate

    return {name: validate(dataclasses.replace(plan, prediction=None), graph, cluster).prediction
            for name, plan in plans.items()}


def table(rows: dict, base: str) -> list[str]:
    lines = [f"| plan | tokens/s | vs {base} | predicted tokens/s | error | peak MiB/rank | predicted MiB | error |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    base_s = rows[base]["step_s"]
    for name, r in rows.items():
        if "error" in r:
            lines.append(f"| {name} ({r['plan'].describe()}) | failed: {r['error']} |||||||")
            continue
        p = r["pred"]
        tps, ptps = BATCH * MODEL["seq_len"] / r["step_s"], BATCH * MODEL["seq_len"] / p.step_time
        lines.append(f"| {name} ({r['plan'].describe()}) | {tps:,.0f} | {base_s / r['step_s']:.2f}x | {ptps:,.0f} | "
                     f"{rel(p.step_time, r['step_s']):+.0%} | {r['peak_bytes'] / MiB:.0f} | "
                     f"{p.memory['total'] / MiB:.0f} | {rel(p.memory['total'], r['peak_bytes']):+.0%} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    from hybridpar.plan.io import load_cluster

    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per plan")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--plans", nargs="+", choices=list(PLANS) + ["searched"], default=list(PLANS) + ["searched"])
    parser.add_argument("--cluster-dir", type=Path, default=DEFAULT_DIR / "clusters")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    begin = time.perf_counter()
    cluster = load_cluster(calibrate(args.cluster_dir, [PROCS], False, False)[PROCS])
    from hybridpar.plan import search_plans

    model, graph = analysed()
    plans = {name: make_plan(PLANS[name], model, graph) for name in args.plans if name != "searched"}
    if "searched" in args.plans:
        plans["searched"] = search_plans(graph, None, cluster).plans[0]
    predicted = predictions(plans, graph, cluster)
    rows = {}
    for name, plan in plans.items():
        start = time.perf_counter()
        rows[name] = {"plan": plan, "pred": predicted[name]}
        try:
            rows[name] |= run(plan, args.warmup, args.steps)
        except Exception as err:  # noqa: BLE001 - a failed plan is reported, the others still run
            rows[name]["error"] = f"{type(err).__name__}: {err}"
        log(f"{name} ({plan.describe()}): {time.perf_counter() - start:.0f} s")
    lines = [f"`python benchmarks/transformer.py` on {datetime.date.today()}, {os.cpu_count()} cores, torch "
             f"{torch.__version__}: GPT {MODEL}, global batch {BATCH}, float32, Adam, {PROCS} processes; "
             f"{args.warmup} warm-up + {args.steps} timed steps; "
             f"run time {(time.perf_counter() - begin) / 60:.1f} min.",
             "", *table(rows, next(iter(rows)))]
    print("\n".join(lines))
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")
    return 1 if any("error" in r for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())

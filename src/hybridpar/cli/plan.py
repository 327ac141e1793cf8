"""``hybridpar plan``: the best plans for a model on a cluster, as a table or JSON, and the best one to a file."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hybridpar.cli.args import (
    CLUSTER_HELP,
    DTYPES,
    add_model_arguments,
    integers,
    levels,
    non_negative,
    output_file,
    positive,
)
from hybridpar.errors import HybridparError
from hybridpar.plan.cluster import GiB


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="the fastest ways to run a model on a cluster, predicted (no GPUs needed)")
    add_model_arguments(p, "1x4x512x512x512")
    p.add_argument("--cluster", required=True, help=CLUSTER_HELP)
    p.add_argument("--devices", type=positive, default=None, help="devices in all (default: the cluster file's)")
    p.add_argument("--batch", type=positive, default=None, help="global batch (default: the input's batch)")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--optimizer", default="adam", choices=("adam", "adamw", "sgd"))
    for axis in ("dp", "tp", "pp"):
        p.add_argument(f"--{axis}", type=positive, default=None, help=f"fix the {axis} degree")
    p.add_argument("--spatial", default=None, help="fix the spatial grid, e.g. 4,2,1")
    p.add_argument("--sharding", type=levels, default=(0, 1, 2, 3), help="ZeRO levels to consider (default 0,1,2,3)")
    p.add_argument("--no-checkpointing", action="store_true", help="never recompute activations")
    p.add_argument("--top", type=positive, default=5, help="plans to show (default 5)")
    p.add_argument("--out", default=None, help="write the best plan as JSON to this file")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--format", choices=("table", "json"), default="table", help="table (default) or json")
    p.add_argument("--verify", type=non_negative, nargs="?", const=3, default=0, metavar="N",
                   help="run one float64 step of the best N plans (default 3) on --devices local processes against "
                        "one process, on a random batch, and compare every tensor (hybridpar verify)")


def run(args, console: Console) -> int:
    from hybridpar.models.registry import build_for_planning
    from hybridpar.plan import cluster_of, graph_of, no_fit_message, search_plans
    from hybridpar.plan.space import Constraints

    if args.out:
        output_file(args.out, args.overwrite, "plan.json")
    spec = cluster_of(args.cluster)
    spec = spec.with_devices(args.devices) if args.devices else spec
    spec.check_dtype(args.dtype)  # what the cluster file can tell, before the model is analysed
    model, example = build_for_planning(args.model, args.input, args.input_dtype)
    start = time.perf_counter()
    graph = graph_of(model, example, args.dtype)
    analysed = time.perf_counter()
    constraints = dict(optimizer=args.optimizer, dp=args.dp, tp=args.tp, pp=args.pp, sharding=args.sharding,
                       spatial=_grid(args.spatial, graph), top=args.top,
                       checkpointing=(False,) if args.no_checkpointing else (False, True))
    result = search_plans(graph, None, spec, global_batch=args.batch, dtype=args.dtype, **constraints)
    searched = time.perf_counter()
    if not result.plans:
        c = Constraints(global_batch=args.batch or graph.batch, dtype=args.dtype, **constraints)
        raise HybridparError(no_fit_message(graph, spec.reference(args.dtype) if hasattr(spec, "groups") else spec,
                                            c, result))
    plans = [replace(p, model=args.model) for p in result.plans]
    if args.out:
        Path(args.out).write_text(plans[0].to_json() + "\n")
    if args.format == "json":
        print(json.dumps({"plans": [p.to_dict() for p in plans], "rejected": result.rejected}, indent=2))
        return 0
    console.print(_summary(args, graph, spec, result, analysed - start, searched - analysed), highlight=False,
                  soft_wrap=True)
    console.print(_plans_table(result.plans))
    if result.sized:
        best = result.sized[0]
        even, sized = best.even.prediction.step_time, best.plan.prediction.step_time
        console.print(f"{best.plan.describe()} is sized to the devices: {sized * 1e3:.4g} ms per step, against "
                      f"{even * 1e3:.4g} ms split evenly ({even / sized:.2f}x)", highlight=False, soft_wrap=True)
        console.print(_sized_table(best))
    console.print(_losers_table(result))
    if args.out:
        console.print(f"best plan written to {args.out} (use it with plan = \"{args.out}\" in a training config)")
    return _verify(args, plans[:args.verify], graph, console) if args.verify else 0


VERIFY_MAX_PROCESSES = 16  # what one machine runs as local processes


def _verify(args, plans, graph, console: Console) -> int:
    """``--verify``: each plan run against one process on local processes, on a random batch (token ids and next
    tokens for a model of token ids with (B, T, vocab) logits and a cross entropy, else normal volumes and an MSE)."""
    import torch
    import torch.nn.functional as F

    from hybridpar.cli.verify import show, verify_locally
    from hybridpar.models.gpt import lm_loss
    from hybridpar.models.registry import build_for_planning

    if plans[0].world_size > VERIFY_MAX_PROCESSES:
        raise HybridparError(f"--verify runs a plan on {plans[0].world_size} local processes; use --devices "
                             f"{VERIFY_MAX_PROCESSES} or fewer (and a small --input) to verify plans here")
    failed = 0
    for plan in plans:
        torch.manual_seed(0)
        model, example = build_for_planning(args.model, args.input, args.input_dtype, device="cpu")
        shape = (plan.global_batch,) + tuple(example.shape[1:])
        g = torch.Generator().manual_seed(1)
        output = graph.output[0] if graph.output else ()
        if not example.is_floating_point() and len(output) == 3:
            vocab = output[-1]
            batch = (torch.randint(0, vocab, shape, generator=g), torch.randint(0, vocab, shape, generator=g))
            loss_fn = lm_loss
        else:
            x = torch.randn(shape, generator=g) if example.is_floating_point() else \
                torch.randint(0, 2, shape, generator=g)
            batch = (x, torch.randn((plan.global_batch,) + tuple(output[1:]), generator=g))
            loss_fn = F.mse_loss
        console.print(f"verifying {plan.describe()} on {plan.world_size} local processes", highlight=False)
        failed += show(verify_locally(model, plan, batch, loss_fn), console, top=3)
    return 1 if failed else 0


def _grid(text: str | None, graph) -> tuple[int, ...] | None:
    if text is None:
        return None
    grid = integers(text)
    if len(grid) != graph.spatial_ndim or min(grid, default=0) < 1:
        raise HybridparError(f"--spatial {text!r}: give {graph.spatial_ndim} part counts >= 1 separated by commas "
                             f"(one per spatial dim of the input {graph.input_shape})")
    return grid


def _summary(args, graph, spec, result, analyse_s: float, search_s: float) -> str:
    flops = graph.flops / graph.batch
    return (f"[bold]{args.model}[/]: {len(graph.layers)} layers, {graph.num_params / 1e6:,.1f} M parameters, "
            f"{flops / 1e12:.3g} TFLOP forward per sample; {spec.num_devices} x {spec.name} "
            f"({spec.device_memory / GiB:.3g} GiB each); global batch {result.plans[0].global_batch}, "
            f"{args.dtype}; {result.num_candidates} candidates searched in {search_s:.2f} s "
            f"(analysis {analyse_s:.2f} s)")


SHORT = {"activations": "act", "workspace": "work", "reserved": "rsv", "parameters": "par", "gradients": "grad",
         "optimizer": "opt", "pipeline": "pipe", "spatial": "norm"}


def _largest(values: dict[str, float], scale: float, names: dict[str, str] | None = None, count: int = 4) -> str:
    """The largest ``count`` entries, e.g. ``act 1.65 · rsv 2``, in units of ``1 / scale``."""
    items = sorted(((k, v) for k, v in values.items() if v > 0), key=lambda kv: -kv[1])[:count]
    return ", ".join(f"{(names or {}).get(k, k)} {v * scale:.3g}" for k, v in items) or "-"


def _plans_table(plans) -> Table:
    table = Table("#", "plan", "ms/step", "samples/s", "GiB", "of which (GiB)", "exposed comm. (ms)",
                  title="best plans (time per step, memory per device)")
    table.columns[1].no_wrap = True
    for rank, p in enumerate(plans, 1):
        pred = p.prediction
        memory = {k: v for k, v in pred.memory.items() if k != "total"}
        table.add_row(str(rank), p.describe(), f"{pred.step_time * 1e3:.4g}", f"{pred.samples_per_second:.4g}",
                      f"{pred.memory['total'] / GiB:.3g}", _largest(memory, 1 / GiB, SHORT, 3),
                      _largest(pred.communication, 1e3, SHORT, 3))
    return table


def _sized_table(sized) -> Table:
    """How a plan on a mixed cluster shares the work: each kind of device's speed (the cost model's) and the largest
    work of one of its devices, even and sized (1: an even share)."""
    table = Table("devices", "count", "speed", "work (even)", "work (sized)", title="work per device")
    for name, count, speed, work_even, work_sized in sized.rows:
        table.add_row(name, str(count), f"{speed:.2f}", f"{work_even:.2f}", f"{work_sized:.2f}")
    return table


def _losers_table(result) -> Table:
    from hybridpar.plan.space import family

    table = Table("strategies", "best of them, or why they lose", title="the other strategies")
    winner = family(result.plans[0].dims)
    for name, why in result.rejected.items():
        if name != winner:
            table.add_row(name, why)
    return table

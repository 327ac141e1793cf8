"""``hybridpar simulate``: predicted weak or strong scaling of a model over device counts, as a table (or
JSON) and a PNG figure."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from hybridpar.cli.args import CLUSTER_HELP, DTYPES, add_model_arguments, device_counts, output_file

DEFAULT_OUT = "scaling.png"


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="predicted weak or strong scaling over device counts: table and PNG "
                                        "(no GPUs needed)")
    add_model_arguments(p, "1x4x128x128x128")
    p.add_argument("--cluster", required=True, help=CLUSTER_HELP)
    p.add_argument("--devices", required=True, help="device counts: 8,16,32 or 8:4096 (doubling)")
    p.add_argument("--mode", choices=("weak", "strong"), required=True,
                   help="weak: the global batch grows with the devices (--batch at the smallest count); "
                        "strong: --batch at every count")
    p.add_argument("--batch", type=int, required=True, help="global batch (weak: at the smallest device count)")
    p.add_argument("--families", default=None,
                   help="strategy families separated by commas, e.g. \"dp,dp x spatial\" (default: dp and "
                        "dp x spatial for a volume; dp, dp x tp and dp x tp x pp for tokens)")
    p.add_argument("--dtype", default="float32", choices=DTYPES)
    p.add_argument("--out", default=None, help=f"the PNG to write (default {DEFAULT_OUT} with --format table; "
                                               "none with --format json unless given)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--format", choices=("table", "json"), default="table", help="table (default) or json")


def run(args, console: Console) -> int:
    from hybridpar.models.registry import build_for_planning
    from hybridpar.plan import cluster_of, graph_of
    from hybridpar.simulate import plot, scaling

    counts = device_counts(args.devices)
    out = _output(args)
    families = tuple(f for f in args.families.split(",") if f.strip()) if args.families else None
    spec = cluster_of(args.cluster)
    spec.check_dtype(args.dtype)  # what the cluster file can tell, before the model is analysed
    model, example = build_for_planning(args.model, args.input, args.input_dtype)
    start = time.perf_counter()
    graph = graph_of(model, example, args.dtype)
    points = scaling(graph, spec, counts, mode=args.mode, batch=args.batch, families=families, dtype=args.dtype)
    took = time.perf_counter() - start
    title = (f"{args.model} {'x'.join(map(str, args.input[1:]))} on {spec.name}: {args.mode} scaling, "
             f"batch {args.batch}{' at ' + str(counts[0]) + ' devices' if args.mode == 'weak' else ''} (predicted)")
    if out:
        plot(points, out, title)
    if args.format == "json":
        print(json.dumps({"mode": args.mode, "batch": args.batch, "points": [p.to_dict() for p in points]}, indent=2))
        return 0
    console.print(f"[bold]{title}[/]; {args.dtype}; {len(points)} searches in {took:.1f} s (analysis included)",
                  highlight=False, soft_wrap=True)
    table, notes = _table(points)
    console.print(table)
    for number, reason in notes:
        console.print(f"({number}) {reason}", markup=False, highlight=False, soft_wrap=True)
    if out:
        console.print(f"wrote {out}", highlight=False)
    return 0


def _output(args) -> Path | None:
    """The PNG to write, checked before any work: refuse to replace a file without --overwrite."""
    if args.out is None and args.format == "json":
        return None
    return output_file(args.out or DEFAULT_OUT, args.overwrite, DEFAULT_OUT)


def _table(points) -> tuple[Table, list[tuple[int, str]]]:
    """Devices x family: ms per step, samples/s, efficiency (on a mixed cluster, the gain of sizing the work to the
    devices over an even split) and the plan; or a numbered note why none."""
    families = list(dict.fromkeys(p.family for p in points))
    table = Table("devices", "global batch", *families,
                  title="ms per step, samples/s, efficiency; best plan")
    notes: dict[str, int] = {}
    for n in sorted({p.devices for p in points}):
        row = {p.family: p for p in points if p.devices == n}
        cells = []
        for name in families:
            p = row[name]
            if p.plan is None:
                number = notes.setdefault(p.reason, len(notes) + 1)
                cells.append(f"[dim]no plan ({number})[/]")
            else:
                gain = f", {p.even_step_time / p.step_time:.2f}x over even" if p.even_step_time else ""
                cells.append(f"{p.step_time * 1e3:.4g} ms, {_rate(p.samples_per_second)}/s, "
                             f"{100 * p.efficiency:.0f}%{gain}\n[dim]{p.plan.describe()}[/]")
        table.add_row(str(n), str(row[families[0]].global_batch), *cells)
    return table, [(number, reason) for reason, number in notes.items()]


def _rate(samples_per_second: float) -> str:
    return f"{samples_per_second:,.0f}" if samples_per_second >= 100 else f"{samples_per_second:.3g}"

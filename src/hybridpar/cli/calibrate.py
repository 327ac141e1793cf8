"""``hybridpar calibrate``: this machine measured as N devices, written as a cluster TOML for the planner."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from hybridpar.cli.args import output_file, positive


def add_parser(sub) -> None:
    cal = sub.add_parser("calibrate", help="measure this machine split into N worker processes (one per GPU on a "
                                           "CUDA machine) and write a cluster TOML for the planner (docs/cluster.md)")
    cal.add_argument("--nproc", type=positive, default=None,
                     help="worker processes, each one device of the spec (default: the number of CUDA GPUs, else "
                          "of CPU cores)")
    cal.add_argument("--out", default="cluster.toml", help="the TOML file to write (default cluster.toml)")
    cal.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                     help="dtype of the compute measurements (default float32)")
    cal.add_argument("--quick", action="store_true", help="fewer repeats and message sizes (seconds, noisier)")
    cal.add_argument("--overwrite", action="store_true", help="replace --out if it exists")


def run(args, console: Console) -> int:
    from hybridpar.calibrate import calibrate, default_nproc, summary
    from hybridpar.plan.io import write_cluster

    out = output_file(args.out, args.overwrite, "cluster.toml", parents=True)  # write_cluster makes its folder
    nproc = args.nproc or default_nproc()
    console.print(f"[bold]hybridpar calibrate[/]: this machine as {nproc} device{'s' if nproc > 1 else ''}, one worker "
                  f"process each, all measured at once; {args.dtype}{', quick' if args.quick else ''}", soft_wrap=True)
    result = calibrate(nproc, args.dtype, args.quick)
    console.print(result.measured, highlight=False)
    table = Table("measured (per worker)", "value", "unit")
    for row in summary(result):
        table.add_row(*row)
    console.print(table)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False)
    write_cluster(result.spec, out, comment=result.comment)
    console.print(f"wrote {out} (cluster {result.spec.name!r})", highlight=False)
    return 0

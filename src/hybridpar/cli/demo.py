"""``hybridpar demo``: a small 3D CNN trained with dp x spatial on local processes, checked against one process."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from hybridpar.cli.args import parts, positive

TOLERANCE = 1e-9  # float64 end to end; differences are summation order only (~1e-15)


def add_parser(sub) -> None:
    demo = sub.add_parser("demo", help="train a small 3D CNN with dp x spatial on local processes, "
                                       "checked against one process")
    demo.add_argument("--dp", type=positive, default=2, help="data-parallel replicas (default 2)")
    demo.add_argument("--spatial", type=parts, default=(2, 1, 1), help="parts per dim D,H,W (default 2,1,1)")
    demo.add_argument("--size", type=positive, default=16, help="edge of the cubic sample (default 16)")
    demo.add_argument("--batch", type=positive, default=4, help="global batch (default 4)")
    demo.add_argument("--steps", type=positive, default=3, help="training steps (default 3)")


def run(args, console: Console) -> int:
    from hybridpar import demo
    from hybridpar.dims import ParallelDims
    from hybridpar.launch import launch_local

    dims = ParallelDims(dp=args.dp, spatial=args.spatial)
    demo.check_batch(dims, args.batch, args.size)
    console.print(f"[bold]hybridpar demo[/]: {dims.world_size} local processes, dp={dims.dp} x "
                  f"spatial={'x'.join(map(str, dims.spatial))}, batch {args.batch} of 4x{args.size}^3, float64")
    rows = launch_local(demo.run, (dims, args.size, args.steps, args.batch), dims.world_size)[0]
    table = Table("step", "loss (one process)", "loss (parallel)", "max |grad diff|", "max |weight diff|")
    for r in rows:
        table.add_row(str(r["step"]), f"{r['loss_one_process']:.12f}", f"{r['loss_parallel']:.12f}",
                      f"{r['grad_diff']:.1e}", f"{r['weight_diff']:.1e}")
    console.print(table)
    worst = max(max(abs(r["loss_one_process"] - r["loss_parallel"]), r["grad_diff"], r["weight_diff"]) for r in rows)
    if worst > TOLERANCE:
        console.print(f"[red]MISMATCH[/]: largest difference {worst:.2e} exceeds {TOLERANCE:.0e}")
        return 1
    console.print(f"[green]match[/]: losses, gradients and weights equal one process (largest difference "
                  f"{worst:.1e} <= {TOLERANCE:.0e})")
    return 0

"""The ``hybridpar`` command. Errors a user can fix print in a line or two, without a traceback."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from hybridpar import plan_cli, simulate_cli
from hybridpar.errors import HybridparError

TOLERANCE = 1e-9  # float64 end to end; differences are summation order only (~1e-15)


def _parts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give part counts separated by commas, e.g. 2,1,1") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least 1")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridpar", description="Hybrid-parallel training on PyTorch.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small 3D CNN with dp x spatial on local processes, "
                                       "checked against one process")
    demo.add_argument("--dp", type=int, default=2, help="data-parallel replicas (default 2)")
    demo.add_argument("--spatial", type=_parts, default=(2, 1, 1), help="parts per dim D,H,W (default 2,1,1)")
    demo.add_argument("--size", type=int, default=16, help="edge of the cubic sample (default 16)")
    demo.add_argument("--batch", type=int, default=4, help="global batch (default 4)")
    demo.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    train = sub.add_parser("train", help="train a model from a TOML config (under torchrun, or on local workers)")
    train.add_argument("config", help="the TOML config (keys: docs/config.md)")
    train.add_argument("--nproc", type=_positive, default=None,
                       help="local workers to start (default: mesh.dp x prod(mesh.spatial), or the plan file's; "
                            "required with plan = \"auto\"); ignored under torchrun")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in run_dir")
    train.add_argument("--stop-after", type=_positive, default=None, metavar="STEPS",
                       help="stop (with a checkpoint) once this many steps are done, e.g. before a job's time limit")
    data = sub.add_parser("data", help="synthetic datasets").add_subparsers(dest="data_command", required=True)
    cosmo = data.add_parser("synth-cosmoflow", help="lognormal universes in the CosmoFlow HDF5 layout")
    seg = data.add_parser("synth-segmentation", help="volumes of labelled objects in noise, for the 3D U-Net")
    for p in (cosmo, seg):
        p.add_argument("--out", required=True, help="directory to write the HDF5 files to")
        p.add_argument("--num-samples", type=int, required=True, help="number of files")
        p.add_argument("--size", type=int, required=True, help="edge of the cubic volume")
        p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
        p.add_argument("--overwrite", action="store_true", help="replace files of the same names")
    cosmo.add_argument("--channels-first", action="store_true", help="store (4, S, S, S) instead of (S, S, S, 4)")
    seg.add_argument("--num-classes", type=int, default=3, help="classes including background (default 3)")
    seg.add_argument("--channels-last", action="store_true", help="store (S, S, S, 1) instead of (1, S, S, S)")
    cal = sub.add_parser("calibrate", help="measure this machine split into N worker processes and write a "
                                           "cluster TOML for the planner (docs/cluster.md)")
    cal.add_argument("--nproc", type=_positive, default=None,
                     help="worker processes, each one device of the spec (default: the number of CPU cores)")
    cal.add_argument("--out", default="cluster.toml", help="the TOML file to write (default cluster.toml)")
    cal.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                     help="dtype of the compute measurements (default float32)")
    cal.add_argument("--quick", action="store_true", help="fewer repeats and message sizes (seconds, noisier)")
    cal.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    plan_cli.add_parser(sub)
    simulate_cli.add_parser(sub)
    return parser


def _demo(args, console: Console) -> int:
    from hybridpar import demo
    from hybridpar.launch import launch_local
    from hybridpar.mesh import ParallelDims

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


def _train(args, console: Console) -> int:
    import os

    from hybridpar.launch import launch_local
    from hybridpar.train import load
    from hybridpar.train.loop import check, prepare_run_dir, worker
    from hybridpar.train.planning import local_world_size
    from hybridpar.train.progress import format_metrics

    config = load(args.config)
    if "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ:  # under torchrun
        result = worker(config, args.resume, args.stop_after)
        if int(os.environ.get("RANK", "0")) != 0:
            return 2 if "error" in result else 0
    else:
        nproc = local_world_size(config, args.nproc, args.config)
        prepare_run_dir(config, args.resume)
        for dataset in check(config, nproc)[:2]:
            if dataset is not None:
                dataset.close()
        result = launch_local(worker, (config, args.resume, args.stop_after), nproc)[0]
    if "error" in result:
        raise HybridparError(result["error"])
    done = result["steps"]
    if done < result["total_steps"]:
        console.print(f"stopped after step {done} of {result['total_steps']}; continue with --resume")
    if result["val"]:
        console.print(f"final validation: {format_metrics(result['val'])}", highlight=False, soft_wrap=True)
    mib = [b / 2**20 for b in result["bytes_read_per_rank"]]
    read = f"read per rank {', '.join(f'{m:.1f}' for m in mib)} MiB; " if mib else ""
    console.print(f"trained steps {result['start_step']}..{done} on {result['mesh']} in {result['time_s']:.1f} s; "
                  f"{read}outputs in {config.run_dir}", highlight=False, soft_wrap=True)
    return 0


def _data(args, console: Console) -> int:
    from rich.progress import Progress

    from hybridpar.data import synth

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(args.data_command, total=args.num_samples)

        def on_sample(_):
            progress.advance(task)

        if args.data_command == "synth-cosmoflow":
            files = synth.synth_cosmoflow(args.out, args.num_samples, args.size, seed=args.seed,
                                          channels_last=not args.channels_first, overwrite=args.overwrite,
                                          on_sample=on_sample)
        else:
            files = synth.synth_segmentation(args.out, args.num_samples, args.size, num_classes=args.num_classes,
                                             seed=args.seed, channels_last=args.channels_last,
                                             overwrite=args.overwrite, on_sample=on_sample)
    console.print(f"wrote {len(files)} files of {args.size}^3 to {args.out}")
    return 0


def _calibrate(args, console: Console) -> int:
    import os
    from pathlib import Path

    from hybridpar.calibrate import calibrate, summary
    from hybridpar.plan.io import write_cluster

    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise HybridparError(f"{out} exists; pass --overwrite to replace it, or choose another --out")
    nproc = args.nproc or os.cpu_count() or 1
    console.print(f"[bold]hybridpar calibrate[/]: this machine as {nproc} device{'s' if nproc > 1 else ''}, one worker "
                  f"process each, all measured at once; {args.dtype}{', quick' if args.quick else ''}", soft_wrap=True)
    result = calibrate(nproc, args.dtype, args.quick)
    table = Table("measured (per worker)", "value", "unit")
    for row in summary(result):
        table.add_row(*row)
    console.print(table)
    for note in result.notes:
        console.print(f"note: {note}", highlight=False)
    write_cluster(result.spec, out, comment=result.comment)
    console.print(f"wrote {out} (cluster {result.spec.name!r})", highlight=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    console = Console()
    try:
        return {"demo": _demo, "train": _train, "data": _data, "calibrate": _calibrate,
                "plan": plan_cli.run, "simulate": simulate_cli.run}[args.command](args, console)
    except HybridparError as err:
        console = Console(stderr=True)
        console.print("[red]error[/]: ", end="")
        console.print(str(err), markup=False, highlight=False, soft_wrap=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""``hybridpar data``: synthetic CosmoFlow universes and segmentation volumes, as HDF5 files."""

from __future__ import annotations

from rich.console import Console


def add_parser(sub) -> None:
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


def run(args, console: Console) -> int:
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

"""The lead paper's headline in miniature: larger samples give better accuracy.

The same synthetic universes (128^3), the same number of training steps and samples, one crop per
universe of 32^3, 64^3 or the whole 128^3 (trained with spatial parallelism, the depth split in two).
Each run is a real ``hybridpar train``; the script prints validation MAE per crop size side by side,
writes a markdown table and a PNG plot of validation MAE against training steps.

    python benchmarks/sample_size.py                      # the documented run (about 15 minutes here)
    python benchmarks/sample_size.py --steps 40 --quick   # a smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CONFIG = """
run_dir = "{run}"
seed = {seed}
[model]
name = "cosmoflow"
base_channels = {base}
fc_sizes = [64, 32]
num_blocks = {blocks}
pooling = "{pooling}"
batch_norm = {batch_norm}
[data]
format = "cosmoflow"
train = "{data}/train"
val = "{data}/val"
crop = {crop}
crops_per_file = 1
[mesh]
dp = 1
spatial = {spatial}
[optimizer]
name = "adam"
lr = {lr}
[schedule]
name = "cosine"
warmup_steps = 10
[train]
steps = {steps}
batch_size = {batch}
log_every = {every}
[validation]
every = {every}
[checkpoint]
every = 0
keep = 1
"""


def generate(data: Path, universe: int, num_train: int, num_val: int) -> None:
    for split, count, seed in (("train", num_train, 100), ("val", num_val, 200)):
        if len(list((data / split).glob("*.h5"))) != count:
            subprocess.run([sys.executable, "-m", "hybridpar", "data", "synth-cosmoflow", "--out", str(data / split),
                            "--num-samples", str(count), "--size", str(universe), "--seed", str(seed),
                            "--overwrite"], check=True)


def train(args, data: Path, crop: int, spatial: list[int], seed: int) -> list[dict]:
    run = args.out / f"crop{crop}_seed{seed}"
    config = args.out / f"crop{crop}_seed{seed}.toml"
    config.write_text(CONFIG.format(run=run, data=data, crop=crop, spatial=spatial, steps=args.steps,
                                    batch=args.batch, every=max(1, args.steps // 8), base=args.base_channels,
                                    lr=args.lr, seed=seed, blocks=args.num_blocks, pooling=args.pooling,
                                    batch_norm=str(args.batch_norm).lower()))
    if run.exists():
        subprocess.run(["rm", "-rf", str(run)], check=True)
    nproc = spatial[0] * spatial[1] * spatial[2]
    subprocess.run([sys.executable, "-m", "hybridpar", "train", str(config), "--nproc", str(nproc)], check=True,
                   env=dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc))))
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["split"] == "val"]


def plot(curves: dict[int, list[list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for crop, runs in curves.items():
        steps = [r["step"] for r in runs[0]]
        mean = [sum(run[i]["mae"] for run in runs) / len(runs) for i in range(len(steps))]
        ax.plot(steps, mean, marker="o", label=f"{crop}$^3$ crops")
    ax.axhline(0.5, color="grey", linestyle=":", label="predicting 0 (no information)")
    ax.set_xlabel("training step")
    ax.set_ylabel("validation MAE (parameters in [-1, 1])")
    ax.set_title("CosmoFlow on synthetic universes: larger samples, better accuracy", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--universe", type=int, default=128, help="edge of the universes (default 128)")
    parser.add_argument("--crops", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--num-train", type=int, default=128)
    parser.add_argument("--num-val", type=int, default=32)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--base-channels", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--num-blocks", type=int, default=3, help="conv blocks, the same at every crop (0: MLPerf's "
                        "log2(crop) - 2)")
    parser.add_argument("--pooling", choices=("average", "flatten"), default="average",
                        help="global average of the last features (one network for every crop) or MLPerf's flatten")
    parser.add_argument("--batch-norm", action=argparse.BooleanOptionalAction, default=True,
                        help="BatchNorm3d after each conv (default on: it centres the log-counts, which the "
                        "LeakyReLUs then rectify into local variances)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds (runs averaged)")
    parser.add_argument("--data", type=Path, default=Path("data/sample_size"))
    parser.add_argument("--out", type=Path, default=Path("runs/sample_size"))
    parser.add_argument("--plot", type=Path, default=Path("docs/sample_size.png"))
    parser.add_argument("--quick", action="store_true", help="small universes and crops: a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.universe, args.crops, args.num_train, args.num_val = 64, [32, 64], 8, 4
        args.plot = args.out / "sample_size_quick.png"
    args.data = args.data / f"universes_{args.universe}"
    args.out.mkdir(parents=True, exist_ok=True)
    generate(args.data, args.universe, args.num_train, args.num_val)
    curves = {}
    for crop in args.crops:
        spatial = [2, 1, 1] if crop == max(args.crops) else [1, 1, 1]
        curves[crop] = [train(args, args.data, crop, spatial, seed) for seed in args.seeds]
    finals = {crop: sum(run[-1]["mae"] for run in runs) / len(runs) for crop, runs in curves.items()}
    print(f"\n| crop | voxels per sample | spatial parallelism | final validation MAE ({len(args.seeds)} seed(s)) "
          f"| MAE / MAE at {args.crops[0]}^3 |\n|---|---|---|---|---|")
    for crop, mae in finals.items():
        par = "depth split in 2 (2 ranks)" if crop == max(args.crops) else "none (1 rank)"
        print(f"| {crop}^3 | {crop ** 3:,} | {par} | {mae:.4f} | {mae / finals[args.crops[0]]:.3f} |")
    plot(curves, args.plot)
    print(f"\nplot: {args.plot}")
    ordered = [finals[c] for c in sorted(finals)]
    improves = all(b < a for a, b in zip(ordered, ordered[1:]))
    print("validation MAE improves with sample size" if improves else "MAE does NOT improve with sample size")
    return 0 if improves else 1


if __name__ == "__main__":
    sys.exit(main())

"""The lead paper's headline in miniature: larger samples give better accuracy.

The same synthetic universes (128^3), the same number of training steps and samples, one crop per
universe of 32^3, 64^3 or the whole 128^3 (trained with spatial parallelism, the depth split in two), and
the same network for every crop (3 conv blocks, global average pooling: the same parameters, only the
volume it averages over grows). Each run is a real ``hybridpar train``; the script prints the final
validation MAE per crop size side by side (mean and per seed), next to a ridge fit on hand-made summary
statistics of the same crops, and writes a PNG plot.

    python benchmarks/sample_size.py --seeds 0 1 2         # the documented run (about 25 minutes a seed here)
    python benchmarks/sample_size.py --steps 40 --quick    # a smoke test (its own folder, runs/sample_size/quick)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

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


def generate(data: Path, universe: int, num_train: int, num_val: int, runs: Path) -> None:
    """The universes; when they are made anew, the runs trained on the old ones are deleted."""
    for split, count, seed in (("train", num_train, 100), ("val", num_val, 200)):
        if len(list((data / split).glob("*.h5"))) != count:
            shutil.rmtree(runs, ignore_errors=True)
            runs.mkdir(parents=True)
            subprocess.run([sys.executable, "-m", "hybridpar", "data", "synth-cosmoflow", "--out", str(data / split),
                            "--num-samples", str(count), "--size", str(universe), "--seed", str(seed),
                            "--overwrite"], check=True)


def train(args, data: Path, crop: int, spatial: list[int], seed: int) -> list[dict]:
    """One ``hybridpar train`` run; its validation records. A finished run of the very same config is
    reused (``--fresh`` trains again), so seeds can be added to a documented run."""
    run = args.out / f"crop{crop}_seed{seed}"
    config = args.out / f"crop{crop}_seed{seed}.toml"
    text = CONFIG.format(run=run, data=data, crop=crop, spatial=spatial, steps=args.steps, batch=args.batch,
                         every=max(1, args.steps // 8), base=args.base_channels, lr=args.lr, seed=seed,
                         blocks=args.num_blocks, pooling=args.pooling, batch_norm=str(args.batch_norm).lower())
    if args.fresh or not (config.exists() and config.read_text() == text and _finished(run, args.steps)):
        config.write_text(text)
        shutil.rmtree(run, ignore_errors=True)
        nproc = spatial[0] * spatial[1] * spatial[2]
        subprocess.run([sys.executable, "-m", "hybridpar", "train", str(config), "--nproc", str(nproc)], check=True,
                       env=dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // nproc))))
    else:
        print(f"reusing {run} (the same config, finished)")
    return [r for r in _records(run) if r["split"] == "val"]


def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _finished(run: Path, steps: int) -> bool:
    return any(r["split"] == "val" and r["step"] == steps for r in _records(run))


K_BANDS = ((0.1, 0.3), (0.3, 0.6), (0.6, 1.0), (1.0, 1.6), (1.6, 2.5))  # rad / cell


def summary_statistics(path: Path, crop: int) -> tuple[np.ndarray, np.ndarray]:
    """Hand-made features of one crop: per channel, mean and std of log1p(counts) and the log power of the
    density contrast in ``K_BANDS``; and the target ``unitPar``."""
    with h5py.File(path, "r") as f:
        counts = f["full"][:crop, :crop, :crop].astype(np.float32)  # (D, H, W, C)
        target = f["unitPar"][()]
    k1 = 2 * np.pi * np.fft.fftfreq(crop)
    k = np.sqrt(k1[:, None, None] ** 2 + k1[None, :, None] ** 2 + (2 * np.pi * np.fft.rfftfreq(crop)) ** 2)
    features = []
    for c in range(counts.shape[-1]):
        logs = np.log1p(counts[..., c])
        contrast = counts[..., c] / counts[..., c].mean() - 1
        power = np.abs(np.fft.rfftn(contrast)) ** 2 / contrast.size
        features += [logs.mean(), logs.std()] + [np.log(power[(k >= lo) & (k < hi)].mean()) for lo, hi in K_BANDS]
    return np.array(features), target


def statistics_baseline(data: Path, crop: int) -> float:
    """Validation MAE of a ridge regression on ``summary_statistics``: how much the crops tell about the
    parameters through statistics a cosmologist would compute, with no network at all."""
    def load(split):
        pairs = [summary_statistics(p, crop) for p in sorted((data / split).glob("*.h5"))]
        return np.array([a for a, _ in pairs]), np.array([b for _, b in pairs])

    (x, y), (x_val, y_val) = load("train"), load("val")
    mean, std = x.mean(0), x.std(0) + 1e-9
    design = np.c_[(x - mean) / std, np.ones(len(x))]
    weights = np.linalg.solve(design.T @ design + np.eye(design.shape[1]), design.T @ y)  # ridge, lambda = 1
    return float(np.abs(np.c_[(x_val - mean) / std, np.ones(len(x_val))] @ weights - y_val).mean())


def plot(curves: dict[int, list[list[dict]]], baseline: dict[int, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    crops = sorted(curves)
    finals = {c: [run[-1]["mae"] for run in curves[c]] for c in crops}
    for c in crops:
        left.scatter([c] * len(finals[c]), finals[c], color="tab:blue", alpha=0.4, s=18)
    left.plot(crops, [np.mean(finals[c]) for c in crops], marker="o", color="tab:blue",
              label=f"CosmoFlow, mean of {len(curves[crops[0]])} seed(s)")
    left.plot(crops, [baseline[c] for c in crops], marker="s", linestyle="--", color="tab:green",
              label="ridge fit on summary statistics")
    left.axhline(0.5, color="grey", linestyle=":", label="predicting 0 (no information)")
    left.set_xscale("log", base=2)
    left.set_xticks(crops, [f"{c}$^3$" for c in crops])
    left.set_xlabel("sample (crop) size")
    left.set_ylabel("final validation MAE (parameters in [-1, 1])")
    left.legend(fontsize=8)
    for c in crops:
        steps = [r["step"] for r in curves[c][0]]
        right.plot(steps, [np.mean([run[i]["mae"] for run in curves[c]]) for i in range(len(steps))], marker="o",
                   label=f"{c}$^3$")
    right.set_ylim(0, 1.3)
    right.set_xlabel("training step")
    right.set_ylabel("validation MAE during training")
    right.legend(fontsize=8)
    fig.suptitle("CosmoFlow on synthetic universes: the same universes, steps and samples; larger samples, "
                 "better accuracy", fontsize=9)
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
    parser.add_argument("--fresh", action="store_true", help="train again even where a finished run of the same "
                        "config exists")
    args = parser.parse_args()
    if args.quick:
        args.universe, args.crops, args.num_train, args.num_val = 64, [32, 64], 8, 4
        args.out = args.out / "quick"  # never touches the runs of the documented benchmark
        args.plot = args.out / "sample_size_quick.png"
    args.data = args.data / f"universes_{args.universe}"
    args.out.mkdir(parents=True, exist_ok=True)
    generate(args.data, args.universe, args.num_train, args.num_val, args.out)
    curves = {}
    for crop in args.crops:
        spatial = [2, 1, 1] if crop == max(args.crops) else [1, 1, 1]
        curves[crop] = [train(args, args.data, crop, spatial, seed) for seed in args.seeds]
    baseline = {crop: statistics_baseline(args.data, crop) for crop in args.crops}
    finals = {crop: float(np.mean([run[-1]["mae"] for run in runs])) for crop, runs in curves.items()}
    print(f"\n| crop | voxels per sample | spatial parallelism | final validation MAE, mean of {len(args.seeds)} "
          f"seed(s) | per seed | MAE / MAE at {args.crops[0]}^3 | ridge fit on summary statistics |\n"
          f"|---|---|---|---|---|---|---|")
    for crop, mae in finals.items():
        par = "depth split in 2 (2 ranks)" if crop == max(args.crops) else "none (1 rank)"
        seeds = ", ".join(f"{run[-1]['mae']:.3f}" for run in curves[crop])
        print(f"| {crop}^3 | {crop ** 3:,} | {par} | {mae:.4f} | {seeds} | {mae / finals[args.crops[0]]:.3f} "
              f"| {baseline[crop]:.4f} |")
    plot(curves, baseline, args.plot)
    print(f"\nplot: {args.plot}")
    ordered = [finals[c] for c in sorted(finals)]
    improves = all(b < a for a, b in zip(ordered, ordered[1:]))
    print("validation MAE improves with sample size" if improves else "MAE does NOT improve with sample size")
    return 0 if improves else 1


if __name__ == "__main__":
    sys.exit(main())

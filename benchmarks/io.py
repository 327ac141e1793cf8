"""Slab-parallel HDF5 reading: bytes and time per rank for depth, height and width splits, side by side.

For spatial P = 1, 2, 4 and the grids (P,1,1), (1,P,1), (1,1,P) and (2,2,1), every rank of the spatial
group reads its slab of every sample through its own ``SlabDataset`` (ranks are simulated one after the
other in this process; each has its own counters, so no process group is needed). Bytes are what HDF5
asked the operating system for (``SlabDataset.bytes_read``). The per-file metadata (superblock and the
two dataset headers) and the target vector each sample reads are measured separately, on fresh file
handles, and subtracted: what is left is the payload, which must equal the rank's slab exactly (the
script exits non-zero otherwise). Files are CosmoFlow universes (``full`` int16, ``unitPar``), channels
last (the public layout) and, for a few rows, channels first. Results are printed as Markdown; see
docs/benchmarks.md.

    python benchmarks/io.py                # 8 universes of 128^3, about a minute on 2 cores
    python benchmarks/io.py --crop 64      # 64^3 crops of the same universes
    python benchmarks/io.py --quick        # 2 universes of 32^3, a sanity check
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import h5py
import torch

from hybridpar.data.hdf5 import COSMOFLOW, CountingFile, SampleFormat, SlabDataset, list_files
from hybridpar.data.synth import synth_cosmoflow
from hybridpar.errors import HybridparError
from hybridpar.geometry import Grid

CHANNELS_LAST, CHANNELS_FIRST = "channels_last", "channels_first"
GRIDS_LAST = ((1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (4, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 1))
GRIDS_FIRST = ((1, 1, 1), (4, 1, 1), (1, 1, 4))
SEED = 0
MIB, MB = 2 ** 20, 1e6


@dataclass(frozen=True)
class Config:
    grid: tuple[int, int, int]  # parts per (D, H, W)
    layout: str  # how the files store the volume

    @property
    def num_parts(self) -> int:
        return math.prod(self.grid)

    @property
    def split(self) -> str:
        names = [n for n, p in zip(("depth", "height", "width"), self.grid) if p > 1]
        return "+".join(names) or "none"

    @property
    def label(self) -> str:
        return f"{'x'.join(map(str, self.grid))} {self.split}"


@dataclass(frozen=True)
class FileOverhead:
    metadata: int  # bytes read opening the file and the input and target datasets
    target: int  # bytes read for the target of one sample


def io_format(layout: str, transform: str) -> SampleFormat:
    return dataclasses.replace(COSMOFLOW, layout=layout, transform=transform)


def ensure_files(root: Path, layout: str, size: int, num_samples: int) -> list[Path]:
    """``num_samples`` universes of ``size``^3 in ``root/<layout>_<size>``, generated (seed 0) if missing."""
    if root.exists() and not root.is_dir():
        raise HybridparError(f"--dir {str(root)!r} is a file, not a directory; choose a directory")
    out = root / f"{layout}_{size}"
    existing = sorted(out.glob("univ_*.h5")) if out.is_dir() else []
    for path in existing:
        with h5py.File(path, "r") as f:
            shape, seed = f["full"].shape, f.attrs.get("seed")
        want = (size,) * 3 + (4,) if layout == CHANNELS_LAST else (4,) + (size,) * 3
        if shape != want or seed != SEED:
            raise HybridparError(f"{path}: 'full' has shape {shape} (seed {seed}), not the {want} of seed {SEED} "
                                 f"this run needs; pass another --dir (or remove {out})")
    if len(existing) < num_samples:
        print(f"generating {num_samples} {layout} universes of {size}^3 in {out} ...", file=sys.stderr, flush=True)
        synth_cosmoflow(out, num_samples, size, seed=SEED, channels_last=layout == CHANNELS_LAST, overwrite=True)
    return list_files(out, "--dir")[:num_samples]


def file_overhead(path: Path, fmt: SampleFormat) -> FileOverhead:
    """What a fresh handle reads before any slab: metadata on open, then the target alone."""
    with CountingFile(path) as fileobj, h5py.File(fileobj, "r") as f:
        x, y = f[fmt.input], f[fmt.target]
        _ = x.shape, x.dtype, y.shape, y.dtype
        metadata = fileobj.bytes_read
        y[()]
        return FileOverhead(metadata, fileobj.bytes_read - metadata)


def contiguous_runs(stored_shape: tuple[int, ...], select: tuple[tuple[int, int], ...]) -> int:
    """Contiguous byte runs of a hyperslab of a C-order array: the selected extents of every dim
    before the last one that is not selected whole (one run if all are)."""
    partial = [d for d, ((lo, hi), n) in enumerate(zip(select, stored_shape)) if hi - lo != n]
    if not partial:
        return 1
    return math.prod(hi - lo for lo, hi in select[:partial[-1]])


def stored_select(layout: str, channels: int, box: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    return box + ((0, channels),) if layout == CHANNELS_LAST else ((0, channels),) + box


def read_rank(paths: list[Path], cfg: Config, rank: int, *, crop: int | None, transform: str,
              dtype: torch.dtype, reference: torch.Tensor | None = None) -> dict:
    """Rank ``rank`` reads its slab of every sample with its own dataset: bytes, seconds, slab bytes."""
    ds = SlabDataset(paths, io_format(cfg.layout, transform), crop=crop, dtype=dtype)
    grid = Grid(cfg.grid)
    grid.check_shape(ds.sample_shape[1:], "--crop / --size")
    try:
        start = time.perf_counter()
        for index in range(len(ds)):
            x, _ = ds.read(index, grid, rank)
            if index == 0 and reference is not None:
                box = tuple(slice(lo, hi) for lo, hi in grid.slab(ds.sample_shape[1:], rank))
                assert torch.equal(x, reference[(slice(None),) + box]), f"{cfg.label} rank {rank}: wrong slab"
        seconds = time.perf_counter() - start
        return {"bytes": ds.bytes_read, "seconds": seconds}
    finally:
        ds.close()


@dataclass(frozen=True)
class Samples:
    """The geometry of a set of files as one dataset sees it."""

    sample_shape: tuple[int, ...]  # (C, D, H, W) of one sample (crop)
    stored_shape: tuple[int, ...]  # shape of ``full`` in the files
    itemsize: int
    num_samples: int

    @classmethod
    def of(cls, paths: list[Path], layout: str, crop: int | None) -> Samples:
        ds = SlabDataset(paths, io_format(layout, "none"), crop=crop)
        with h5py.File(paths[0], "r") as f:
            stored, itemsize = f["full"].shape, f["full"].dtype.itemsize
        return cls(ds.sample_shape, stored, itemsize, len(ds))


def slab_facts(samples: Samples, cfg: Config, rank: int) -> dict:
    """Analytical bytes and contiguous runs of rank ``rank``'s slabs, from the geometry alone."""
    channels, *spatial = samples.sample_shape
    bounds = Grid(cfg.grid).slab(tuple(spatial), rank)
    slab = math.prod(hi - lo for lo, hi in bounds) * channels * samples.itemsize
    runs = contiguous_runs(samples.stored_shape, stored_select(cfg.layout, channels, bounds))
    sample_bytes = math.prod(samples.sample_shape) * samples.itemsize
    return {"slab_bytes": slab * samples.num_samples, "sample_bytes": sample_bytes,
            "num_samples": samples.num_samples, "runs": runs}


def whole_first_sample(paths: list[Path], layout: str, crop: int | None, dtype: torch.dtype) -> torch.Tensor:
    """Sample 0 read whole, ``(C, D, H, W)``: what every rank's first slab is checked against."""
    ds = SlabDataset(paths[:1], io_format(layout, "none"), crop=crop, dtype=dtype)
    try:
        return ds.read(0, Grid((1, 1, 1)), 0)[0]
    finally:
        ds.close()


def measure(paths: dict[str, list[Path]], configs: list[Config], args) -> dict[Config, dict]:
    """Every config, ``args.repeats`` times interleaved (so drifting load hits all alike); bytes must not
    change between repeats, times are medians."""
    io_dtype = torch.int16
    overheads = {layout: [file_overhead(p, COSMOFLOW) for p in ps] for layout, ps in paths.items()}
    references = {layout: whole_first_sample(ps, layout, args.crop, io_dtype) for layout, ps in paths.items()}
    samples = {layout: Samples.of(ps, layout, args.crop) for layout, ps in paths.items()}
    facts = {cfg: [slab_facts(samples[cfg.layout], cfg, r) for r in range(cfg.num_parts)] for cfg in configs}
    runs: dict[Config, list[list[dict]]] = {cfg: [] for cfg in configs}
    for repeat in range(args.repeats):
        for cfg in configs:
            ranks = []
            for rank in range(cfg.num_parts):
                io = read_rank(paths[cfg.layout], cfg, rank, crop=args.crop, transform="none", dtype=io_dtype,
                               reference=references[cfg.layout])
                train = read_rank(paths[cfg.layout], cfg, rank, crop=args.crop, transform="log1p",
                                  dtype=torch.float32)
                assert io["bytes"] == train["bytes"], f"{cfg.label} rank {rank}: bytes depend on the transform"
                ranks.append({"bytes": io["bytes"], "seconds": io["seconds"], "train_seconds": train["seconds"]})
            runs[cfg].append(ranks)
        print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    return {cfg: summarize(cfg, runs[cfg], facts[cfg], overheads[cfg.layout]) for cfg in configs}


def summarize(cfg: Config, repeats: list[list[dict]], facts: list[dict], overheads: list[FileOverhead]) -> dict:
    first = repeats[0]
    for ranks in repeats[1:]:
        assert [r["bytes"] for r in ranks] == [r["bytes"] for r in first], f"{cfg.label}: bytes changed"
    num_samples = facts[0]["num_samples"]
    samples_per_file = num_samples // len(overheads)
    overhead = sum(o.metadata for o in overheads) + samples_per_file * sum(o.target for o in overheads)
    payloads = [r["bytes"] - overhead for r in first]
    per_rank_s = [statistics.median(ranks[r]["seconds"] for ranks in repeats) for r in range(cfg.num_parts)]
    train_s = [statistics.median(ranks[r]["train_seconds"] for ranks in repeats) for r in range(cfg.num_parts)]
    metadata = sorted({o.metadata for o in overheads})
    return {
        "payload": payloads,  # per rank, all samples
        "slab": [f["slab_bytes"] for f in facts],
        "share": num_samples * facts[0]["sample_bytes"] / cfg.num_parts,
        "group_payload": sum(payloads), "group_sample_bytes": num_samples * facts[0]["sample_bytes"],
        "metadata": metadata, "target": sorted({o.target for o in overheads}),
        "runs": max(f["runs"] for f in facts), "seconds": statistics.mean(per_rank_s),
        "train_seconds": statistics.mean(train_s), "num_samples": num_samples,
    }


def check_exact(results: dict[Config, dict]) -> list[str]:
    """Every rank's payload equals its slab, and the group's equals the samples, to the byte."""
    problems = []
    for cfg, r in results.items():
        for rank, (payload, slab) in enumerate(zip(r["payload"], r["slab"])):
            if payload != slab:
                problems.append(f"{cfg.layout} {cfg.label} rank {rank}: payload {payload} B, its slabs {slab} B")
        if r["group_payload"] != r["group_sample_bytes"]:
            problems.append(f"{cfg.layout} {cfg.label}: group payload {r['group_payload']} B, "
                            f"samples {r['group_sample_bytes']} B")
    return problems


def _span(values: list[int]) -> str:
    return str(values[0]) if len(values) == 1 else f"{values[0]}-{values[-1]}"


def print_table(results: dict[Config, dict], num_samples: int) -> None:
    print(f"\nPer rank, over the {num_samples} samples; times are medians of the repeats, averaged over the "
          f"ranks.\n")
    print("| grid | layout | P | MiB/rank payload | MiB/rank share (sample / P) | payload / share "
          "| metadata B/file | target B/sample | runs/rank/sample | read s/rank | time vs P=1 | time vs P=1 x P "
          "| MB/s/rank | read + log1p f32 s/rank |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cfg, r in results.items():
        base = results[Config((1, 1, 1), cfg.layout)]
        payload = statistics.mean(r["payload"])
        ratio_t = r["seconds"] / base["seconds"]
        print(f"| {cfg.label} | {cfg.layout.replace('_', ' ')} | {cfg.num_parts} | {payload / MIB:.3f} "
              f"| {r['share'] / MIB:.3f} | {r['group_payload'] / r['group_sample_bytes']:.4f} "
              f"| {_span(r['metadata'])} | {_span(r['target'])} | {r['runs']} | {r['seconds']:.3f} | {ratio_t:.3f} "
              f"| {ratio_t * cfg.num_parts:.2f} | {payload / MB / r['seconds']:.0f} | {r['train_seconds']:.3f} |")


def print_naive(results: dict[Config, dict]) -> None:
    """A naive reader reads the whole sample on every rank and slices: its per-rank bytes are P=1's."""
    whole = statistics.mean(results[Config((1, 1, 1), CHANNELS_LAST)]["payload"])
    parts = []
    for p, grid in ((2, (2, 1, 1)), (4, (4, 1, 1))):
        slab = statistics.mean(results[Config(grid, CHANNELS_LAST)]["payload"])
        parts.append(f"P={p} {whole / slab:.4f} : 1")
    print(f"\n- whole sample then slice (a naive reader) vs slab reading, bytes per rank: {', '.join(parts)} "
          f"(the spatial group reads P x the sample instead of 1 x; its time per rank is the P=1 row's)")


def print_header(args, load: float) -> None:
    print(f"### Slab-parallel I/O benchmark, {datetime.date.today().isoformat()}\n")
    print(f"Command: `{' '.join(['python', 'benchmarks/io.py'] + sys.argv[1:])}`  ")
    print(f"Machine: {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), torch "
          f"{torch.__version__} (1 thread), h5py {h5py.__version__}, HDF5 {h5py.version.hdf5_version}, "
          f"load average {load:.1f} at start  ")
    crop = f", read as {args.crop}^3 crops" if args.crop else ""
    print(f"Data: {args.num_samples} CosmoFlow universes `full` int16 of {args.size}^3 x 4 channels{crop}, in "
          f"{args.dir}; files in the page cache (warm), so times are HDF5 and copying, not the disk  ")
    print(f"Read s/rank: `SlabDataset.read` of every sample, stored dtype, no transform; last column: the "
          f"training format (float32, log1p); median of {args.repeats} repeat(s)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=128, help="edge S of the universes")
    parser.add_argument("--num-samples", type=int, default=8, help="universes (files) to read")
    parser.add_argument("--crop", type=int, default=None, help="read the universes as cubic crops of this edge")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "hybridpar-io-bench",
                        help="data directory; universes are generated in DIR/channels_last_SIZE and "
                             "DIR/channels_first_SIZE if missing")
    parser.add_argument("--repeats", type=int, default=3, help="times each configuration is read")
    parser.add_argument("--quick", action="store_true", help="sanity check: 2 universes of 32^3, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.num_samples, args.repeats = 32, 2, 1
    torch.set_num_threads(1)  # one core per simulated rank, and leave the machine to others
    load = os.getloadavg()[0]
    try:
        paths = {layout: ensure_files(args.dir, layout, args.size, args.num_samples)
                 for layout in (CHANNELS_LAST, CHANNELS_FIRST)}
        configs = [Config(g, CHANNELS_LAST) for g in GRIDS_LAST] + [Config(g, CHANNELS_FIRST) for g in GRIDS_FIRST]
        results = measure(paths, configs, args)
    except HybridparError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    print_header(args, load)
    print_table(results, next(iter(results.values()))["num_samples"])
    print_naive(results)
    problems = check_exact(results)
    if problems:
        print("\nFAILED: payload / share is not exactly 1:\n" + "\n".join(f"- {p}" for p in problems), file=sys.stderr)
        sys.exit(1)
    print("- payload / share: exactly 1 on every rank of every grid (checked to the byte)")


if __name__ == "__main__":
    main()

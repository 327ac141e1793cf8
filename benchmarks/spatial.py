"""Spatial parallelism on a CosmoFlow-like conv stack, side by side in one run.

Configurations, on one float32 sample of shape ``(1, 4, S, S, S)``, forward + backward:

- one process (the reference), given as many threads as the P-rank runs use in total;
- spatial P=2 and P=4, each with a depth split ``(P, 1, 1)`` and a width split ``(1, 1, P)``,
  wrapped in DDP over the spatial group (the library's gradient convention);
- a DDP reference with the same per-rank work and no halos: P ranks each running the plain stack
  on a local volume the size of one slab, wrapped in DDP.

Each configuration runs in fresh worker processes (gloo on 127.0.0.1) started with
``MALLOC_MMAP_THRESHOLD_=65536``, so freed tensors go back to the OS and the peak resident set
(``VmHWM``, reset after warm-up) measures live tensors rather than allocator caches. Halo bytes are
counted by ``hybridpar.spatial.exchange_stats`` and computed independently from the layer geometry
(``analytical_halo_bytes``). Results are printed as Markdown; see docs/benchmarks.md.

    python benchmarks/spatial.py            # 128^3 and 256^3, about 7-11 minutes on 2 cores
    python benchmarks/spatial.py --quick    # sanity check at 32^3, about 40 s on 2 idle cores
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import multiprocessing as mp
import os
import platform
import re
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import hybridpar
from hybridpar import spatial
from hybridpar.launch import shutdown_distributed
from hybridpar.parallel import data_parallel

CHANNELS = (4, 16, 32, 64)  # input channels, then the output channels of each block
PARTS = (2, 4)
ONE, SPATIAL, DDP = "one process", "spatial", "DDP reference"
BYTES_PER_VALUE = 4  # float32
CONFIG_TIMEOUT_S = 1800.0
STORE_TIMEOUT = datetime.timedelta(seconds=120)  # process-group start; a rank that does not join fails
TARGETS = {"memory P=4": 0.30, "memory P=2": 0.55, "time P=2 / DDP": 1.05}


@dataclass(frozen=True)
class Config:
    kind: str  # ONE, SPATIAL or DDP
    size: int  # global edge S of the cubic sample
    grid: tuple[int, int, int]  # parts per (D, H, W); (1, 1, 1) for ONE
    threads: int  # torch threads per rank
    overlap: bool | None = None  # hybridpar.spatial.parallelize(overlap=...)

    @property
    def num_ranks(self) -> int:
        return 1 if self.kind == ONE else math.prod(self.grid)

    @property
    def local_shape(self) -> tuple[int, ...]:
        """``(N, C, D, H, W)`` of one rank's slab (sizes are checked to split evenly)."""
        return (1, CHANNELS[0]) + tuple(self.size // p for p in self.grid)

    @property
    def split(self) -> str:
        return "depth" if self.grid[0] > 1 else "width"

    @property
    def label(self) -> str:
        if self.kind == ONE:
            return f"{ONE} ({self.threads} threads)"
        return f"{self.kind} P={self.num_ranks} {self.split} {'x'.join(map(str, self.grid))}"


def conv_stack(channels: tuple[int, ...] = CHANNELS) -> nn.Sequential:
    """CosmoFlow-like feature extractor: blocks of Conv3d(k=3, p=1) -> LeakyReLU -> MaxPool3d(2)."""
    layers = []
    for c_in, c_out in zip(channels, channels[1:]):
        layers += [nn.Conv3d(c_in, c_out, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2)]
    return nn.Sequential(*layers)


def analytical_halo_bytes(size: int, grid: tuple[int, ...], rank: int) -> int:
    """Halo bytes ``rank`` sends per step (forward + backward), from the layer geometry alone.

    Conv ``l`` (k=3, p=1) reads one plane beyond each side of its slab along the split dim, so a rank
    sends one plane of its input, ``C_l x S_l x S_l`` values (the two other dims are whole), to each
    neighbour. Backward returns each received plane's gradient to its owner (the same bytes), except
    for conv 0, whose input is the sample and needs no gradient. MaxPool(2) on even slabs needs no halo.
    """
    (axis,) = [a for a, p in enumerate(grid) if p > 1]
    coord = rank  # a 1-D split: the row-major coordinate along the split axis is the rank
    num_neighbours = (coord > 0) + (coord < grid[axis] - 1)
    total = 0
    for layer, c_in in enumerate(CHANNELS[:-1]):
        edge = size // 2**layer
        directions = 1 if layer == 0 else 2  # forward only, or forward + backward
        total += directions * num_neighbours * c_in * edge * edge * BYTES_PER_VALUE
    return total


# -- one worker process ---------------------------------------------------------------------------


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def _reset_peak_rss() -> None:
    """Set VmHWM to the current resident set (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _global_input(size: int) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(1, CHANNELS[0], size, size, size)  # x_NCDHW


def _sum_of_squares(y: torch.Tensor, mesh) -> torch.Tensor:
    """Global loss (the same value on every rank of ``mesh``; ``None``: this rank's volume only)."""
    return spatial.mse_loss(y, torch.zeros_like(y), mesh, reduction="sum")


def _build(cfg: Config):
    """``(model, this rank's input, loss function)`` for one configuration; weights from seed 0."""
    torch.manual_seed(0)
    stack = conv_stack()
    if cfg.kind == ONE:
        return stack, _global_input(cfg.size), functools.partial(_sum_of_squares, mesh=None)
    if cfg.kind == DDP:
        mesh = init_device_mesh("cpu", (cfg.num_ranks,), mesh_dim_names=("dp",))
        torch.manual_seed(1 + dist.get_rank())
        x = torch.randn(cfg.local_shape)
        return data_parallel(stack, mesh, axes=("dp",)), x, functools.partial(_sum_of_squares, mesh=None)
    mesh = init_device_mesh("cpu", (cfg.num_ranks,), mesh_dim_names=("spatial",))
    x = spatial.shard(_global_input(cfg.size), mesh, grid=cfg.grid)
    model = data_parallel(spatial.parallelize(stack, mesh, grid=cfg.grid, overlap=cfg.overlap), mesh,
                          axes=("spatial",))
    return model, x, functools.partial(_sum_of_squares, mesh=mesh)


def _step(model, x, loss_fn) -> tuple[float, float]:
    """One forward + backward: ``(seconds, loss)``; ranks start together."""
    model.zero_grad(set_to_none=True)
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    loss = loss_fn(model(x))
    loss.backward()
    return time.perf_counter() - start, loss.item()


def _measure(rank: int, cfg: Config, port: int, num_warmup: int, num_steps: int) -> dict:
    torch.set_num_threads(cfg.threads)
    if cfg.num_ranks > 1:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=cfg.num_ranks)
    baseline_kib = _proc_status_kib("VmRSS")
    model, x, loss_fn = _build(cfg)
    stats = spatial.exchange_stats(model) if cfg.kind == SPATIAL else None
    times, losses = [], []
    for step in range(num_warmup + num_steps):
        if step == num_warmup:
            _reset_peak_rss()
            if stats is not None:
                stats.reset()
        seconds, loss = _step(model, x, loss_fn)
        times.append(seconds)
        losses.append(loss)
    peak_kib = _proc_status_kib("VmHWM")
    del model, loss_fn
    if dist.is_initialized():
        shutdown_distributed()
    return {
        "times": times[num_warmup:], "loss": losses[0], "peak_kib": peak_kib, "baseline_kib": baseline_kib,
        "bytes_per_step": stats.bytes_sent / num_steps if stats else 0,
        "messages_per_step": stats.messages / num_steps if stats else 0,
    }


def _worker(rank: int, cfg: Config, port: int, num_warmup: int, num_steps: int, results) -> None:
    try:
        results.put((rank, True, _measure(rank, cfg, port, num_warmup, num_steps)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which stops the benchmark
        results.put((rank, False, traceback.format_exc()))


# -- the parent: one configuration after another ---------------------------------------------------


def run_config(cfg: Config, num_warmup: int, num_steps: int) -> list[dict]:
    """Every rank's measurements of ``cfg``, from fresh processes (the environment is read at start)."""
    os.environ.update(OMP_NUM_THREADS=str(cfg.threads), MALLOC_MMAP_THRESHOLD_="65536")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # The parent owns the rendezvous store, bound to a port the OS picks: no window in which another
    # job on the machine could take a port chosen here and bound later by a worker.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)
    procs = [ctx.Process(target=_worker, args=(r, cfg, store.port, num_warmup, num_steps, results))
             for r in range(cfg.num_ranks)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in procs:
            rank, ok, value = results.get(timeout=CONFIG_TIMEOUT_S)
            if not ok:
                raise RuntimeError(f"{cfg.label}, {cfg.size}^3: rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(cfg.num_ranks)]


def configs(size: int, num_cores: int, overlap: bool | None) -> list[Config]:
    """The reference for each total thread count the P-rank runs use, then spatial and DDP per grid."""
    threads = {p: max(1, num_cores // p) for p in PARTS}
    out = [Config(ONE, size, (1, 1, 1), t) for t in sorted({p * threads[p] for p in PARTS})]
    for p in PARTS:
        for grid in ((p, 1, 1), (1, 1, p)):
            out += [Config(SPATIAL, size, grid, threads[p], overlap), Config(DDP, size, grid, threads[p])]
    return out


def summarize(cfg: Config, ranks: list[dict]) -> dict:
    """One table row: the step time is the slowest rank's, the median over timed steps."""
    per_step = [max(r["times"][i] for r in ranks) for i in range(len(ranks[0]["times"]))]
    row = {
        "cfg": cfg, "step_s": statistics.median(per_step), "step_range": (min(per_step), max(per_step)),
        "loss": ranks[0]["loss"],
        "peak_mib": max(r["peak_kib"] for r in ranks) / 1024,
        "baseline_mib": max(r["baseline_kib"] for r in ranks) / 1024,
    }
    if cfg.kind == SPATIAL:
        analytic = [analytical_halo_bytes(cfg.size, cfg.grid, r) for r in range(cfg.num_ranks)]
        row["measured_bytes"] = sum(r["bytes_per_step"] for r in ranks)
        row["analytic_bytes"] = sum(analytic)
        row["per_rank_exact"] = all(r["bytes_per_step"] == a for r, a in zip(ranks, analytic))
        row["messages"] = sum(r["messages_per_step"] for r in ranks)
    return row


# -- report ---------------------------------------------------------------------------------------


def _reference(rows: list[dict], threads: int) -> dict:
    return next(r for r in rows if r["cfg"].kind == ONE and r["cfg"].threads == threads)


def _find(rows: list[dict], kind: str, grid: tuple[int, ...]) -> dict:
    return next(r for r in rows if r["cfg"].kind == kind and r["cfg"].grid == grid)


def print_table(size: int, rows: list[dict]) -> None:
    ref_loss = _reference(rows, rows[0]["cfg"].threads)["loss"]
    print(f"\n#### {size}^3 (input 1x{CHANNELS[0]}x{size}^3)\n")
    print("| configuration | ranks x threads | step s (median) | step s (min-max) | peak MiB/rank (VmHWM) "
          "| baseline MiB/rank "
          "| halo MB/step measured | halo MB/step analytical | messages/step | loss rel. diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cfg = r["cfg"]
        halo = ["-", "-", "-"]
        if cfg.kind == SPATIAL:
            halo = [f"{r['measured_bytes'] / 1e6:.3f}", f"{r['analytic_bytes'] / 1e6:.3f}", f"{r['messages']:.0f}"]
        diff = f"{abs(r['loss'] - ref_loss) / abs(ref_loss):.1e}" if cfg.kind != DDP else "-"
        low, high = r["step_range"]
        print(f"| {cfg.label} | {cfg.num_ranks} x {cfg.threads} | {r['step_s']:.3f} | {low:.3f}-{high:.3f} "
              f"| {r['peak_mib']:.0f} | {r['baseline_mib']:.0f} | {' | '.join(halo)} | {diff} |")


def _verdict(value: float, target: float) -> str:
    return "met" if value <= target else "MISSED"


def _memory_ratios(rows: list[dict], parts: int, target: float) -> list[str]:
    lines = []
    for grid in ((parts, 1, 1), (1, 1, parts)):
        row = _find(rows, SPATIAL, grid)
        ref = _reference(rows, parts * row["cfg"].threads)
        raw = row["peak_mib"] / ref["peak_mib"]
        net = (row["peak_mib"] - row["baseline_mib"]) / (ref["peak_mib"] - ref["baseline_mib"])
        overhead = row["peak_mib"] / _find(rows, DDP, grid)["peak_mib"]
        lines.append(f"- memory P={parts} {row['cfg'].split} / {ref['cfg'].label}: {raw:.3f} "
                     f"(target <= {target}: {_verdict(raw, target)}); net of baseline RSS: {net:.3f}; "
                     f"spatial / DDP reference with the same slab: {overhead:.3f}")
    return lines


def print_ratios(size: int, rows: list[dict]) -> None:
    print(f"\nRatios, {size}^3:\n")
    lines = _memory_ratios(rows, 4, TARGETS["memory P=4"]) + _memory_ratios(rows, 2, TARGETS["memory P=2"])
    for parts in PARTS:
        for grid in ((parts, 1, 1), (1, 1, parts)):
            sp, ddp = _find(rows, SPATIAL, grid), _find(rows, DDP, grid)
            ratio = sp["step_s"] / ddp["step_s"]
            target = f" (target <= {TARGETS['time P=2 / DDP']}: {_verdict(ratio, TARGETS['time P=2 / DDP'])})"
            lines.append(f"- step time {sp['cfg'].label} / {ddp['cfg'].label}: {ratio:.3f}"
                         f"{target if parts == 2 else ''}")
    for parts in PARTS:
        depth, width = _find(rows, SPATIAL, (parts, 1, 1)), _find(rows, SPATIAL, (1, 1, parts))
        ref = _reference(rows, parts * depth["cfg"].threads)
        faster = "depth" if depth["step_s"] < width["step_s"] else "width"
        lines.append(f"- P={parts}: step time depth / width {depth['step_s'] / width['step_s']:.3f} ({faster} "
                     f"split faster); speed-up over {ref['cfg'].label}: depth {ref['step_s'] / depth['step_s']:.2f}, "
                     f"width {ref['step_s'] / width['step_s']:.2f}")
    for r in (r for r in rows if r["cfg"].kind == SPATIAL):
        ratio = r["measured_bytes"] / r["analytic_bytes"]
        exact = "every rank exact" if r["per_rank_exact"] else "NOT exact per rank"
        lines.append(f"- halo bytes measured / analytical, {r['cfg'].label}: {ratio:.4f} ({exact}; target 1.0: "
                     f"{'met' if ratio == 1.0 and r['per_rank_exact'] else 'MISSED'})")
    print("\n".join(lines))


def print_header(args, num_cores: int, load_before: float) -> None:
    print(f"### Spatial benchmark, {datetime.date.today().isoformat()}\n")
    print(f"Command: `{' '.join(['python', 'benchmarks/spatial.py'] + sys.argv[1:])}`  ")
    print(f"Machine: {num_cores} CPU cores ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
          f"gloo on 127.0.0.1; 1-minute load average {load_before:.1f} before the run, "
          f"{os.getloadavg()[0]:.1f} after; hybridpar from {os.path.dirname(hybridpar.__file__)}.  ")
    print(f"Model: 3 x (Conv3d k3 p1 -> LeakyReLU -> MaxPool3d 2), channels {'-'.join(map(str, CHANNELS))}, "
          f"float32, 1 sample, forward + backward, {args.warmup} warm-up + {args.steps} timed steps; step time = "
          "slowest rank, median over timed steps.  ")
    print("Threads: each of P ranks gets max(1, cores // P); the one-process reference gets the same total "
          "(P x per-rank), so it runs once per total. Peak = VmHWM after the timed steps (reset after warm-up, "
          "MALLOC_MMAP_THRESHOLD_=65536), nothing subtracted; baseline = VmRSS after import and process-group "
          "start, before the model and input are built. Halo bytes: sent by all ranks per step, forward + backward.")


def _check_sizes(sizes: list[int]) -> None:
    """Every slab of every pooled tensor must be even, so pooling needs no halo (``analytical_halo_bytes``)."""
    multiple = 2 ** (len(CHANNELS) - 1) * max(PARTS)
    bad = [s for s in sizes if s % multiple]
    if bad:
        raise SystemExit(f"--sizes {bad}: each size must be a multiple of {multiple} (2^blocks x largest P)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 256], help="global edges S of the sample")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first one traces)")
    parser.add_argument("--quick", action="store_true", help="sanity check: size 32, 1 warm-up, 1 timed step")
    parser.add_argument("--overlap", choices=["auto", "on", "off"], default="auto",
                        help="conv interior / halo overlap in the spatial runs (default: the library's choice)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.steps, args.warmup = [32], 1, 1
    _check_sizes(args.sizes)
    num_cores = len(os.sched_getaffinity(0))
    load_before = os.getloadavg()[0]
    overlap = {"auto": None, "on": True, "off": False}[args.overlap]
    plan = [cfg for size in args.sizes for cfg in configs(size, num_cores, overlap)]
    rows = []
    for i, cfg in enumerate(plan):
        start = time.perf_counter()
        rows.append(summarize(cfg, run_config(cfg, args.warmup, args.steps)))
        print(f"[{i + 1}/{len(plan)}] {cfg.size}^3 {cfg.label}: {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)
    print_header(args, num_cores, load_before)
    for size in args.sizes:
        mine = [r for r in rows if r["cfg"].size == size]
        print_table(size, mine)
        print_ratios(size, mine)


if __name__ == "__main__":
    main()

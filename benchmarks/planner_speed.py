"""How long the planner takes, side by side with its 1-second target, in one run.

Two cases, each analysed once on the meta device and then searched ``--repeats`` times (the median
is reported; the analysis is timed separately, since a model is analysed once and searched for many
device counts, as ``hybridpar simulate`` does):

- GPT-3 175B (96 layers, d_model 12288, sequence 2048) on 4,096 A100-80GB, bfloat16, global batch 1,536;
- CosmoFlow at 512^3 (7 conv blocks) on 2,048 A100-80GB, float32, global batch 64.

    python benchmarks/planner_speed.py            # about 20 s here
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hybridpar.models import cosmoflow, gpt
from hybridpar.plan import graph_of, preset, search_plans

TARGET_S = 1.0


def _cases():
    with torch.device("meta"):
        yield ("GPT-3 175B", gpt(preset="gpt3-175b"), torch.zeros(1, 2048, dtype=torch.long), "bfloat16", 4096, 1536)
        yield ("CosmoFlow 512^3", cosmoflow(size=512), (1, 4, 512, 512, 512), "float32", 2048, 64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = []
    for name, model, example, dtype, devices, batch in _cases():
        start = time.perf_counter()
        graph = graph_of(model, example, dtype)
        analysis = time.perf_counter() - start
        cluster = preset("a100-80").with_devices(devices)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            result = search_plans(graph, None, cluster, global_batch=batch, dtype=dtype)
            times.append(time.perf_counter() - start)
        best = result.plans[0]
        rows.append((name, len(graph.layers), devices, analysis, statistics.median(times), max(times),
                     result.num_candidates, best.describe(), best.prediction.step_time))
    print(f"| model | layers | devices | analysis (s) | search, median (s) | search, slowest (s) | "
          f"median / {TARGET_S:g} s target | candidates | best plan | predicted step (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|")
    for name, layers, devices, analysis, median, slowest, count, plan, step in rows:
        print(f"| {name} | {layers} | {devices:,} | {analysis:.2f} | {median:.3f} | {slowest:.3f} | "
              f"{median / TARGET_S:.2f} | {count:,} | {plan} | {step:.3f} |")
    ok = all(row[4] <= TARGET_S for row in rows)
    print(f"\n{'PASS' if ok else 'FAIL'}: every median search within {TARGET_S:g} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

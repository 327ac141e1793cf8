"""The whole zoo (``tests/support/zoo.py``: 86 tiny models of Hugging Face ``transformers`` and MONAI) under the
search's three best plans and a hand plan on every axis, on 2 or 4 local gloo processes: how many plans equal one
process in float64 (the loss, every gradient, one Adam step), how many are refused before any communication (and
why, by kind), how many fail. The test suite runs 50 of these models (``tests/clients/test_zoo.py``); this runs
them all and prints a table per model and the totals.

    python benchmarks/zoo.py --world 2          # about 10 minutes here
    python benchmarks/zoo.py --world 4 --models hf-llama hf-t5
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "tests")]

from hybridpar.errors import HybridparError  # noqa: E402
from support import zoo_runs  # noqa: E402
from support.harness import Pool  # noqa: E402
from support.zoo import ZOO  # noqa: E402


def kind_of(message: str) -> str:
    """A refusal's kind: its message with the names taken out, cut short."""
    return re.sub(r"'[^']*'|\d+", "_", message)[:70]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, choices=(2, 4), default=2)
    parser.add_argument("--models", nargs="*", default=sorted(ZOO))
    args = parser.parse_args()
    pool = Pool(args.world)
    totals, refusals = collections.Counter(), collections.Counter()
    print(f"{'model':22s} {'exact':>5s} {'refused':>7s} {'failed':>6s}  plans")
    try:
        for name in args.models:
            counts, described = collections.Counter(), []
            try:
                plans = zoo_runs.plans_of(name, args.world)
            except HybridparError as err:  # the analysis itself refused (a router that branches on the weights)
                counts["refused"] += 1
                refusals[kind_of(str(err))] += 1
                plans = {}
            for plan in plans.values():
                try:
                    kind, detail = zoo_runs.outcome(pool.run(zoo_runs.run, timeout=300, name=name,
                                                             plan_json=plan.to_json()))
                except AssertionError as err:
                    kind, detail = "failed", str(err).splitlines()[-1]
                counts[kind] += 1
                if kind == "refused":
                    refusals[kind_of(detail)] += 1
                described.append(f"{plan.describe()}: {kind}")
            totals.update(counts)
            print(f"{name:22s} {counts['exact']:5d} {counts['refused']:7d} {counts['failed']:6d}  "
                  f"{'; '.join(described)}", flush=True)
    finally:
        pool.close()
    print(f"\n{len(args.models)} models on {args.world} processes: {totals['exact']} plans exact, "
          f"{totals['refused']} refused, {totals['failed']} failed")
    for kind, count in refusals.most_common():
        print(f"  {count:4d} refused: {kind}")
    return 1 if totals["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())

"""What the ``hybridpar`` commands parse: the one place that turns the text of a flag into a value, and the
flags that several commands share (``--model``, ``--input``, ``--input-dtype``, ``--cluster``, ``--dtype``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridpar.errors import HybridparError

INPUT_DTYPES = ("int64", "int32", "float32", "float64", "bfloat16", "float16")
DTYPES = ("float32", "bfloat16", "float16", "float64")
CLUSTER_HELP = ("a preset (v100, a100-40, a100-80, h100, h200, mi250x) or a cluster TOML file "
                "(hybridpar calibrate writes one; [[group]] tables of nodes for mixed devices)")


def integers(text: str, sep: str = ",") -> tuple[int, ...]:
    """``"2,1,1"`` -> ``(2, 1, 1)``; ``()`` for text that is not whole numbers joined by ``sep``."""
    try:
        return tuple(int(p) for p in text.lower().split(sep))
    except ValueError:
        return ()


def parts(text: str) -> tuple[int, ...]:
    """Part counts per spatial dim: ``2,1,1``."""
    grid = integers(text)
    if not grid or min(grid) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give part counts >= 1 separated by commas, e.g. 2,1,1")
    return grid


def positive(text: str) -> int:
    value = integers(text)
    if len(value) != 1 or value[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least 1")
    return value[0]


def non_negative(text: str) -> int:
    value = integers(text)
    if len(value) != 1 or value[0] < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of at least 0")
    return value[0]


def output_file(text: str, overwrite: bool, example: str, parents: bool = False) -> Path:
    """The file ``--out`` names, checked before any work: not a folder, not a file that exists unless
    ``overwrite``, in a folder that exists (``parents``: or that the command creates). ``example``: a file name
    to suggest inside a folder."""
    out = Path(text)
    if out.is_dir():
        raise HybridparError(f"--out {text}: a folder, not a file; give the file to write, e.g. --out "
                             f"{out / example}")
    if out.exists() and not overwrite:
        raise HybridparError(f"{out} exists; pass --overwrite to replace it, or choose another --out")
    if not parents and not out.parent.is_dir():
        raise HybridparError(f"--out {text}: folder {out.parent} does not exist; create it, or choose another --out")
    return out


def shape(text: str) -> tuple[int, ...]:
    """``1x4x128x128x128`` -> ``(1, 4, 128, 128, 128)``."""
    dims = integers(text, "x")
    if not dims or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give the input shape as sizes joined by x, batch first, "
                                         "e.g. 1x4x128x128x128")
    return dims


def levels(text: str) -> tuple[int, ...]:
    """ZeRO levels: ``0,1,2,3``, sorted and distinct."""
    found = tuple(sorted(set(integers(text))))
    if not found or any(level not in (0, 1, 2, 3) for level in found):
        raise argparse.ArgumentTypeError(f"{text!r}: give ZeRO levels among 0,1,2,3 separated by commas")
    return found


def device_counts(text: str) -> tuple[int, ...]:
    """``8,16,32`` or ``8:4096`` (doubling from 8 to 4096), or both mixed: ``1,2,8:64``; sorted, distinct."""
    counts: set[int] = set()
    for item in text.split(","):
        first, colon, last = item.strip().partition(":")
        try:
            lo, hi = int(first), int(last if colon else first)
        except ValueError:
            lo = hi = 0
        if lo < 1 or hi < lo:
            raise HybridparError(f"--devices {text!r}: give device counts >= 1 separated by commas (8,16,32) or a "
                                 "doubling range FIRST:LAST (8:4096 is 8, 16, ..., 4096)")
        n = lo
        while n < hi:
            counts.add(n)
            n *= 2
        if n != hi:
            raise HybridparError(f"--devices {item.strip()!r}: {hi} is not {lo} doubled a whole number of times; "
                                 f"end the range at {n // 2} or {n}")
        counts.add(hi)
    return tuple(sorted(counts))


def add_model_arguments(p, example: str) -> None:
    """``--model``, ``--input`` and ``--input-dtype``, as ``plan`` and ``simulate`` take them."""
    p.add_argument("--model", required=True,
                   help="cosmoflow, unet3d, a GPT preset (gpt2-small ... gpt3-175b) or pkg.module:factory")
    p.add_argument("--input", type=shape, required=True, help=f"example input, batch first, e.g. {example}")
    p.add_argument("--input-dtype", default="auto", choices=("auto", *INPUT_DTYPES),
                   help="of a pkg.module:factory model's input: auto (default) gives token ids (int64) to a model "
                        "whose first module is an nn.Embedding, floats of --dtype to any other")

"""Measured rates the planner interpolates: FLOP/s of convolutions over a grid of channels and positions
(``ConvRate``), bytes/s of memory-bound layers over sizes (``OpRate``), and the checks of every measured number."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from hybridpar.errors import ClusterError

DTYPES = ("float64", "float32", "tfloat32", "bfloat16", "float16")  # tfloat32: float32 convs on tensor cores


def check_positive(label: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ClusterError(f"{label} = {value!r}: must be a positive, finite number")


def check_count(label: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ClusterError(f"{label} = {value!r}: must be a whole number >= 1")


@dataclass(frozen=True, order=True)
class ConvRate:
    """Measured FLOP/s of a 3x3x3, stride-1 convolution in ``dtype`` from ``in_channels`` to ``out_channels``
    over ``positions`` output positions (``N·D·H·W``): its forward, its input gradient and its weight gradient
    (each counted as the forward's FLOPs)."""

    dtype: str
    in_channels: int
    out_channels: int
    positions: int
    forward: float
    input_grad: float
    weight_grad: float

    def __post_init__(self):
        where = f"conv_rates[{self.dtype}, {self.in_channels} -> {self.out_channels}, {self.positions} positions]"
        if self.dtype not in DTYPES:
            raise ClusterError(f"{where}: unknown dtype {self.dtype!r}; use {', '.join(DTYPES)}")
        for field in ("in_channels", "out_channels", "positions"):
            check_count(f"{where}.{field}", getattr(self, field))
        for field in ("forward", "input_grad", "weight_grad"):
            check_positive(f"{where}.{field}", getattr(self, field))

    @property
    def point(self) -> tuple[int, int, int]:
        return self.in_channels, self.out_channels, self.positions


@dataclass(frozen=True, order=True)
class OpRate:
    """Measured bytes/s of a layer ``op`` (a module class such as ``"MaxPool3d"``, or a function such as
    ``"add"``, as the model analysis names it) whose forward reads and writes ``bytes``: its forward and its
    backward, each as the layer's forward bytes per second. Several sizes of one op interpolate (caches)."""

    op: str
    bytes: int
    forward: float
    backward: float

    def __post_init__(self):
        if not isinstance(self.op, str) or not self.op:
            raise ClusterError(f"op_rates: op = {self.op!r}: give the layer's op, e.g. \"MaxPool3d\"")
        check_count(f"op_rates[{self.op}].bytes", self.bytes)
        for field in ("forward", "backward"):
            check_positive(f"op_rates[{self.op}, {self.bytes} bytes].{field}", getattr(self, field))


def log2_weights(logs: tuple[float, ...], value: float) -> tuple[tuple[int, float], ...]:
    """Linear interpolation weights of ``value`` among the sorted points whose log2 are ``logs``, in log2
    space, clamped at the ends."""
    x = math.log2(max(value, 1))
    if x <= logs[0]:
        return ((0, 1.0),)
    if x >= logs[-1]:
        return ((len(logs) - 1, 1.0),)
    k = next(i for i, p in enumerate(logs) if p >= x)
    t = (x - logs[k - 1]) / (logs[k] - logs[k - 1])
    return ((k - 1, 1 - t), (k, t))


def log2s(points) -> tuple[float, ...]:
    return tuple(math.log2(p) for p in points)


def interpolate(table, in_channels: int, out_channels: int, positions: float) -> tuple[float, float, float]:
    """The rates of a conv grid (``ClusterSpec._conv_grids``) at a point: log rates, trilinear in log2 of the
    axes, clamped at the grid's ends."""
    axes, logs = table
    out = [0.0, 0.0, 0.0]
    for (i, a), (j, b), (k, c) in itertools.product(log2_weights(axes[0], in_channels),
                                                    log2_weights(axes[1], out_channels),
                                                    log2_weights(axes[2], positions)):
        for q, log_rate in enumerate(logs[i, j, k]):
            out[q] += a * b * c * log_rate
    return tuple(math.exp(v) for v in out)

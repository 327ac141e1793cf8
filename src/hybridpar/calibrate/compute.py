"""Compute rates: matmul, conv (fast and slow kernels, over a grid of channels and positions), memory bandwidth
and the memory-bound layers."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hybridpar.calibrate.settings import CONV_INPUT, CONV_KERNEL, LARGE_FACTOR, MATMUL_EDGE, MEMORY_BYTES, Settings
from hybridpar.calibrate.timing import timed_rates


class _Join(nn.Module):
    """A tensor operation between modules, ``x + x`` or ``cat([x, x])``, after an ``Identity`` (a container, so
    that the model analysis sees the operation as a layer of its own, as in a real model)."""

    def __init__(self, fn):
        super().__init__()
        self.source = nn.Identity()
        self.fn = fn

    def forward(self, x):
        return self.fn(self.source(x))


# Sizes of the memory-bound layers measured, by (quick, large): an (N, C, D, H, W) volume of 4 MiB of float32
# (past the L2 caches, inside a large L3) and one of 32 MiB (past the caches); rows of a transformer.
VOLUMES = {(False, False): (2, 16, 32, 32, 32), (False, True): (4, 16, 64, 64, 32),
           (True, False): (2, 16, 16, 16, 16), (True, True): (2, 16, 32, 32, 32)}
ROWS = {(False, False): (1024, 1024), (False, True): (4096, 2048), (True, False): (256, 256),
        (True, True): (1024, 1024)}


def _half(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape[:2] + tuple(n // 2 for n in shape[2:])


# The memory-bound layers measured for `op_rates`, each ``(quick, large) -> (module, input shape)``: pooling and
# normalisation run below the memory bandwidth on CPUs, and so do a transposed conv of stride 2 and a 1x1 conv.
OP_BENCHMARKS = (
    lambda k: (nn.MaxPool3d(2), VOLUMES[k]),
    lambda k: (nn.AvgPool3d(2), VOLUMES[k]),
    lambda k: (nn.AdaptiveAvgPool3d(1), VOLUMES[k]),
    lambda k: (nn.BatchNorm3d(16), VOLUMES[k]),
    lambda k: (nn.InstanceNorm3d(16), VOLUMES[k]),
    lambda k: (nn.GroupNorm(4, 16), VOLUMES[k]),
    lambda k: (nn.ReLU(), VOLUMES[k]),
    lambda k: (nn.LeakyReLU(0.3), VOLUMES[k]),
    lambda k: (nn.ConvTranspose3d(16, 16, 2, stride=2), _half(VOLUMES[k])),
    lambda k: (nn.Conv3d(16, 4, 1), VOLUMES[k]),
    lambda k: (_Join(lambda x: x + x), VOLUMES[k]),
    lambda k: (_Join(lambda x: torch.cat([x, x], 1)), VOLUMES[k]),
    lambda k: (nn.LayerNorm(ROWS[k][1]), ROWS[k]),
    lambda k: (nn.GELU(), ROWS[k]),
)


def measure_compute(settings: Settings) -> dict:
    """Throughputs of matmul, conv3d (one wide conv, the ``conv_rates`` grid and its large row, the slow
    batch-1 kernel where there is one: ``Method.slow_conv``), an elementwise add and the memory-bound ops of
    ``OP_BENCHMARKS``, on ``settings.device``. Each group is measured with its repeats interleaved, so that a
    slow moment of the machine slows a group's points alike, and its tensors are freed before the next group's
    are made (all at once, 4 workers outgrew this machine's 24 GiB). Each backward pass is timed alone, on a
    forward kept for it."""
    dtype, device = getattr(torch, settings.dtype), torch.device(settings.device)
    torch.manual_seed(dist.get_rank())
    matmul, conv, memory = timed_rates(_basic_steps(dtype, device), settings)
    result = {"matmul_flops": matmul, "conv_flops": conv, "memory_bandwidth": memory}
    rates = dict(zip(settings.conv_grid, _conv_rates(settings.conv_grid, dtype, settings)))
    large_points = [(cin, cout, LARGE_FACTOR * settings.largest_positions) for cin, cout in settings.large_conv_pairs]
    large = dict(zip(settings.large_conv_pairs, _conv_rates(large_points, dtype, settings)))
    result["conv_rates"] = [(*point, *r) for point, r in rates.items()] + _large_row(settings, rates, large)
    slow_grid = settings.slow_conv_grid if settings.method.slow_conv else ()
    slow = _conv_rates(slow_grid, dtype, settings, batch=1)
    result["slow_conv_rates"] = [(*point, *r) for point, r in zip(slow_grid, slow)]
    ops = [_op_steps(make, (settings.quick, big), dtype, device) for make in OP_BENCHMARKS for big in (False, True)]
    op_rates = iter(timed_rates([step for _, steps in ops for step in steps], settings))
    result["op_rates"] = [(*op, next(op_rates), next(op_rates)) for op, _ in ops]
    return result


def _basic_steps(dtype: torch.dtype, device: torch.device) -> list[tuple[float, Callable]]:
    """A matmul (FLOPs), one wide conv forward and backward (FLOPs) and an add into a fresh tensor (bytes)."""
    n, on = MATMUL_EDGE, dict(dtype=dtype, device=device)
    a, b, c = torch.randn(n, n, **on), torch.randn(n, n, **on), torch.empty(n, n, **on)
    x, y = (torch.ones(MEMORY_BYTES // a.element_size(), **on) for _ in range(2))
    return [(2 * n**3, lambda: torch.mm(a, b, out=c)), _conv_step(dtype, device),
            (3 * MEMORY_BYTES, lambda: torch.add(x, y))]


def _conv_rates(points, dtype: torch.dtype, settings: Settings, batch: int = 2) -> list[tuple[float, float, float]]:
    """FLOP/s of the forward, input gradient and weight gradient of a conv at each (in, out, positions)."""
    if not points:
        return []
    steps = []
    for point in points:
        flops, fns = _conv_steps(*point, dtype, torch.device(settings.device), batch=batch)
        steps += [(flops, fn) for fn in fns]
    rates = timed_rates(steps, settings)
    return [tuple(rates[i:i + 3]) for i in range(0, len(rates), 3)]


def _large_row(settings: Settings, rates: dict, measured: dict) -> list[tuple]:
    """The ``conv_rates`` rows at ``LARGE_FACTOR`` times the grid's largest positions: ``measured`` (in, out) pairs
    as measured, every other pair its largest row scaled by what the step costs the measured pair nearest in log2
    of both channel counts."""
    largest = settings.largest_positions
    rows = []
    for cin, cout, positions in settings.conv_grid:
        if positions != largest:
            continue
        if (cin, cout) in measured:
            rows.append((cin, cout, LARGE_FACTOR * largest, *measured[cin, cout]))
            continue
        near = min(measured, key=lambda p: abs(math.log2(p[0] / cin)) + abs(math.log2(p[1] / cout)))
        ratios = (b / a for a, b in zip(rates[(*near, largest)], measured[near]))
        rows.append((cin, cout, LARGE_FACTOR * largest, *(r * q for r, q in zip(rates[cin, cout, largest], ratios))))
    return rows


def _conv_steps(in_channels: int, out_channels: int, positions: int, dtype: torch.dtype, device: torch.device,
                batch: int = 2):
    """Forward FLOPs of a 3x3x3 conv from ``in_channels`` to ``out_channels`` over ``positions`` output
    positions in a batch of ``batch`` (two: PyTorch's fast CPU kernel; one: its slow kernel, called by name so
    that it runs at every size), and three timed functions: its forward, its input gradient, its weight
    gradient (each backward alone, on a forward kept for it)."""
    dims, on = _conv_dims(positions // batch), dict(dtype=dtype, device=device)
    x = torch.randn(batch, in_channels, *dims, **on)
    k = CONV_KERNEL
    w = torch.randn(out_channels, in_channels, k, k, k, **on) / (in_channels * k**3) ** 0.5
    grad_out = torch.randn(batch, out_channels, *dims, **on)
    flops = 2 * batch * math.prod(dims) * out_channels * in_channels * k**3

    def conv(x, w):
        if batch == 1:  # what F.conv3d runs for one sample of small N*C*D*H
            return torch.ops.aten.slow_conv3d(x, w, [k] * 3, None, [1] * 3, [k // 2] * 3)
        return F.conv3d(x, w, padding=k // 2)

    return flops, [lambda: conv(x, w), *_backward_steps(conv, (x, w), grad_out, separate=True)]


def _backward_steps(fn, inputs, grad_out, separate: bool) -> list:
    """Timed backward passes of ``fn(*inputs)``, on one forward kept for them: the gradient of each input
    apart (``separate``) or of all of them at once."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    groups = [(t,) for t in leaves] if separate else [tuple(leaves)]
    return [lambda wrt=wrt: torch.autograd.grad(out, wrt, grad_out, retain_graph=True) for wrt in groups]


def _conv_dims(volume: int) -> tuple[int, int, int]:
    """A (D, H, W) of ``volume`` (a power of two) as near a cube as powers of two allow, W the longest."""
    e = round(math.log2(volume))
    d = e // 3
    return 2**d, 2 ** ((e - d) // 2), 2 ** (e - d - (e - d) // 2)


def _op_steps(make, key: tuple[bool, bool], dtype: torch.dtype, device: torch.device):
    """The op of the (last) layer ``make(key)`` builds and the bytes its forward reads and writes, both as
    the planner's model analysis sees them, and two timed functions, each with those bytes: its forward; its
    backward (the gradients of the input and of any weight, on a forward kept for it)."""
    from hybridpar.ir.analysis import analyse

    module, shape = make(key)
    module = module.to(dtype)
    layer = analyse(module, shape, dtype).layers[-1]
    module = module.to(device)
    x = torch.randn(shape, dtype=dtype, device=device)
    params = [p for p in module.parameters() if p.requires_grad]
    names = [name for name, p in module.named_parameters() if p.requires_grad]

    def call(x, *weights):
        return torch.func.functional_call(module, dict(zip(names, weights)), (x,))

    grad_out = torch.randn_like(module(x))
    steps = [lambda: module(x), *_backward_steps(call, [x, *params], grad_out, separate=False)]
    return (layer.op, int(layer.bytes_moved)), [(layer.bytes_moved, step) for step in steps]


def _conv_step(dtype: torch.dtype, device: torch.device):
    """FLOPs and a function doing one conv3d forward and backward (input and weight gradients)."""
    batch, channels, *spatial = CONV_INPUT
    k, on = CONV_KERNEL, dict(dtype=dtype, device=device)
    x = torch.randn(*CONV_INPUT, **on, requires_grad=True)
    w = (torch.randn(channels, channels, k, k, k, **on) / (channels * k**3) ** 0.5).requires_grad_()
    grad_out = torch.randn(*CONV_INPUT, **on)  # padding 1 keeps the spatial size
    forward = 2 * batch * channels * (spatial[0] * spatial[1] * spatial[2]) * channels * k**3

    def step():
        out = F.conv3d(x, w, padding=k // 2)
        torch.autograd.grad(out, (x, w), grad_out)

    return 3 * forward, step

"""The MLPerf HPC CosmoFlow network (mlcommons/hpc, ``cosmoflow/models/cosmoflow.py``), in PyTorch.

Blocks of Conv3d (``same`` padding) -> [BatchNorm3d] -> LeakyReLU(0.3) -> MaxPool3d(2), as many as halve
the input edge down to 4, with ``base_channels * 2**i`` channels (uncapped, as in the reference). Then
Flatten, ``(Linear -> LeakyReLU -> Dropout)`` per ``fc_sizes``, Linear to ``num_outputs``, tanh and x1.2
(the reference's ``scale_1p2``, so that targets in [-1, 1] lie inside tanh's range). Weights start as in
Keras: Glorot-uniform, zero bias. The MLPerf config is ``cosmoflow(dropout=0.5)``.

Two options leave the reference for controlled experiments: ``num_blocks`` fixes the number of conv blocks
whatever the edge, and ``pooling="average"`` replaces the flatten of the last feature map by its global
average (``AdaptiveAvgPool3d(1)``), so that one network, with the same parameters, takes samples of any
edge divisible by ``2**num_blocks`` and averages its features over more volume the larger the sample.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hybridpar.errors import HybridparError

LEAKY_SLOPE = 0.3  # Keras' LeakyReLU default, which the reference uses
OUTPUT_SCALE = 1.2
FINAL_EDGE = 4
SIZES = tuple(2**k for k in range(5, 10))  # 32 ... 512
POOLINGS = ("flatten", "average")


class Scale(nn.Module):
    """Multiply by a constant (the reference's ``Lambda(scale_1p2)``)."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor

    def extra_repr(self) -> str:
        return f"factor={self.factor}"


class CosmoFlow(nn.Module):
    """``features``: the conv blocks on the volume; ``head``: flatten (or global average) and the dense layers."""

    def __init__(self, size: int = 128, in_channels: int = 4, base_channels: int = 32, kernel_size: int = 3,
                 fc_sizes: tuple[int, ...] = (128, 64), num_outputs: int = 4, dropout: float = 0.0,
                 batch_norm: bool = False, num_blocks: int = 0, pooling: str = "flatten"):
        super().__init__()
        _check_args(size, in_channels, base_channels, kernel_size, fc_sizes, num_outputs, dropout, batch_norm,
                    num_blocks, pooling)
        self.size, self.pooling = size, pooling
        self.num_blocks = num_blocks or size.bit_length() - FINAL_EDGE.bit_length()  # log2(size) - 2
        self.features = _features(self.num_blocks, in_channels, base_channels, kernel_size, batch_norm)
        last_width = base_channels * 2 ** (self.num_blocks - 1)
        final_edge = size >> self.num_blocks
        in_features = last_width * (final_edge**3 if pooling == "flatten" else 1)
        self.head = _head(in_features, tuple(fc_sizes), num_outputs, dropout, pooling)
        _init_like_keras(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (N, C, S, S, S) -> (N, base * 2**(blocks - 1), S / 2**blocks, ...) -> (N, num_outputs)
        return self.head(self.features(x))

    def check_input_size(self, size: int) -> None:
        """Raise unless the model takes input edge ``size``: the edge it was built for (flatten), or any
        edge the conv blocks halve exactly (average pooling)."""
        if self.pooling == "average" and size % 2**self.num_blocks == 0 and size > 0:
            return
        if size != self.size:
            raise HybridparError(f"CosmoFlow(size={self.size}) got an input edge of {size}; build it with "
                                 f"size={size} or crop the samples to {self.size}")


def cosmoflow(size: int = 128, in_channels: int = 4, base_channels: int = 32, kernel_size: int = 3,
              fc_sizes: tuple[int, ...] = (128, 64), num_outputs: int = 4, dropout: float = 0.0,
              batch_norm: bool = False, num_blocks: int = 0, pooling: str = "flatten") -> CosmoFlow:
    """CosmoFlow for cubic inputs of edge ``size``; ``batch_norm`` adds BatchNorm3d after each conv;
    ``num_blocks`` (0: halve the edge down to 4) and ``pooling`` (``"flatten"`` or ``"average"``)."""
    return CosmoFlow(size, in_channels, base_channels, kernel_size, fc_sizes, num_outputs, dropout, batch_norm,
                     num_blocks, pooling)


def _features(num_blocks: int, in_channels: int, base_channels: int, kernel_size: int,
              batch_norm: bool) -> nn.Sequential:
    layers, c_in = [], in_channels
    for i in range(num_blocks):
        c_out = base_channels * 2**i
        layers.append(nn.Conv3d(c_in, c_out, kernel_size, padding="same", bias=not batch_norm))
        layers += [nn.BatchNorm3d(c_out)] if batch_norm else []
        layers += [nn.LeakyReLU(LEAKY_SLOPE), nn.MaxPool3d(2)]
        c_in = c_out
    return nn.Sequential(*layers)


def _head(in_features: int, fc_sizes: tuple[int, ...], num_outputs: int, dropout: float,
          pooling: str) -> nn.Sequential:
    layers = ([nn.AdaptiveAvgPool3d(1)] if pooling == "average" else []) + [nn.Flatten()]
    for width in fc_sizes:
        layers += [nn.Linear(in_features, width), nn.LeakyReLU(LEAKY_SLOPE), nn.Dropout(dropout)]
        in_features = width
    layers += [nn.Linear(in_features, num_outputs), nn.Tanh(), Scale(OUTPUT_SCALE)]
    return nn.Sequential(*layers)


def _init_like_keras(model: nn.Module) -> None:
    """Glorot-uniform weights and zero biases, the Keras defaults the reference trains from."""
    for m in model.modules():
        if isinstance(m, (nn.Conv3d, nn.Linear)):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_args(size, in_channels, base_channels, kernel_size, fc_sizes, num_outputs, dropout, batch_norm,
                num_blocks, pooling):
    if not _is_int(size) or size not in SIZES:
        raise HybridparError(f"cosmoflow: size={size!r} is not a power of two in [32, 512]; use one of {SIZES} "
                             "(the input edge, which the conv blocks halve down to 4)")
    if not _is_int(num_blocks) or not 0 <= num_blocks <= size.bit_length() - 1:
        raise HybridparError(f"cosmoflow: num_blocks={num_blocks!r} must be an integer in [0, "
                             f"{size.bit_length() - 1}] for size={size} (0: halve the edge down to 4)")
    if pooling not in POOLINGS:
        raise HybridparError(f"cosmoflow: pooling={pooling!r} must be one of {POOLINGS}")
    counts = dict(in_channels=in_channels, base_channels=base_channels, kernel_size=kernel_size,
                  num_outputs=num_outputs)
    for name, value in counts.items():
        if not _is_int(value) or value < 1:
            raise HybridparError(f"cosmoflow: {name}={value!r} must be an integer >= 1")
    if not isinstance(fc_sizes, (tuple, list)) or not all(_is_int(w) and w >= 1 for w in fc_sizes):
        raise HybridparError(f"cosmoflow: fc_sizes={fc_sizes!r} must be a tuple of widths >= 1, e.g. (128, 64)")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise HybridparError(f"cosmoflow: dropout={dropout!r} must be a probability in [0, 1), e.g. 0.5")
    if not isinstance(batch_norm, bool):
        raise HybridparError(f"cosmoflow: batch_norm={batch_norm!r} must be True or False")

"""The MLPerf HPC CosmoFlow network (mlcommons/hpc, ``cosmoflow/models/cosmoflow.py``), in PyTorch.

Blocks of Conv3d (``same`` padding) -> [BatchNorm3d] -> LeakyReLU(0.3) -> MaxPool3d(2), as many as halve
the input edge down to 4, with ``base_channels * 2**i`` channels (uncapped, as in the reference). Then
Flatten, ``(Linear -> LeakyReLU -> Dropout)`` per ``fc_sizes``, Linear to ``num_outputs``, tanh and x1.2
(the reference's ``scale_1p2``, so that targets in [-1, 1] lie inside tanh's range). Weights start as in
Keras: Glorot-uniform, zero bias. The MLPerf config is ``cosmoflow(dropout=0.5)``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hybridpar.errors import HybridparError

LEAKY_SLOPE = 0.3  # Keras' LeakyReLU default, which the reference uses
OUTPUT_SCALE = 1.2
FINAL_EDGE = 4
SIZES = tuple(2**k for k in range(5, 10))  # 32 ... 512


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
    """``features``: the conv blocks on the volume; ``head``: Flatten and the dense layers."""

    def __init__(self, size: int = 128, in_channels: int = 4, base_channels: int = 32, kernel_size: int = 3,
                 fc_sizes: tuple[int, ...] = (128, 64), num_outputs: int = 4, dropout: float = 0.0,
                 batch_norm: bool = False):
        super().__init__()
        _check_args(size, in_channels, base_channels, kernel_size, fc_sizes, num_outputs, dropout, batch_norm)
        self.size = size
        num_blocks = size.bit_length() - FINAL_EDGE.bit_length()  # log2(size) - 2
        self.features = _features(num_blocks, in_channels, base_channels, kernel_size, batch_norm)
        last_width = base_channels * 2 ** (num_blocks - 1)
        self.head = _head(last_width * FINAL_EDGE**3, tuple(fc_sizes), num_outputs, dropout)
        _init_like_keras(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (N, C, S, S, S) -> (N, base * 2**(blocks - 1), 4, 4, 4) -> (N, num_outputs)
        return self.head(self.features(x))

    def check_input_size(self, size: int) -> None:
        """Raise unless ``size`` is the input edge this model was built for."""
        if size != self.size:
            raise HybridparError(f"CosmoFlow(size={self.size}) got an input edge of {size}; build it with "
                                 f"size={size} or crop the samples to {self.size}")


def cosmoflow(size: int = 128, in_channels: int = 4, base_channels: int = 32, kernel_size: int = 3,
              fc_sizes: tuple[int, ...] = (128, 64), num_outputs: int = 4, dropout: float = 0.0,
              batch_norm: bool = False) -> CosmoFlow:
    """CosmoFlow for cubic inputs of edge ``size``; ``batch_norm`` adds BatchNorm3d after each conv."""
    return CosmoFlow(size, in_channels, base_channels, kernel_size, fc_sizes, num_outputs, dropout, batch_norm)


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


def _head(in_features: int, fc_sizes: tuple[int, ...], num_outputs: int, dropout: float) -> nn.Sequential:
    layers = [nn.Flatten()]
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


def _check_args(size, in_channels, base_channels, kernel_size, fc_sizes, num_outputs, dropout, batch_norm):
    if not _is_int(size) or size not in SIZES:
        raise HybridparError(f"cosmoflow: size={size!r} is not a power of two in [32, 512]; use one of {SIZES} "
                             "(the input edge, which the conv blocks halve down to 4)")
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

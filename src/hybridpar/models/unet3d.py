"""A 3D U-Net for volumetric segmentation.

``depth`` resolution levels with ``base_channels * 2**i`` channels. Each level runs ``convs_per_level``
x (Conv3d k3 -> norm -> ReLU); MaxPool3d(2) goes down a level, ConvTranspose3d(k2, s2) comes up,
halving the channels, and its output is concatenated after the skip of the same level. A final 1x1x1
conv gives ``num_classes`` logits per voxel. Convs followed by a norm have no bias (the norm's shift
replaces it). Every input edge must be a multiple of ``input_multiple = 2 ** (depth - 1)``;
``forward`` does not check it, since under spatial parallelism it sees slabs: call ``check_input_size``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from hybridpar.errors import HybridparError

NORMS = ("instance", "batch", "none")


class UNet3D(nn.Module):
    """``encoders[i]``: level ``i`` going down; ``ups[j]``, ``decoders[j]``: coming up, deepest first."""

    def __init__(self, in_channels: int = 1, num_classes: int = 3, base_channels: int = 16, depth: int = 3,
                 norm: str = "instance", convs_per_level: int = 2):
        super().__init__()
        _check_args(in_channels, num_classes, base_channels, depth, norm, convs_per_level)
        self.depth = depth
        self.input_multiple = 2 ** (depth - 1)
        widths = [base_channels * 2**i for i in range(depth)]
        self.encoders = nn.ModuleList(_level(c_in, c, convs_per_level, norm)
                                      for c_in, c in zip([in_channels] + widths[:-1], widths))
        self.pool = nn.MaxPool3d(2)
        up_levels = range(depth - 2, -1, -1)
        self.ups = nn.ModuleList(nn.ConvTranspose3d(widths[i + 1], widths[i], 2, stride=2) for i in up_levels)
        self.decoders = nn.ModuleList(_level(2 * widths[i], widths[i], convs_per_level, norm) for i in up_levels)
        self.out = nn.Conv3d(base_channels, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for encoder in self.encoders[:-1]:
            x = encoder(x)  # (N, base * 2**i, S / 2**i, ...)
            skips.append(x)
            x = self.pool(x)
        x = self.encoders[-1](x)  # (N, base * 2**(depth - 1), S / 2**(depth - 1), ...)
        for up, decoder in zip(self.ups, self.decoders):
            x = decoder(torch.cat([skips.pop(), up(x)], dim=1))
        return self.out(x)  # (N, num_classes, S, ...)

    def check_input_size(self, size: int) -> None:
        """Raise unless an input edge of ``size`` halves evenly down to the deepest level."""
        m = self.input_multiple
        if size < m or size % m:
            raise HybridparError(
                f"UNet3D(depth={self.depth}): input edge {size!r} is not a multiple of {m} (2 ** (depth - 1)); "
                f"crop or pad the volume to a multiple of {m}, or use a smaller depth"
            )


def unet3d(in_channels: int = 1, num_classes: int = 3, base_channels: int = 16, depth: int = 3,
           norm: str = "instance", convs_per_level: int = 2) -> UNet3D:
    """A 3D U-Net; ``norm`` is one of ``NORMS``: InstanceNorm3d(affine=True), BatchNorm3d or none."""
    return UNet3D(in_channels, num_classes, base_channels, depth, norm, convs_per_level)


def _level(c_in: int, c_out: int, num_convs: int, norm: str) -> nn.Sequential:
    """``num_convs`` x (Conv3d k3 -> norm -> ReLU), from ``c_in`` to ``c_out`` channels."""
    layers = []
    for i in range(num_convs):
        layers.append(nn.Conv3d(c_in if i == 0 else c_out, c_out, 3, padding=1, bias=norm == "none"))
        if norm == "instance":
            layers.append(nn.InstanceNorm3d(c_out, affine=True))
        elif norm == "batch":
            layers.append(nn.BatchNorm3d(c_out))
        layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _check_args(in_channels, num_classes, base_channels, depth, norm, convs_per_level):
    counts = dict(in_channels=in_channels, num_classes=num_classes, base_channels=base_channels, depth=depth,
                  convs_per_level=convs_per_level)
    for name, value in counts.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise HybridparError(f"unet3d: {name}={value!r} must be an integer >= 1")
    if not isinstance(norm, str) or norm not in NORMS:
        raise HybridparError(f"unet3d: norm={norm!r} is not one of {', '.join(map(repr, NORMS))}")

"""Small networks for the tests: a CosmoFlow-like regressor and a U-Net-like segmenter."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyCosmoFlow(nn.Module):
    """conv3d + LeakyReLU + maxpool blocks, flatten, dense head with dropout, 4 outputs."""

    def __init__(self, size: int = 16, channels: int = 2, width: int = 4, batch_norm: bool = False,
                 dropout: float = 0.5):
        super().__init__()
        layers, c = [], channels
        for _ in range(2):
            layers += [nn.Conv3d(c, width, 3, padding=1)]
            layers += [nn.BatchNorm3d(width)] if batch_norm else []
            layers += [nn.LeakyReLU(0.3), nn.MaxPool3d(2)]
            c = width
        self.features = nn.Sequential(*layers)
        edge = size // 4
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(width * edge**3, 8), nn.LeakyReLU(0.3),
                                  nn.Dropout(dropout), nn.Linear(8, 4), nn.Tanh())

    def forward(self, x):
        return self.head(self.features(x))


class TinyUNet(nn.Module):
    """Two levels: encoder conv blocks, maxpool, transposed-conv up-sampling, skip concatenation."""

    def __init__(self, channels: int = 1, width: int = 4, classes: int = 3, norm: str = "instance"):
        super().__init__()
        norm_cls = {"instance": lambda c: nn.InstanceNorm3d(c, affine=True), "batch": nn.BatchNorm3d}[norm]

        def block(cin, cout):
            return nn.Sequential(nn.Conv3d(cin, cout, 3, padding=1), norm_cls(cout), nn.ReLU())

        self.enc = block(channels, width)
        self.down = nn.MaxPool3d(2)
        self.mid = block(width, 2 * width)
        self.up = nn.ConvTranspose3d(2 * width, width, 2, stride=2)
        self.dec = block(2 * width, width)
        self.out = nn.Conv3d(width, classes, 1)

    def forward(self, x):
        skip = self.enc(x)
        y = self.up(self.mid(self.down(skip)))
        return self.out(self.dec(torch.cat([skip, y], dim=1)))


class NamedConv(nn.Conv3d):
    """A subclass that keeps Conv3d.forward: converted like a Conv3d."""


class Residual(nn.Module):
    """A residual block whose add and activation are functional calls in its own forward."""

    def __init__(self, channels: int = 2):
        super().__init__()
        self.conv = NamedConv(channels, channels, 3, padding=1)
        self.norm = nn.GroupNorm(1, channels)

    def forward(self, x):
        return torch.relu(x + self.norm(self.conv(x)))


class Attention(nn.Module):
    """One fused q/k/v projection: its output holds q, k and v one after another (``sections``), or each head's
    q, k and v together (``heads``, Megatron's layout, which a split by output features cuts into whole heads)."""

    def __init__(self, d=16, heads=4, layout="sections"):
        super().__init__()
        self.heads, self.layout = heads, layout
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):  # (B, T, d)
        b, t, d = x.shape
        if self.layout == "heads":
            # the head count from the tensor (-1): a rank holding some heads' q, k and v views its own
            q, k, v = self.qkv(x).view(b, t, -1, 3, d // self.heads).permute(3, 0, 2, 1, 4).unbind(0)
        else:
            q, k, v = self.qkv(x).split(d, dim=2)
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


def tiny_token_model() -> nn.Module:
    """Token ids (B, T) -> logits: an embedding, a Linear, a head (a factory for ``hybridpar plan --model``)."""
    return nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 32))


# a training config of a tiny GPT on the token task, one step, its plan in a file: run_dir and plan to fill in
TINY_GPT = """run_dir = "{run}"
plan = "{plan}"
[model]
name = "gpt"
vocab_size = 32
seq_len = 8
num_layers = 2
num_heads = 4
d_model = 16
[data]
format = "tokens"
[train]
steps = 1
batch_size = 4
dtype = "float64"
"""

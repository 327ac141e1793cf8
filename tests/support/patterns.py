"""Small models with a pattern of other people's models that once ran wrong under a split (issue 29): shared by the
tests of the patterns (``tests/clients/test_patterns.py``) and of ``hybridpar.verify``."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

T, D, HEADS = 8, 16, 4


class ConfigHeads(nn.Module):
    """Attention that takes its head count from the configuration and puts the wildcard on the sequence:
    ``q.view(b, -1, heads, head_dim)``. On a rank holding half the features, -1 takes half the tokens."""

    def __init__(self):
        super().__init__()
        self.heads, self.head_dim = HEADS, D // HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, -1, self.heads, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)  # (B, heads, T, head_dim)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class TensorHeads(ConfigHeads):
    """The same attention with the head count from the tensor (``view(b, t, -1, head_dim)``): exact when split."""

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1))


class DroppedConvHead(nn.Module):
    """A volume network whose auxiliary head runs on every slab and is dropped."""

    def __init__(self):
        super().__init__()
        self.body, self.aux, self.out = (nn.Conv3d(1 if i == 0 else 4, 4 if i < 2 else 1, 3, padding=1)
                                         for i in range(3))

    def forward(self, x):
        h = torch.relu(self.body(x))
        _ = self.aux(h)
        return self.out(torch.relu(h))


HEAD_SPLIT = (("q", "column"), ("k", "column"), ("v", "column"), ("scaled_dot_product_attention#0", "shard"),
              ("o", "row"))

"""A decoder-only transformer (GPT-2 / GPT-3 shape), a plain ``nn.Module`` that knows nothing of parallelism.

Token and learned position embeddings, then ``num_layers`` pre-LayerNorm blocks
``x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))`` (causal multi-head self-attention, a GELU MLP), a final
LayerNorm and a linear head to vocabulary logits. ``forward`` returns logits; the loss is left to the caller
(``lm_loss``), so that a pipeline's last stage can apply it to each micro-batch.

The attribute names are part of the contract: a tensor-parallel plan refers to ``blocks.*.attn.qkv`` and
``blocks.*.mlp.fc`` (split by output features, "column") and ``blocks.*.attn.proj`` and ``blocks.*.mlp.proj``
(split by input features, "row"), ``embed.tok``, ``embed.pos`` and ``lm_head``. Construction under
``torch.device("meta")``
allocates nothing and is instant, so the planner can analyse ``gpt3-175b`` on a laptop; a runtime that
materialises a meta model (``to_empty``) then calls ``init_weights``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from hybridpar.errors import HybridparError

INIT_STD = 0.02  # GPT-2's initializer_range


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a GPT. ``d_ff=0`` means ``4 * d_model`` (see ``ff_dim``); ``dropout`` applies to the
    embeddings, the attention probabilities and both residual branches, and only in training."""

    vocab_size: int = 50304  # GPT-2's 50257 padded up to a multiple of 64, as nanoGPT trains it
    seq_len: int = 1024
    num_layers: int = 12
    num_heads: int = 12
    d_model: int = 768
    d_ff: int = 0
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "num_layers", "num_heads", "d_model"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise HybridparError(f"GPTConfig: {name}={value!r} must be an integer >= 1")
        if not _is_int(self.d_ff) or self.d_ff < 0:
            raise HybridparError(f"GPTConfig: d_ff={self.d_ff!r} must be an integer >= 1, or 0 for 4 * d_model")
        if self.d_model % self.num_heads:
            raise HybridparError(f"GPTConfig: d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                                 "choose num_heads among the divisors of d_model")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise HybridparError(f"GPTConfig: dropout={self.dropout!r} must be a probability in [0, 1), e.g. 0.1")
        if not isinstance(self.bias, bool):
            raise HybridparError(f"GPTConfig: bias={self.bias!r} must be True or False")

    @property
    def ff_dim(self) -> int:
        """The MLP's hidden width: ``d_ff``, or ``4 * d_model`` when ``d_ff`` is 0."""
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


# The published sizes: GPT-2 (Radford et al. 2019, table 2) and GPT-3 175B (Brown et al. 2020, table 2.1), with
# their real vocabulary of 50,257 tokens. The parameter counts in the names are those of a tied head; this
# model's untied head adds vocab_size * d_model (38.6M for gpt2-small, 0.6B for gpt3-175b).
GPT_PRESETS = {
    "gpt2-small": GPTConfig(vocab_size=50257, seq_len=1024, num_layers=12, num_heads=12, d_model=768),
    "gpt2-medium": GPTConfig(vocab_size=50257, seq_len=1024, num_layers=24, num_heads=16, d_model=1024),
    "gpt2-large": GPTConfig(vocab_size=50257, seq_len=1024, num_layers=36, num_heads=20, d_model=1280),
    "gpt2-xl": GPTConfig(vocab_size=50257, seq_len=1024, num_layers=48, num_heads=25, d_model=1600),
    "gpt3-175b": GPTConfig(vocab_size=50257, seq_len=2048, num_layers=96, num_heads=96, d_model=12288),
}


def gpt_config(name: str) -> GPTConfig:
    """The preset config called ``name`` (a key of ``GPT_PRESETS``)."""
    if name not in GPT_PRESETS:
        raise HybridparError(f"gpt_config: unknown preset {name!r}; use one of {', '.join(GPT_PRESETS)}")
    return GPT_PRESETS[name]


class Attention(nn.Module):
    """Causal multi-head self-attention: one fused ``qkv`` projection, ``num_heads`` heads, ``proj`` back.

    The rows of ``qkv`` are grouped by head (Megatron's layout): head ``h`` owns rows
    ``[3 * h * hs, 3 * (h + 1) * hs)``, its query, key and value in that order. A contiguous split of
    ``qkv``'s outputs into ``tp`` parts therefore gives each rank whole heads: the analysis follows the split
    through the ``view`` in ``forward`` to the heads, and tensor parallelism splits it so.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # (B, T, 3 d): shapes from here, as a rank may hold only some heads (and, under
        B, T, _ = qkv.shape  # sequence parallelism, only some of x's tokens, which qkv gathers)
        qkv = qkv.view(B, T, -1, 3, self.head_dim)  # (B, T, nh, 3, hs)
        q, k, v = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # 3 x (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)  # (B, nh, T, hs)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, d)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """``fc`` (d -> d_ff), GELU, ``proj`` (d_ff -> d), dropout."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.ff_dim, bias=config.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(config.ff_dim, config.d_model, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))  # (B, T, d) -> (B, T, d_ff) -> (B, T, d)


class Block(nn.Module):
    """One pre-LayerNorm transformer layer: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, d)
        return x + self.mlp(self.ln_2(x))


class Embeddings(nn.Module):
    """Token ids ``(B, T)`` -> token plus learned position embeddings ``(B, T, d)``, then dropout."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.seq_len = config.seq_len
        self.tok = nn.Embedding(config.vocab_size, config.d_model)
        self.pos = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.seq_len:
            raise HybridparError(f"GPT: input of T={T} tokens is longer than seq_len={self.seq_len}; "
                                 f"crop it to {self.seq_len} tokens or build the model with seq_len={T}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        return self.drop(self.tok(idx) + self.pos(pos))  # (B, T, d) + (T, d)


class GPT(nn.Module):
    """Token ids ``(B, T)`` -> logits ``(B, T, vocab_size)``, for ``T <= seq_len``.

    The forward is the composition of the top-level modules in order (``embed``, each of ``blocks``,
    ``ln_f``, ``lm_head``), each reading only the output of the one before: a "top-level sequence of blocks"
    that pipeline stages can cut anywhere. ``lm_head`` is deliberately *not* tied to ``embed.tok``: tying
    would make the first and the last pipeline stage share one parameter; untied, every stage owns disjoint
    parameters (at the cost of ``vocab_size * d_model`` more of them).
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.embed = Embeddings(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.init_weights()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)  # (B, T, d)
        for block in self.blocks:
            x = block(x)  # (B, T, d)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's initialisation: weights of every Linear and Embedding from N(0, 0.02), zero biases,
        LayerNorms at identity, and the two residual projections of each block (``attn.proj``, ``mlp.proj``)
        scaled down by ``1 / sqrt(2 * num_layers)`` so that the residual stream's variance does not grow with
        depth (Radford et al. 2019, section 2.3). On the meta device every call is a no-op."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=INIT_STD)
            if isinstance(m, (nn.Linear, nn.LayerNorm)) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
        residual_std = INIT_STD / math.sqrt(2 * self.config.num_layers)
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=residual_std)

    def num_parameters(self) -> int:
        """All parameters, the untied ``lm_head`` and the position embeddings included."""
        return sum(p.numel() for p in self.parameters())


def gpt(preset: str = "", **fields) -> GPT:
    """A GPT from ``GPTConfig`` fields (``vocab_size``, ``seq_len``, ``num_layers``, ``num_heads``, ``d_model``,
    ``d_ff``, ``dropout``, ``bias``), starting from the defaults or from ``GPT_PRESETS[preset]``."""
    names = [f.name for f in dataclasses.fields(GPTConfig)]
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise HybridparError(f"gpt: unknown argument(s) {', '.join(unknown)}; the GPTConfig fields are "
                             f"{', '.join(names)}")
    base = gpt_config(preset) if preset else GPTConfig()
    return GPT(dataclasses.replace(base, **fields))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy. ``targets[b, t]`` is the token that follows ``idx[b, t]``: from a window
    ``w`` of ``T + 1`` tokens, ``idx = w[:, :-1]`` and ``targets = w[:, 1:]``, so both are ``(B, T)`` and split
    into micro-batches alike. ``logits``: ``(B, T, vocab)``."""
    if logits.shape[:-1] != targets.shape:
        raise HybridparError(f"lm_loss: logits {tuple(logits.shape)} do not match targets {tuple(targets.shape)}; "
                             "targets must be (B, T) for logits (B, T, vocab)")
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())  # (B*T, vocab), (B*T,)


"""The GPT model: shapes, the published parameter counts (gpt3-175b on the meta device), causality, attention
against a hand-written reference, the init, config errors and the loss helper. Single process, float64 where
numeric."""

import math
import re
import time

import pytest
import torch
import torch.nn.functional as F

from hybridpar.errors import HybridparError
from hybridpar.models import GPT, GPT_PRESETS, MODELS, GPTConfig, gpt, gpt_config
from hybridpar.models.gpt import lm_loss

TINY = dict(vocab_size=37, seq_len=16, num_layers=2, num_heads=4, d_model=32)
TOL = 1e-12  # float64 with O(d) terms per dot product: rounding stays near 1e-15, far below this


@pytest.fixture
def tiny() -> GPT:
    torch.manual_seed(0)
    return gpt(**TINY).double()


def _tokens(batch: int, length: int, vocab: int = TINY["vocab_size"], seed: int = 1) -> torch.Tensor:
    return torch.randint(vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _expected_parameters(c: GPTConfig) -> int:
    """Embeddings, per layer 12 d^2 + 13 d (qkv 3d^2 + 3d, proj d^2 + d, fc and proj 8d^2 + 5d, two LayerNorms
    4d), the final LayerNorm and the untied head."""
    d, f = c.d_model, c.ff_dim
    per_layer = (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 2 * 2 * d
    return c.vocab_size * d + c.seq_len * d + c.num_layers * per_layer + 2 * d + d * c.vocab_size


def test_output_shape_and_structure(tiny):
    logits = tiny(_tokens(3, 10))
    assert logits.shape == (3, 10, TINY["vocab_size"]) and logits.dtype == torch.float64
    assert len(tiny.blocks) == 2 and tiny.lm_head.bias is None
    assert tiny.lm_head.weight is not tiny.embed.tok.weight  # untied: pipeline stages own disjoint parameters
    block = tiny.blocks[0]
    assert block.attn.qkv.out_features == 96 and block.mlp.fc.out_features == 128  # d_ff=0 -> 4 * d_model
    assert isinstance(block.mlp.act, torch.nn.GELU)
    assert gpt(**TINY, d_ff=50).blocks[0].mlp.proj.in_features == 50


def test_gpt2_small_parameter_count():
    with torch.device("meta"):
        model = gpt("gpt2-small")
    expected = _expected_parameters(model.config)
    assert model.num_parameters() == expected == 163_037_184
    # the published 124M counts the head tied to the token embedding
    assert expected - 50257 * 768 == 124_439_808


def test_gpt3_175b_on_meta_is_instant():
    start = time.perf_counter()
    with torch.device("meta"):
        model = gpt("gpt3-175b")
    seconds = time.perf_counter() - start
    assert seconds < 5, f"building gpt3-175b on meta took {seconds:.1f} s"
    assert all(p.is_meta for p in model.parameters())
    assert model.num_parameters() == _expected_parameters(model.config)
    assert abs(model.num_parameters() / 175e9 - 1) < 0.01
    logits = model(torch.empty(1, 2048, dtype=torch.long, device="meta"))  # what the planner traces
    assert logits.shape == (1, 2048, 50257) and logits.is_meta


def test_presets():
    assert gpt_config("gpt2-xl") is GPT_PRESETS["gpt2-xl"]
    assert [GPT_PRESETS[n].num_layers for n in ("gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl")] == \
        [12, 24, 36, 48]
    assert gpt_config("gpt3-175b").head_dim == 128
    with pytest.raises(HybridparError, match="gpt2-small, gpt2-medium, gpt2-large, gpt2-xl, gpt3-175b"):
        gpt_config("gpt4")
    with torch.device("meta"):
        model = gpt("gpt2-medium", num_layers=2, dropout=0.1)
    assert model.config == GPTConfig(vocab_size=50257, num_layers=2, num_heads=16, d_model=1024, dropout=0.1)


def test_causal(tiny):
    """Changing token t leaves the logits at positions before t unchanged, and changes those from t on."""
    idx = _tokens(2, 12)
    t = 7
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % TINY["vocab_size"]
    before, after = tiny(idx), tiny(changed)
    torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=TOL)
    assert (after[:, t:] - before[:, t:]).abs().amax(dim=-1).min() > 1e-6


def test_attention_matches_reference(tiny):
    """The module's attention against masked softmax(Q K^T / sqrt(hs)) V written out by hand."""
    attn = tiny.blocks[0].attn
    B, T, d, nh = 2, 9, TINY["d_model"], TINY["num_heads"]
    hs = d // nh
    x = torch.randn(B, T, d, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    w, b = attn.qkv.weight.view(nh, 3, hs, d), attn.qkv.bias.view(nh, 3, hs)  # rows grouped by head
    q, k, v = (x @ w[:, i].reshape(d, d).T + b[:, i].reshape(d) for i in range(3))  # (B, T, d)
    q, k, v = (t.reshape(B, T, nh, hs).permute(0, 2, 1, 3) for t in (q, k, v))  # (B, nh, T, hs)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hs)  # (B, nh, T, T)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    y = scores.masked_fill(future, float("-inf")).softmax(dim=-1) @ v  # (B, nh, T, hs)
    y = y.permute(0, 2, 1, 3).reshape(B, T, d) @ attn.proj.weight.T + attn.proj.bias
    with torch.no_grad():
        torch.testing.assert_close(attn(x), y, rtol=0, atol=TOL)


def test_init():
    torch.manual_seed(0)
    model = gpt(vocab_size=500, seq_len=64, num_layers=8, num_heads=4, d_model=128)
    block = model.blocks[3]
    for weight in (model.embed.tok.weight, model.embed.pos.weight, block.attn.qkv.weight, block.mlp.fc.weight,
                   model.lm_head.weight):
        assert weight.std().item() == pytest.approx(0.02, rel=0.05)
    for weight in (block.attn.proj.weight, block.mlp.proj.weight):
        assert weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert block.attn.qkv.bias.abs().max() == 0 and block.mlp.proj.bias.abs().max() == 0
    assert (block.ln_1.weight == 1).all() and (model.ln_f.bias == 0).all()


CONFIG_ERRORS = [
    ("vocab_size", 0), ("seq_len", -1), ("num_layers", 2.0), ("num_heads", True), ("d_model", 0), ("d_ff", -1),
    ("dropout", 1.0), ("dropout", -0.1), ("dropout", "0.1"), ("bias", 1),
]


@pytest.mark.parametrize("name, value", CONFIG_ERRORS, ids=str)
def test_config_errors(name, value):
    with pytest.raises(HybridparError, match=re.escape(f"{name}={value!r}")):
        GPTConfig(**{name: value})


def test_config_heads_must_divide_width():
    with pytest.raises(HybridparError, match="d_model=100 is not divisible by num_heads=12"):
        GPTConfig(d_model=100)
    with pytest.raises(HybridparError, match="unknown argument.*num_kv_heads.*vocab_size"):
        gpt(num_kv_heads=4)


def test_sequence_longer_than_seq_len(tiny):
    with pytest.raises(HybridparError, match="T=17.*seq_len=16"):
        tiny(_tokens(1, 17))


def test_lm_loss_is_cross_entropy_on_shifted_tokens(tiny):
    window = _tokens(3, TINY["seq_len"] + 1)
    idx, targets = window[:, :-1], window[:, 1:]
    logits = tiny(idx)
    loss = lm_loss(logits, targets)
    flat = logits.reshape(-1, TINY["vocab_size"])
    expected = F.cross_entropy(flat, window[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, expected, rtol=0, atol=TOL)
    by_hand = -flat.log_softmax(-1).gather(1, targets.reshape(-1, 1)).mean()
    torch.testing.assert_close(loss, by_hand, rtol=0, atol=TOL)
    with pytest.raises(HybridparError, match="targets must be"):
        lm_loss(logits, window)


def test_backward_gives_finite_gradients_everywhere():
    torch.manual_seed(0)
    model = gpt(**TINY, dropout=0.1).double().train()
    window = _tokens(2, TINY["seq_len"] + 1)
    lm_loss(model(window[:, :-1]), window[:, 1:]).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name  # T = seq_len, so every position row is used too


def test_a_training_model():
    assert MODELS["gpt"] is gpt

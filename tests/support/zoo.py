"""Third-party networks for the tests: Hugging Face ``transformers`` and MONAI models built tiny from their own
config classes and constructors, with random weights (nothing is downloaded), each with a deterministic batch and
a loss that is a mean over samples. ``ZOO`` maps a short key (``"hf-llama"``, ``"monai-unet"``) to its ``Entry``.

Every ``build()`` returns a small wrapper whose ``forward`` takes one tensor and whose child ``model`` is the
library's own module: ``library_state_dict`` and ``to_library`` go between the wrapper's state dict (keys
``model.*``) and the library model's. The libraries are imported inside the builders only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 64
SEQ = 8
LABELS = 4
MASK_ID = 3
FIRST_ID = 4  # ids below are the configs' special tokens (pad, bos, eos, mask): the batches never hold them
IMAGE = 32
VOLUME = 16


@dataclass(frozen=True)
class Entry:
    name: str
    library: str  # "transformers" or "monai"
    kind: str  # "tokens" (a target id per token), "classify" (per sample), "image" (per output pixel),
    # "volume" (per voxel: class ids, or values for a regressor)
    patterns: tuple[str, ...]  # "decoder", "cnn", "alias", "tied", "gqa", "moe", ...: what the model exercises
    build: Callable[[], nn.Module]
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    float32_inside: bool = False  # parts of its forward run in float32 whatever the model's dtype (Gemma's norms)


# Wrappers: one tensor in, the library model as the child ``model``.

class Net(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)


class Tokens(Net):
    def forward(self, ids):
        return self.model(input_ids=ids)


class Seq2Seq(Net):
    """The decoder reads the input shifted right by one, start id 0 in front (a denoising auto-encoder's step)."""

    def forward(self, ids):
        start = torch.zeros_like(ids[:, :1])
        return self.model(input_ids=ids, decoder_input_ids=torch.cat([start, ids[:, :-1]], dim=1))


class Pixels(Net):
    def forward(self, x):
        return self.model(pixel_values=x)


class First(Net):
    """For a net that returns ``(output, hidden states)``."""

    def forward(self, x):
        return self.model(x)[0]


class Heads(Net):
    """Deep supervision's outputs, each resized to the input's grid (nearest) and stacked: (B, heads, C, *grid)."""

    def forward(self, x):
        outs = self.model(x)
        if isinstance(outs, torch.Tensor):
            return outs
        return torch.stack([F.interpolate(o, size=x.shape[2:]) if o.shape[2:] != x.shape[2:] else o for o in outs],
                           dim=1)


# Builders.

def _hf(wrapper: type[nn.Module], model_class: str, config_class: str, config: dict) -> nn.Module:
    import transformers

    return wrapper(getattr(transformers, model_class)(getattr(transformers, config_class)(**config)))


def _monai(wrapper: type[nn.Module], net: str, kwargs: dict) -> nn.Module:
    import monai.networks.nets as nets

    return wrapper(getattr(nets, net)(**kwargs))


def library_state_dict(wrapper: nn.Module) -> dict[str, torch.Tensor]:
    """The library model's own state dict (the wrapper's child ``model``)."""
    return wrapper.model.state_dict()


def to_library(entry_name: str, state: dict[str, torch.Tensor]) -> nn.Module:
    """A fresh library model of ``entry_name`` holding ``state``, a wrapper's full state dict (keys ``model.*``),
    in the state's floating dtype."""
    model = ZOO[entry_name].build().model
    own = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    dtypes = [v.dtype for v in own.values() if v.is_floating_point()]
    if dtypes:
        model.to(dtypes[0])
    model.load_state_dict(own)
    return model


# Batches: torch.Generator().manual_seed(1), float64 for float inputs.

def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(1)


def next_tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.randint(FIRST_ID, VOCAB, (n, SEQ + 1), generator=_gen())
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def masked_tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.randint(FIRST_ID, VOCAB, (n, SEQ), generator=_gen())
    x = seq.clone()
    x[:, 1::3] = MASK_ID
    return x, seq


def copy_tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.randint(FIRST_ID, VOCAB, (n, SEQ), generator=_gen())
    return seq, seq.clone()


def token_classes(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen()
    return torch.randint(FIRST_ID, VOCAB, (n, SEQ), generator=g), torch.randint(0, LABELS, (n,), generator=g)


def image_classes(n: int, size: int = IMAGE) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen()
    x = torch.randn(n, 3, size, size, generator=g, dtype=torch.float64)
    return x, torch.randint(0, LABELS, (n,), generator=g)


def image_pixels(n: int, size: int = IMAGE, out: int = IMAGE // 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen()
    x = torch.randn(n, 3, size, size, generator=g, dtype=torch.float64)
    return x, torch.randint(0, LABELS, (n, out, out), generator=g)


def volume_voxels(n: int, channels: int = 1, size: int = VOLUME, classes: int = 2):
    g = _gen()
    x = torch.randn(n, channels, size, size, size, generator=g, dtype=torch.float64)
    return x, torch.randint(0, classes, (n, size, size, size), generator=g)


def volume_values(n: int, channels: int = 1, size: int = VOLUME, out: int = 1):
    g = _gen()
    x = torch.randn(n, channels, size, size, size, generator=g, dtype=torch.float64)
    return x, torch.randn(n, out, size, size, size, generator=g, dtype=torch.float64)


def volume_classes(n: int, channels: int = 1, size: int = VOLUME, classes: int = 2):
    g = _gen()
    x = torch.randn(n, channels, size, size, size, generator=g, dtype=torch.float64)
    return x, torch.randint(0, classes, (n,), generator=g)


# Losses: means over samples.

def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def class_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, targets)


def dense_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy per pixel or voxel; a stack of deep-supervision heads (B, heads, C, *grid) is averaged."""
    if logits.dim() == targets.dim() + 2:
        heads = logits.shape[1]
        return F.cross_entropy(logits.transpose(1, 2), targets.unsqueeze(1).expand(-1, heads, *targets.shape[1:]))
    return F.cross_entropy(logits, targets)


def value_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, targets)


# Entries.

def _lm(key: str, config_class: str, model_class: str, patterns: tuple[str, ...], config: dict,
        float32_inside: bool = False) -> Entry:
    return Entry(f"hf-{key}", "transformers", "tokens", ("decoder", *patterns),
                 partial(_hf, Tokens, model_class, config_class, config), next_tokens, token_loss, float32_inside)


def _encoder(key: str, config_class: str, model_class: str, patterns: tuple[str, ...], config: dict,
             float32_inside: bool = False) -> Entry:
    classify = model_class.endswith("SequenceClassification")
    return Entry(f"hf-{key}", "transformers", "classify" if classify else "tokens", ("encoder", *patterns),
                 partial(_hf, Tokens, model_class, config_class, config),
                 token_classes if classify else masked_tokens, class_loss if classify else token_loss, float32_inside)


def _seq2seq(key: str, config_class: str, model_class: str, patterns: tuple[str, ...], config: dict) -> Entry:
    return Entry(f"hf-{key}", "transformers", "tokens", ("encoder-decoder", *patterns),
                 partial(_hf, Seq2Seq, model_class, config_class, config), copy_tokens, token_loss)


def _vision(key: str, config_class: str, model_class: str, patterns: tuple[str, ...], config: dict) -> Entry:
    return Entry(f"hf-{key}", "transformers", "classify", patterns,
                 partial(_hf, Pixels, model_class, config_class, config), image_classes, class_loss)


def _volume(key: str, net: str, patterns: tuple[str, ...], kwargs: dict, wrapper: type[nn.Module] = Net,
            batch: Callable = volume_voxels, loss: Callable = dense_loss, kind: str = "volume") -> Entry:
    return Entry(f"monai-{key}", "monai", kind, patterns, partial(_monai, wrapper, net, kwargs), batch, loss)


_LLAMA = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, use_cache=False, attention_dropout=0.0)
_MOE = {**_LLAMA, "num_experts_per_tok": 2, "experts_implementation": "eager"}  # grouped_mm has no float64
_GPT2 = dict(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, n_inner=64, resid_pdrop=0.0,
             embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, use_cache=False)
_BERT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64, num_labels=LABELS)
_BART = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
             dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
             eos_token_id=2, decoder_start_token_id=0, use_cache=False)
_T5 = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
           relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
           decoder_start_token_id=0, use_cache=False)
_VIT = dict(image_size=IMAGE, patch_size=8, num_channels=3, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=LABELS)
_CONV = dict(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=LABELS)
_SEGFORMER = dict(num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                  patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[2, 4], mlp_ratios=[2, 2],
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0,
                  drop_path_rate=0.0, decoder_hidden_size=32, num_labels=LABELS)
_ROPE = ("rotary",)
_GQA_ROPE = ("gqa", "rotary")
_TIED = ("tied", "alias")

_ENTRIES = [
    # Decoder-only causal LMs.
    _lm("llama", "LlamaConfig", "LlamaForCausalLM", _GQA_ROPE, _LLAMA),
    _lm("mistral", "MistralConfig", "MistralForCausalLM", _GQA_ROPE, _LLAMA),
    _lm("mixtral", "MixtralConfig", "MixtralForCausalLM", (*_GQA_ROPE, "moe", "fused-projection"),
        {**_MOE, "num_local_experts": 4, "router_jitter_noise": 0.0}),
    _lm("qwen2", "Qwen2Config", "Qwen2ForCausalLM", _GQA_ROPE, _LLAMA),
    _lm("qwen3", "Qwen3Config", "Qwen3ForCausalLM", _GQA_ROPE, {**_LLAMA, "head_dim": 8}),
    _lm("qwen2-moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM", (*_GQA_ROPE, "moe", "fused-projection"),
        {**_MOE, "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
         "decoder_sparse_step": 1}),
    _lm("olmoe", "OlmoeConfig", "OlmoeForCausalLM", (*_GQA_ROPE, "moe", "fused-projection"),
        {**_MOE, "num_experts": 4, "pad_token_id": 1, "eos_token_id": 2}),
    _lm("gemma", "GemmaConfig", "GemmaForCausalLM", (*_GQA_ROPE, *_TIED), {**_LLAMA, "head_dim": 8},
        float32_inside=True),
    _lm("gemma2", "Gemma2Config", "Gemma2ForCausalLM", (*_GQA_ROPE, *_TIED),
        {**_LLAMA, "head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 4, "attn_implementation": "eager"},
        float32_inside=True),
    _lm("phi", "PhiConfig", "PhiForCausalLM", _GQA_ROPE,
        {**_LLAMA, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "partial_rotary_factor": 0.5}),
    _lm("phi3", "Phi3Config", "Phi3ForCausalLM", (*_GQA_ROPE, "fused-projection"),
        {**_LLAMA, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    _lm("gpt-neox", "GPTNeoXConfig", "GPTNeoXForCausalLM", ("rotary", "fused-projection"),
        dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0, max_position_embeddings=64, use_cache=False)),
    _lm("opt", "OPTConfig", "OPTForCausalLM", _TIED,
        dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
             word_embed_proj_dim=32, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
             activation_dropout=0.0, layerdrop=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2, use_cache=False)),
    _lm("bloom", "BloomConfig", "BloomForCausalLM", ("fused-projection", *_TIED),
        dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0,
             use_cache=False)),
    _lm("falcon", "FalconConfig", "FalconForCausalLM", ("gqa", "rotary", "fused-projection", *_TIED),
        dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
             new_decoder_architecture=True, alibi=False, ffn_hidden_size=64, hidden_dropout=0.0,
             attention_dropout=0.0, max_position_embeddings=64, use_cache=False)),
    _lm("stablelm", "StableLmConfig", "StableLmForCausalLM", _GQA_ROPE,
        {**_LLAMA, "partial_rotary_factor": 0.5, "hidden_dropout": 0.0}),
    _lm("starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", (*_GQA_ROPE, *_TIED),
        {**_LLAMA, "residual_dropout": 0.0, "embedding_dropout": 0.0, "sliding_window": None, "bos_token_id": 1,
         "eos_token_id": 2}),
    _lm("gptj", "GPTJConfig", "GPTJForCausalLM", _ROPE, {**_GPT2, "rotary_dim": 4}),
    _lm("codegen", "CodeGenConfig", "CodeGenForCausalLM", ("rotary", "fused-projection"),
        {**_GPT2, "n_ctx": 64, "rotary_dim": 4}),
    _lm("olmo", "OlmoConfig", "OlmoForCausalLM", _GQA_ROPE, {**_LLAMA, "pad_token_id": 1, "eos_token_id": 2}),
    _lm("olmo2", "Olmo2Config", "Olmo2ForCausalLM", _GQA_ROPE, {**_LLAMA, "pad_token_id": 1, "eos_token_id": 2}),
    _lm("gpt-bigcode", "GPTBigCodeConfig", "GPTBigCodeForCausalLM", ("gqa", "fused-projection", *_TIED),
        {**_GPT2, "multi_query": True}),
    _lm("gpt2", "GPT2Config", "GPT2LMHeadModel", ("fused-projection", *_TIED), _GPT2),
    _lm("granite", "GraniteConfig", "GraniteForCausalLM", _GQA_ROPE, _LLAMA),
    _lm("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM", (*_GQA_ROPE, "moe", "fused-projection"),
        {**_MOE, "num_local_experts": 4}),
    _lm("cohere", "CohereConfig", "CohereForCausalLM", (*_GQA_ROPE, *_TIED),
        {**_LLAMA, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}, float32_inside=True),
    # Encoder-only: masked LMs and sequence classifiers.
    _encoder("bert-mlm", "BertConfig", "BertForMaskedLM", _TIED, _BERT),
    _encoder("bert", "BertConfig", "BertForSequenceClassification", (), _BERT),
    _encoder("roberta-mlm", "RobertaConfig", "RobertaForMaskedLM", _TIED,
             {**_BERT, "max_position_embeddings": 66, "pad_token_id": 1}),
    _encoder("distilbert", "DistilBertConfig", "DistilBertForSequenceClassification", (),
             dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64, dropout=0.0, attention_dropout=0.0,
                  seq_classif_dropout=0.0, max_position_embeddings=64, num_labels=LABELS)),
    _encoder("albert-mlm", "AlbertConfig", "AlbertForMaskedLM", ("shared-module", *_TIED),
             {**_BERT, "embedding_size": 16, "classifier_dropout_prob": 0.0}),
    _encoder("albert", "AlbertConfig", "AlbertForSequenceClassification", ("shared-module",),
             {**_BERT, "embedding_size": 16, "num_hidden_layers": 3, "classifier_dropout_prob": 0.0}),
    _encoder("electra", "ElectraConfig", "ElectraForSequenceClassification", (), {**_BERT, "embedding_size": 16}),
    _encoder("deberta-v2", "DebertaV2Config", "DebertaV2ForSequenceClassification", (),
             {**_BERT, "relative_attention": True, "position_buckets": 8, "max_relative_positions": 16,
              "pos_att_type": ["p2c", "c2p"], "pooler_dropout": 0.0, "pooler_hidden_size": 32}),
    _encoder("mpnet-mlm", "MPNetConfig", "MPNetForMaskedLM", _TIED,
             {**_BERT, "max_position_embeddings": 66, "pad_token_id": 1}),
    _encoder("modernbert-mlm", "ModernBertConfig", "ModernBertForMaskedLM", ("rotary", "fused-projection", *_TIED),
             dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=4, embedding_dropout=0.0,
                  mlp_dropout=0.0, attention_dropout=0.0, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                  cls_token_id=2, sep_token_id=1), float32_inside=True),  # its rotary casts queries and keys to float32
    _encoder("xlm-roberta", "XLMRobertaConfig", "XLMRobertaForSequenceClassification", (),
             {**_BERT, "max_position_embeddings": 66, "pad_token_id": 1}),
    _encoder("roformer-mlm", "RoFormerConfig", "RoFormerForMaskedLM", ("rotary", *_TIED),
             {**_BERT, "embedding_size": 32}),
    _encoder("esm-mlm", "EsmConfig", "EsmForMaskedLM", ("rotary", *_TIED),
             {**_BERT, "position_embedding_type": "rotary", "token_dropout": False, "pad_token_id": 1,
              "mask_token_id": MASK_ID}),
    # Encoder-decoders: the target is the input (a denoising step with nothing masked). transformers 5 ties the
    # heads of T5 and MT5 whatever the config says.
    _seq2seq("t5", "T5Config", "T5ForConditionalGeneration", _TIED, _T5),
    _seq2seq("mt5", "MT5Config", "MT5ForConditionalGeneration", _TIED, _T5),
    _seq2seq("umt5", "UMT5Config", "UMT5ForConditionalGeneration", _TIED, _T5),
    _seq2seq("switch", "SwitchTransformersConfig", "SwitchTransformersForConditionalGeneration", ("moe", *_TIED),
             {**_T5, "num_sparse_encoder_layers": 1, "num_sparse_decoder_layers": 1, "num_experts": 4,
              "expert_capacity": 64, "router_jitter_noise": 0.0}),
    _seq2seq("bart", "BartConfig", "BartForConditionalGeneration", _TIED, _BART),
    _seq2seq("mbart", "MBartConfig", "MBartForConditionalGeneration", _TIED, _BART),
    _seq2seq("pegasus", "PegasusConfig", "PegasusForConditionalGeneration", _TIED, _BART),
    _seq2seq("marian", "MarianConfig", "MarianMTModel", _TIED, {**_BART, "decoder_vocab_size": VOCAB}),
    _seq2seq("blenderbot-small", "BlenderbotSmallConfig", "BlenderbotSmallForConditionalGeneration", _TIED, _BART),
    _seq2seq("plbart", "PLBartConfig", "PLBartForConditionalGeneration", _TIED, _BART),
    # Vision: image classifiers (and one segmenter).
    _vision("vit", "ViTConfig", "ViTForImageClassification", ("vision-transformer",), _VIT),
    _vision("deit", "DeiTConfig", "DeiTForImageClassification", ("vision-transformer",), _VIT),
    _vision("beit", "BeitConfig", "BeitForImageClassification", ("vision-transformer",),
            {**_VIT, "drop_path_rate": 0.0, "use_relative_position_bias": True}),
    _vision("dinov2", "Dinov2Config", "Dinov2ForImageClassification", ("vision-transformer",),
            {**_VIT, "mlp_ratio": 2, "drop_path_rate": 0.0}),
    _vision("swin", "SwinConfig", "SwinForImageClassification", ("vision-transformer",),
            dict(image_size=IMAGE, patch_size=2, num_channels=3, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                 window_size=4, mlp_ratio=2.0, drop_path_rate=0.0, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0, num_labels=LABELS)),
    _vision("swinv2", "Swinv2Config", "Swinv2ForImageClassification", ("vision-transformer",),
            dict(image_size=IMAGE, patch_size=2, num_channels=3, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                 window_size=4, mlp_ratio=2.0, drop_path_rate=0.0, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0, num_labels=LABELS)),
    _vision("convnext", "ConvNextConfig", "ConvNextForImageClassification", ("cnn", "channels-last"),
            {**_CONV, "num_stages": 2, "drop_path_rate": 0.0, "layer_scale_init_value": 0.5}),
    _vision("convnextv2", "ConvNextV2Config", "ConvNextV2ForImageClassification", ("cnn", "channels-last"),
            {**_CONV, "num_stages": 2, "drop_path_rate": 0.0}),
    _vision("resnet", "ResNetConfig", "ResNetForImageClassification", ("cnn",), {**_CONV, "layer_type": "basic"}),
    _vision("regnet", "RegNetConfig", "RegNetForImageClassification", ("cnn",), {**_CONV, "groups_width": 4}),
    _vision("bit", "BitConfig", "BitForImageClassification", ("cnn",),
            {**_CONV, "layer_type": "preactivation", "num_groups": 4, "drop_path_rate": 0.0}),
    _vision("poolformer", "PoolFormerConfig", "PoolFormerForImageClassification", ("cnn",),
            dict(num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_encoder_blocks=2, patch_sizes=[7, 3],
                 strides=[4, 2], padding=[2, 1], pool_size=3, mlp_ratio=2.0, drop_path_rate=0.0,
                 layer_scale_init_value=0.5, num_labels=LABELS)),
    _vision("mobilevit", "MobileViTConfig", "MobileViTForImageClassification", ("cnn", "vision-transformer"),
            dict(num_channels=3, image_size=IMAGE, patch_size=2, hidden_sizes=[16, 24, 32],
                 neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64], output_stride=16, num_attention_heads=4,
                 mlp_ratio=2.0, expand_ratio=2.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                 classifier_dropout_prob=0.0, num_labels=LABELS)),
    _vision("mobilenet-v2", "MobileNetV2Config", "MobileNetV2ForImageClassification", ("cnn",),
            dict(num_channels=3, image_size=IMAGE, depth_multiplier=0.25, min_depth=4, output_stride=16,
                 classifier_dropout_prob=0.0, num_labels=LABELS)),
    _vision("focalnet", "FocalNetConfig", "FocalNetForImageClassification", ("cnn",),
            dict(image_size=IMAGE, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1], focal_levels=[2, 2],
                 focal_windows=[3, 3], mlp_ratio=2.0, drop_path_rate=0.0, hidden_dropout_prob=0.0,
                 num_labels=LABELS)),
    _vision("segformer", "SegformerConfig", "SegformerForImageClassification", ("vision-transformer",), _SEGFORMER),
    Entry("hf-segformer-seg", "transformers", "image", ("vision-transformer",),
          partial(_hf, Pixels, "SegformerForSemanticSegmentation", "SegformerConfig", _SEGFORMER), image_pixels,
          dense_loss),
    # MONAI: 3D networks on volumes.
    _volume("unet", "UNet", ("cnn",),
            dict(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1)),
    _volume("unet-bn", "UNet", ("cnn",),
            dict(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2), num_res_units=1,
                 norm="batch")),
    _volume("segresnet", "SegResNet", ("cnn", "alias"),
            dict(spatial_dims=3, init_filters=4, in_channels=1, out_channels=2, blocks_down=(1, 2), blocks_up=(1,),
                 norm=("group", {"num_groups": 2}))),
    _volume("dynunet", "DynUNet", ("cnn", "alias"),
            dict(spatial_dims=3, in_channels=1, out_channels=2, kernel_size=[3, 3, 3], strides=[1, 2, 2],
                 upsample_kernel_size=[2, 2], filters=[4, 8, 16])),
    _volume("dynunet-ds", "DynUNet", ("cnn", "deep-supervision", "alias"),
            dict(spatial_dims=3, in_channels=1, out_channels=2, kernel_size=[3, 3, 3, 3], strides=[1, 2, 2, 2],
                 upsample_kernel_size=[2, 2, 2], filters=[4, 8, 8, 16], deep_supervision=True, deep_supr_num=2,
                 res_block=True)),
    _volume("basicunet", "BasicUNet", ("cnn",),
            dict(spatial_dims=3, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 16, 4)),
            batch=partial(volume_voxels, size=32)),
    _volume("basicunetpp", "BasicUNetPlusPlus", ("cnn", "deep-supervision"),
            dict(spatial_dims=3, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 16, 4), deep_supervision=True,
                 norm=("group", {"num_groups": 2})),
            wrapper=Heads),
    _volume("attentionunet", "AttentionUnet", ("cnn",),
            dict(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2))),
    _volume("highresnet", "HighResNet", ("cnn",),
            dict(spatial_dims=3, in_channels=1, out_channels=2, layer_params=(
                {"name": "conv_0", "n_features": 4, "kernel_size": 3},
                {"name": "res_1", "n_features": 4, "kernels": (3, 3), "repeat": 1},
                {"name": "res_2", "n_features": 8, "kernels": (3, 3), "repeat": 1},
                {"name": "res_3", "n_features": 8, "kernels": (3, 3), "repeat": 1},
                {"name": "conv_1", "n_features": 16, "kernel_size": 1},
                {"name": "conv_2", "kernel_size": 1}))),
    _volume("mednext-ds", "MedNeXt", ("cnn", "deep-supervision"),
            dict(spatial_dims=3, init_filters=4, in_channels=1, out_channels=2, kernel_size=3, blocks_down=(1, 1),
                 blocks_bottleneck=1, blocks_up=(1, 1), deep_supervision=True, use_residual_connection=True,
                 global_resp_norm=True), wrapper=Heads),
    _volume("segresnetds", "SegResNetDS", ("cnn", "deep-supervision"),
            dict(spatial_dims=3, init_filters=4, in_channels=1, out_channels=2, blocks_down=(1, 1, 1), dsdepth=2,
                 norm="instance"), wrapper=Heads),
    _volume("unetr", "UNETR", ("vision-transformer", "cnn", "fused-projection", "alias"),
            dict(in_channels=1, out_channels=2, img_size=VOLUME, feature_size=4, hidden_size=32, mlp_dim=64,
                 num_heads=4)),
    _volume("swinunetr", "SwinUNETR", ("vision-transformer", "cnn", "fused-projection", "alias"),
            dict(in_channels=1, out_channels=2, feature_size=12, depths=(1, 1, 1, 1), num_heads=(2, 2, 4, 4),
                 window_size=4, norm_name=("group", {"num_groups": 4})), batch=partial(volume_voxels, size=32)),
    _volume("densenet", "DenseNet", ("cnn",),
            dict(spatial_dims=3, in_channels=1, out_channels=2, init_features=8, growth_rate=4, block_config=(2, 2),
                 bn_size=2),
            batch=volume_classes, loss=class_loss, kind="classify"),
    _volume("resnet10", "resnet10", ("cnn",),
            dict(spatial_dims=3, n_input_channels=1, num_classes=2, widen_factor=0.125, no_max_pool=True),
            batch=volume_classes, loss=class_loss, kind="classify"),
    _volume("vit", "ViT", ("vision-transformer", "fused-projection", "alias"),
            dict(in_channels=1, img_size=VOLUME, patch_size=4, hidden_size=32, mlp_dim=64, num_layers=2, num_heads=4,
                 classification=True, num_classes=2), wrapper=First, batch=volume_classes, loss=class_loss,
            kind="classify"),
    _volume("vitautoenc", "ViTAutoEnc", ("vision-transformer", "fused-projection", "alias"),
            dict(in_channels=1, img_size=VOLUME, patch_size=4, out_channels=1, deconv_chns=4, hidden_size=32,
                 mlp_dim=64, num_layers=2, num_heads=4), wrapper=First, batch=volume_values, loss=value_loss),
    _volume("autoencoder", "AutoEncoder", ("cnn",),
            dict(spatial_dims=3, in_channels=1, out_channels=1, channels=(4, 8), strides=(2, 2)),
            batch=volume_values, loss=value_loss),
    _volume("localnet", "LocalNet", ("cnn",),
            dict(spatial_dims=3, in_channels=2, num_channel_initial=4, extract_levels=(0, 1, 2), out_channels=3),
            batch=partial(volume_values, channels=2, out=3), loss=value_loss),
    _volume("regunet", "RegUNet", ("cnn",),
            dict(spatial_dims=3, in_channels=2, num_channel_initial=4, depth=2, out_channels=3),
            batch=partial(volume_values, channels=2, out=3), loss=value_loss),
]

ZOO: dict[str, Entry] = {e.name: e for e in _ENTRIES}


# Probe (CPU, one thread, float64; torch.manual_seed(0) before build; batch 4, MONAI 2): forward + loss +
# backward all finite; graph_of(model, x, dtype="float64"). Seconds (transformers and monai imported beforehand):
# build+forward+backward / graph_of.
#
# name                 forward  graph_of                                                   s fwd s graph
# hf-llama             ok       ok (52 layers)                                              0.03    0.12
# hf-mistral           ok       ok (52 layers)                                              0.02    0.11
# hf-mixtral           ok       PlanError: does not run (torch.nonzero on meta: routing)    0.04    0.06
# hf-qwen2             ok       ok (52 layers)                                              0.02    0.12
# hf-qwen3             ok       ok (56 layers)                                              0.02    0.12
# hf-qwen2-moe         ok       PlanError: does not run (torch.nonzero on meta: routing)    0.03    0.08
# hf-olmoe             ok       PlanError: does not run (torch.nonzero on meta: routing)    0.02    0.07
# hf-gemma             ok       ok (52 layers)                                              0.02    0.12
# hf-gemma2            ok       ok (75 layers)                                              0.02    0.15
# hf-phi               ok       ok (55 layers)                                              0.02    0.11
# hf-phi3              ok       ok (54 layers)                                              0.02    0.11
# hf-gpt-neox          ok       ok (53 layers)                                              0.02    0.10
# hf-opt               ok       ok (35 layers)                                              0.02    0.09
# hf-bloom             ok       ok (36 layers)                                              0.02    0.09
# hf-falcon            ok       ok (46 layers)                                              0.03    0.11
# hf-stablelm          ok       ok (58 layers)                                              0.02    0.10
# hf-starcoder2        ok       ok (53 layers)                                              0.02    0.11
# hf-gptj              ok       ok (63 layers)                                              0.02    0.11
# hf-codegen           ok       ok (59 layers)                                              0.02    0.34
# hf-olmo              ok       ok (52 layers)                                              0.02    0.11
# hf-olmo2             ok       ok (56 layers)                                              0.02    0.12
# hf-gpt-bigcode       ok       ok (30 layers)                                              0.02    0.09
# hf-gpt2              ok       ok (30 layers)                                              0.03    0.10
# hf-granite           ok       ok (58 layers)                                              0.02    0.11
# hf-granitemoe        ok       PlanError: does not run (torch.nonzero on meta: routing)    0.02    0.06
# hf-cohere            ok       ok (51 layers)                                              0.02    0.10
# hf-bert-mlm          ok       ok (39 layers)                                              0.01    0.14
# hf-bert              ok       ok (39 layers)                                              0.01    0.10
# hf-roberta-mlm       ok       ok (47 layers)                                              0.03    0.11
# hf-distilbert        ok       ok (35 layers)                                              0.03    0.10
# hf-albert-mlm        ok       ok (38 layers)                                              0.03    0.11
# hf-albert            ok       ok (51 layers)                                              0.01    0.13
# hf-electra           ok       ok (41 layers)                                              0.03    0.10
# hf-deberta-v2        ok       PlanError: branches on a value 'from the weights' *         0.03    0.02
# hf-mpnet-mlm         ok       ok (54 layers)                                              0.03    0.11
# hf-modernbert-mlm    ok       ok (56 layers)                                              0.03    0.11
# hf-xlm-roberta       ok       ok (48 layers)                                              0.03    0.10
# hf-roformer-mlm      ok       PlanError: branches on a value 'from the weights' *         0.03    0.01
# hf-esm-mlm           ok       ok (76 layers)                                              0.03    0.13
# hf-t5                ok       ok (91 layers)                                              0.04    0.46
# hf-mt5               ok       ok (98 layers)                                              0.04    0.25
# hf-umt5              ok       ok (101 layers)                                             0.05    0.30
# hf-switch            ok       PlanError: does not run (torch.nonzero on meta: routing)    0.04    0.11
# hf-bart              ok       ok (89 layers)                                              0.04    0.20
# hf-mbart             ok       ok (91 layers)                                              0.04    0.21
# hf-pegasus           ok       ok (91 layers)                                              0.04    0.23
# hf-marian            ok       ok (89 layers)                                              0.04    0.21
# hf-blenderbot-small  ok       ok (90 layers)                                              0.03    0.23
# hf-plbart            ok       ok (89 layers)                                              0.04    0.21
# hf-vit               ok       ok (34 layers)                                              0.04    0.09
# hf-deit              ok       ok (34 layers)                                              0.02    0.09
# hf-beit              ok       ok (45 layers)                                              0.03    0.13
# hf-dinov2            ok       ok (40 layers)                                              0.02    0.34
# hf-swin              ok       ok (83 layers)                                              0.06    0.23
# hf-swinv2            ok       ok (133 layers)                                             0.06    0.30
# hf-convnext          ok       ok (23 layers)                                              0.02    0.05
# hf-convnextv2        ok       ok (23 layers)                                              0.02    0.06
# hf-resnet            ok       ok (26 layers)                                              0.02    0.07
# hf-regnet            ok       ok (44 layers)                                              0.02    0.12
# hf-bit               ok       ok (36 layers)                                              0.02    0.11
# hf-poolformer        ok       ok (37 layers)                                              0.02    0.06
# hf-mobilevit         ok       ok (266 layers)                                             0.07    0.66
# hf-mobilenet-v2      ok       ok (204 layers)                                             0.10    0.60
# hf-focalnet          ok       ok (70 layers)                                              0.03    0.38
# hf-segformer         ok       ok (46 layers)                                              0.03    0.11
# hf-segformer-seg     ok       ok (54 layers)                                              0.02    0.16
# monai-unet           ok       ok (37 layers)                                              0.02    0.08
# monai-unet-bn        ok       ok (37 layers)                                              0.02    0.09
# monai-segresnet      ok       ok (37 layers)                                              0.06    0.09
# monai-dynunet        ok       ok (35 layers)                                              0.07    0.10
# monai-dynunet-ds     ok       ok (66 layers)                                              0.06    0.17
# monai-basicunet      ok       ok (89 layers)                                              0.75    0.31
# monai-basicunetpp    ok       ok (165 layers)                                             0.45    0.36
# monai-attentionunet  ok       ok (63 layers)                                              0.06    0.19
# monai-highresnet     ok       ok (39 layers)                                              0.07    0.20
# monai-mednext-ds     ok       ok (127 layers)                                             0.07    0.30
# monai-segresnetds    ok       ok (47 layers)                                              0.08    0.17
# monai-unetr          ok       ok (313 layers)                                             0.17    1.05
# monai-swinunetr      ok       ok (196 layers)                                             3.67    0.61
# monai-densenet       ok       ok (41 layers)                                              0.01    0.10
# monai-resnet10       ok       ok (39 layers)                                              0.07    0.10
# monai-vit            ok       ok (45 layers)                                              0.01    0.10
# monai-vitautoenc     ok       ok (44 layers)                                              0.01    0.08
# monai-autoencoder    ok       ok (11 layers)                                              0.00    0.03
# monai-localnet       ok       ok (69 layers)                                              0.61    0.20
# monai-regunet        ok       ok (36 layers)                                              0.03    0.11
#
# * the branch is transformers' warn_if_padding_and_no_attention_mask: `pad_token_id in input_ids[:, [-1, 0]]`,
#   on the input ids, not the weights: indexing with a list loses the input's provenance in the analysis.

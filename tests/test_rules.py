"""The analysis and the rules that the planner and the runtime share, on models nobody here wrote: what is
found (tensor-parallel regions, shared parameters, pipeline cuts, spatial refusals), what is refused and how it
reads. Single process, meta device."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from models import TinyUNet

from hybridpar.errors import PlanError
from hybridpar.parallel.apply import check_plan
from hybridpar.parallel.tensor import pair_strategies
from hybridpar.plan import check_grid, graph_of, rules
from hybridpar.plan.types import Plan

transformers = pytest.importorskip("transformers")
monai = pytest.importorskip("monai")
warnings.filterwarnings("ignore", module="monai")
transformers.logging.set_verbosity_error()


def llama(tied=True, kv_heads=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=kv_heads, use_cache=False,
                                        tie_word_embeddings=tied))


TOKENS = torch.zeros(2, 16, dtype=torch.long)


def test_llama_attention_and_gated_mlp_are_split_by_heads():
    """q, k and v by columns (each rank whole query heads and whole key / value heads), the rotary products and
    attention on the local heads, o by rows; gate and up by columns, their product, down by rows; the tied
    embedding and head share one split of the vocabulary."""
    graph = graph_of(llama(), TOKENS)
    found = pair_strategies(graph, tp=2)
    attention = "model.layers.0.self_attn"
    assert {found[f"{attention}.{p}_proj"] for p in "qkv"} == {"column"} and found[f"{attention}.o_proj"] == "row"
    assert found[f"{attention}:scaled_dot_product_attention#0"] == "shard"
    assert all(found[f"{attention}:{op}"] == "shard" for op in ("mul#0", "neg#0", "cat#0", "add#0"))  # rotary
    mlp = "model.layers.0.mlp"
    assert (found[f"{mlp}.gate_proj"], found[f"{mlp}.up_proj"], found[f"{mlp}:mul#0"], found[f"{mlp}.down_proj"]) \
        == ("column", "column", "shard", "row")
    assert (found["model.embed_tokens"], found["lm_head"]) == ("row", "column")
    assert graph.shared == (("model.embed_tokens.weight", "lm_head.weight"),)
    # four ranks, two key / value heads: the gated MLP splits, attention does not; forced, it is refused by name
    four = pair_strategies(graph, tp=4)
    assert f"{attention}.q_proj" not in four and four[f"{mlp}.down_proj"] == "row"
    forced = {**four, **{k: v for k, v in found.items() if k.startswith(attention)}}
    with pytest.raises(PlanError, match=r"self_attn:scaled_dot_product_attention#0': 4 query heads and 2 key/value "
                                        r"heads do not split into 4; use a tensor-parallel degree that divides 2"):
        check_plan(llama(), Plan(tp=4, global_batch=2, input_shape=(2, 16), layers=tuple(forced.items())), TOKENS)


def test_a_tied_weight_is_split_alike_or_refused_naming_both_uses():
    graph = graph_of(llama(tied=True), TOKENS)
    layers = dict(pair_strategies(graph, tp=2))
    layers["lm_head"] = "row"  # splits the shared weight by its other dim
    with pytest.raises(PlanError, match=r"layer 'model.embed_tokens' \(row\) and layer 'lm_head' \(row\) share the "
                                        r"parameter 'model.embed_tokens.weight' \(also 'lm_head.weight'\)"):
        check_plan(llama(), Plan(tp=2, global_batch=2, input_shape=(2, 16), layers=tuple(layers.items())), TOKENS)
    untied = graph_of(llama(tied=False), TOKENS)
    assert untied.shared == () and not untied.unused


def test_the_analysis_gets_through_data_dependent_forwards():
    """A branch on the input's values (as Hugging Face's causal masks take) follows the real run; a branch on
    the weights cannot be taken without them, and says so."""

    class Masked(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 4)

        def forward(self, ids):
            x = self.embed(ids)
            if (ids[:, -1] == 3).all():  # the real run's values decide
                return x * 2
            return x + 1

    ids = torch.full((2, 5), 3)
    graph = graph_of(Masked(), ids)
    assert graph.layers[-1].op == "mul"
    assert graph_of(Masked(), torch.zeros(2, 5, dtype=torch.long)).layers[-1].op == "add"

    class Router(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(4, 2)

        def forward(self, x):
            return x * 2 if self.gate(x).sum() > 0 else x

    with pytest.raises(PlanError, match="branches on a value computed from the weights"):
        graph_of(Router(), (2, 4))


def test_the_analysis_leaves_the_callers_model_alone():
    with torch.device("meta"):
        model = llama()
    model.eval()
    graph_of(model, TOKENS, dtype="float64")
    assert not model.training and next(model.parameters()).dtype == torch.float32
    assert not any(k.startswith("_hp") for m in model.modules() for k in vars(m))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_pipeline_cuts_carry_keyword_inputs_and_refuse_skip_connections():
    """Between Llama's decoder layers crosses the activation and the rotary table (carried to the next stage);
    across a U-Net's skip connection cross two tensors that need gradients: refused, before anything runs."""
    graph = graph_of(llama(), TOKENS)
    second = graph.layers[graph.stage_starts[2]].name
    assert second == "model.layers.1.input_layernorm"
    groups = [list(graph.blocks[:3]), list(graph.blocks[3:])]
    crossing = rules.stage_interfaces(graph, groups)[1].receives
    values = {a.value: a for c in graph.block_calls for a in c.args}
    assert len(crossing) == 3 and sum(values[v].requires_grad for v in crossing) == 1  # activation, cos, sin
    from monai.networks.nets import UNet

    unet = UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2))
    volume = torch.zeros(2, 1, 16, 16, 16)
    blocks = graph_of(unet, volume)  # MONAI nests its skip connections inside the middle block: cuts around it
    assert [blocks.layers[i].name for i in blocks.stage_starts] == ["model.1.submodule.0.conv", "model.2.conv"]
    ours = TinyUNet(width=4)  # our U-Net's skip connection spans its blocks
    with pytest.raises(PlanError, match="a stage cannot start at 'mid.0': 2 tensors that need a gradient cross"):
        check_plan(ours, Plan(pp=2, micro_batches=2, global_batch=2, input_shape=(2, 1, 16, 16, 16),
                              stages=("mid.0",)), volume)


def test_models_that_mix_positions_are_refused_spatial_splits_by_the_operation():
    """UNETR turns its volume into tokens: the planner analyses it, offers no spatial split, and says why."""
    from monai.networks.nets import UNETR

    model = UNETR(in_channels=1, out_channels=2, img_size=(16, 16, 16), feature_size=4, hidden_size=32, mlp_dim=64,
                  num_heads=4)
    graph = graph_of(model, (2, 1, 16, 16, 16))
    with pytest.raises(PlanError, match=r"flatten on a spatially split tensor in the forward of "
                                        r"'vit.patch_embedding'.*spatial parallelism needs operators that see only "
                                        r"nearby positions.*use data, tensor or pipeline parallelism"):
        check_grid(graph, (2, 1, 1))
    check_grid(graph, (1, 1, 1))


def test_spatial_refusals_name_the_split_dims_they_break():
    refused = rules.spatial_refusals("pad", (None, (0, 0, 1, 1, 0, 0)), {}, lambda v: v is None, lambda v: None, 5,
                                     "head")
    assert [axis for axis, _ in refused] == [1]  # pads H (dim 3) only
    assert rules.first_refusal(refused, (2, 1, 1)) is None and rules.first_refusal(refused, (1, 2, 1))
    assert rules.spatial_refusals("repeat", (None, 1, 3, 1, 1, 1), {}, lambda v: v is None, lambda v: None, 5,
                                  "head") == []


def test_views_move_the_split_with_whole_blocks():
    # (B, T, H * hd) -> (B, T, H, hd) -> (B, H, T, hd): the features' split is the heads'
    assert rules.alias_dims("view", (None, 2, 8, 4, 16), {}, (0, 1, 2), (2, 8, 64), (2, 8, 4, 16)) == (0, 1, 2, None)
    assert rules.alias_dims("transpose", (None, 1, 2), {}, (0, 1, 2, None), (2, 8, 4, 16), (2, 4, 8, 16)) == \
        (0, 2, 1, None)
    # back to features, and a slice of the last dim (rotate_half) that leaves the heads whole
    assert rules.alias_dims("reshape", (None, 2, 8, 64), {}, (0, 1, 2, None), (2, 8, 4, 16), (2, 8, 64)) == (0, 1, 2)
    assert rules.alias_dims("__getitem__", (None, (Ellipsis, slice(None, 8))), {}, (0, 2, 1, None), (2, 4, 8, 16),
                            (2, 4, 8, 8)) == (0, 2, 1, None)
    assert rules.alias_dims("split", (None, 16, 2), {}, (0, 1, 2), (2, 8, 48), (2, 8, 16)) == (0, 1, None)


def test_the_planner_prices_llama_tensor_parallelism_as_the_runtime_runs_it():
    """A Llama-2-7B-shaped model (on the meta device) on 16 H100s with tp=2: the search's best plan splits each
    layer's attention by heads and its gated MLP, as ``pair_strategies`` does, and passes ``check_plan``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridpar.plan import preset, search_plans

    config = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=4,
                         num_attention_heads=32, num_key_value_heads=8, use_cache=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    tokens = torch.zeros(8, 4096, dtype=torch.long)
    graph = graph_of(model, tokens, dtype="bfloat16")
    plan = search_plans(graph, None, preset("h100").with_devices(16), global_batch=64, dtype="bfloat16",
                        tp=2).plans[0]
    layers = dict(plan.layers)
    for i in range(4):
        attention, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        assert [layers.get(f"{attention}.{p}_proj") for p in "qkvo"] == ["column"] * 3 + ["row"]
        assert [layers.get(f"{mlp}.{p}_proj") for p in ("gate", "up", "down")] == ["column", "column", "row"]
    check_plan(model, plan, tokens[:1].expand(64, -1))

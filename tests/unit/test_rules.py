"""The analysis and the rules that the planner and the runtime share, on models nobody here wrote: what is
found (tensor-parallel regions, shared parameters, pipeline cuts, spatial refusals), what is refused and how it
reads. Single process, meta device."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from hybridpar.errors import PlanError
from hybridpar.ir import rules
from hybridpar.ir.check import check_strategies
from hybridpar.ir.types import Plan
from hybridpar.parallel.plan_check import check_plan
from hybridpar.parallel.tensor import pair_strategies
from hybridpar.plan import check_grid, graph_of
from support.models import TinyUNet

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
    with pytest.raises(PlanError, match=r"on a spatially split tensor in the forward of 'vit\..*"
                                        r"leave spatial at 1 and use data, tensor or pipeline parallelism"):
        check_grid(graph, (2, 1, 1))
    check_grid(graph, (1, 1, 1))


def test_the_spatial_rule_names_the_split_dims_it_breaks():
    volume = object()  # a (1, 2, 8, 8, 8) tensor split along its three spatial dims

    def rule(name, *args, out=(1, 2, 8, 8, 8), **kwargs):
        return rules.spatial_rule(name, (volume, *args), kwargs, out, lambda v: (2, 3, 4) if v is volume else None,
                                  lambda v: (1, 2, 8, 8, 8) if v is volume else None, "head")

    refused, _ = rule("pad", (0, 0, 1, 1, 0, 0))
    assert [axis for axis, _ in refused] == [1]  # pads H (dim 3) only
    assert rules.first_refusal(refused, (2, 1, 1)) is None and rules.first_refusal(refused, (1, 2, 1))
    assert rule("repeat", 1, 3, 1, 1, 1)[0] == []


def test_the_split_follows_a_permute_and_a_norm_over_the_channels():
    """A channels-last norm (permute, a norm over the channels, permute back) runs on slabs as it is; a reshape
    that gives the size of a split dim literally, or joins it as an inner dim, is refused for that axis."""
    volume = object()

    def rule(name, args, out, place=(2, 3, 4), shape=(1, 2, 8, 8, 8), **kwargs):
        return rules.spatial_rule(name, (volume, *args), kwargs, out, lambda v: place if v is volume else None,
                                  lambda v: shape if v is volume else None, "block")

    assert rule("permute", (0, 2, 3, 4, 1), (1, 8, 8, 8, 2)) == ([], (1, 2, 3))
    assert rule("layer_norm", ((2,),), (1, 8, 8, 8, 2), place=(1, 2, 3), shape=(1, 8, 8, 8, 2)) == ([], (1, 2, 3))
    assert rule("layer_norm", ((8, 2),), (1, 8, 8, 8, 2), place=(1, 2, 3), shape=(1, 8, 8, 8, 2))[0][0][0] == 2
    refused, placement = rule("flatten", (2,), (1, 2, 512))  # depth stays the outermost: its slabs are whole runs
    assert [axis for axis, _ in refused] == [1, 2] and placement == (2, None, None)
    refused, _ = rule("view", (1, 2, 512), (1, 2, 512))
    assert [axis for axis, _ in refused] == [0, 1, 2] and "give that size as -1" in refused[0][1]
    assert rule("view", (1, 2, -1), (1, 2, 512))[1] == (2, None, None)


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


# --- what a review found: each a plan the rules must refuse, or a fact the analysis must record ---------

class _Gated(nn.Module):
    """A gate computed inside one module: its halves pair up only on the whole features."""

    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(a) * b


class _Around(nn.Module):
    def __init__(self, act, width=64):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(16, 64), act, nn.Linear(width, 16)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


@pytest.mark.parametrize("act, width", [(_Gated(), 32), (nn.GLU(), 32), (nn.Softmax(dim=-1), 64)],
                         ids=["chunked-gate", "GLU", "Softmax"])
def test_modules_that_mix_features_do_not_run_split(act, width):
    """A softmax over the features, or a gate that pairs its input's two halves, computes something else on a
    rank's share of the features: not a shard layer, not found, refused."""
    graph = graph_of(_Around(act, width), (2, 8, 16))
    assert {"up", "act"}.isdisjoint(pair_strategies(graph, tp=2))  # (the output layer splits alone)
    with pytest.raises(PlanError, match="layer 'act'"):
        check_strategies({"up": "column", "act": "shard", "down": "row"}, graph, 2)


def test_a_transposing_property_moves_the_split():
    class Square(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):  # (2, 8, 8): .mT swaps the split features into the middle
            return self.down(torch.relu(self.up(x)).mT)

    graph = graph_of(Square(), (2, 8, 8))
    assert "up" not in pair_strategies(graph, tp=2)
    with pytest.raises(PlanError, match="layer 'down' \\(row\\) reads its input split along dim 1"):
        check_strategies({"up": "column", "relu#0": "shard", "down": "row"}, graph, 2)


def test_a_module_called_twice_is_not_split():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.a(self.b(torch.relu(self.a(x))))

    graph = graph_of(Twice(), (2, 4, 8))
    assert "a" not in pair_strategies(graph, tp=2)
    with pytest.raises(PlanError, match="calls this module more than once"):
        check_strategies({"a": "column", "relu#0": "shard", "b": "row"}, graph, 2)


def test_parameters_used_through_their_views_are_seen():
    """A head written as ``h @ emb.weight.T`` ties the embedding (so it is not split alone), and a parameter
    used as ``log_scale.exp()`` is used."""
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.ff = nn.Embedding(16, 8), nn.Linear(8, 8)
            self.log_scale = nn.Parameter(torch.zeros(8))

        def forward(self, ids):
            return (self.ff(self.emb(ids)) * self.log_scale.exp()) @ self.emb.weight.T

    graph = graph_of(Tied(), torch.zeros(2, 4, dtype=torch.long))
    assert graph.shared == (("emb.weight",),) and graph.unused == ()
    assert "emb" not in pair_strategies(graph, tp=2)


def test_a_module_reused_inside_blocks_keeps_them_a_chain():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.act = nn.Linear(8, 8), nn.Linear(8, 8), nn.ReLU()

        def forward(self, x):
            return self.act(self.b(self.act(self.a(x))))

    graph = graph_of(nn.Sequential(Block(), Block(), Block()), (2, 8))
    assert graph.is_chain and None not in graph.block_index and len(graph.stage_starts) == 2


def test_tied_layers_that_would_split_unalike_replicate_with_their_regions():
    class Loop(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.ln = nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8)

        def forward(self, x):
            return self.ln(self.a(self.b(torch.relu(self.a(x)))))

    graph = graph_of(Loop(), (2, 4, 8))
    check_strategies(pair_strategies(graph, tp=2), graph, 2)  # whatever it splits runs


def test_the_search_proposes_only_what_validate_accepts():
    """A column layer read by a row layer and by another whole reader: it gathers, the row layer slices."""
    from hybridpar.plan import preset, search_plans, validate

    class Two(nn.Module):
        def __init__(self, d=1024):
            super().__init__()
            self.x, self.y, self.ln = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.LayerNorm(4 * d)

        def forward(self, x):
            h = self.x(x)
            return self.y(h) + self.ln(h).sum(-1, keepdim=True)

    graph = graph_of(Two(), (8, 512, 1024))
    spec = preset("h100").with_devices(2)
    for plan in search_plans(graph, None, spec, global_batch=8, tp=2).plans:
        validate(plan, graph, spec)
        check_strategies(dict(plan.layers), graph, 2)


def test_a_stage_cannot_start_inside_layers_that_split_together():
    """A stage receives what crosses in its global shape: a cut inside a split region (between a column layer
    and its row layer) is refused; the search does not propose it."""
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 8))
    layers = (("0", "column"), ("1", "shard"), ("2", "row"))
    plan = Plan(tp=2, pp=2, micro_batches=2, global_batch=4, input_shape=(4, 8), layers=layers, stages=("1",))
    with pytest.raises(PlanError, match="a stage cannot start at '1': '0' leaves its output split over tp there"):
        check_plan(model, plan, torch.zeros(4, 8))
    check_plan(model, Plan(**{**vars(plan), "stages": ("3",), "prediction": None}), torch.zeros(4, 8))


def test_a_cut_where_model_code_joins_two_blocks_is_refused():
    """GPT-2 adds its token and position embeddings in its own forward: a stage cannot start at the position
    embedding (the sum needs both), and can at the dropout after the sum (which the stage before sends)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=4, n_positions=8, use_cache=False))
    graph = graph_of(model, torch.zeros(2, 8, dtype=torch.long))
    wpe, drop = (graph.blocks.index(f"transformer.{n}") for n in ("wpe", "drop"))
    assert "combines values from blocks on both sides" in rules.stage_cut_refusal(graph, wpe)
    assert rules.stage_cut_refusal(graph, drop) is None

"""Networks nobody here wrote, from the libraries our users train (Hugging Face ``transformers``, MONAI), built tiny
in code with random weights: each plan against one process in float64 (the loss, every gradient, the
parameters after one Adam step, the whole state dict), or refused before any communication with an error that
names the module and what to do instead."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from hybridpar import parallelize
from hybridpar.errors import PlanError
from hybridpar.ir.types import Plan
from hybridpar.models.gpt import lm_loss
from hybridpar.parallel.tensor import pair_strategies
from hybridpar.plan import graph_of
from hybridpar.spatial import shard
from support.equivalence import check_step, plan_mesh, replica_slice

transformers = pytest.importorskip("transformers")
monai = pytest.importorskip("monai")
warnings.filterwarnings("ignore", module="monai")
transformers.logging.set_verbosity_error()

BATCH, T, VOCAB = 4, 8, 32


# --- Hugging Face language models ---------------------------------------------------------------------

def llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T,
                         tie_word_embeddings=tied, use_cache=False, attention_dropout=0.0)
    return LlamaForCausalLM(config)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=T, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


LANGUAGE = {"llama-tied": lambda: llama(True), "llama": lambda: llama(False), "gpt2": gpt2}
STAGES = {  # the first layer of each stage after the first, for 2 and 4 stages
    "llama-tied": {2: ("model.layers.1.input_layernorm",),
                   4: ("model.layers.0.input_layernorm", "model.layers.1.input_layernorm", "model.norm")},
    "gpt2": {2: ("transformer.h.1.ln_1",), 4: ("transformer.h.0.ln_1", "transformer.h.1.ln_1", "transformer.ln_f")},
}
STAGES["llama"] = STAGES["llama-tied"]
LANGUAGE_PLANS = {  # world size, plan fields
    "tp2": (2, dict(tp=2)),
    "pp2": (2, dict(pp=2, micro_batches=2)),
    # all forwards first, then each block recomputed in backward: a stage must recompute with what it was sent then
    "pp2-gpipe-checkpointing": (2, dict(pp=2, micro_batches=2, schedule="gpipe", checkpointing=True)),
    "tp2-pp2": (4, dict(tp=2, pp=2, micro_batches=2)),
    # the head cut off into a stage of its own: split, tied to the first stage's embedding (once a crash)
    "tp2-pp2-head": (4, dict(tp=2, pp=2, micro_batches=2, stages=("lm_head",))),
    "fsdp2-tp2": (4, dict(dp=2, tp=2, sharding=3)),
    "pp4": (4, dict(pp=4, micro_batches=4)),  # the tied copies on the first and last of four ranks
    "dp2-shares": (2, dict(dp=2, shares=(3, 1))),  # a slow replica's share (rebalancing)
    "fsdp2-tp2-shares": (4, dict(dp=2, tp=2, sharding=3, shares=(1, 3))),
}


def tokens():
    window = torch.randint(0, VOCAB, (BATCH, T + 1), generator=torch.Generator().manual_seed(1))
    return window[:, :-1], window[:, 1:]


def language_equivalence(name: str, fields: dict) -> float:
    torch.manual_seed(0)
    model = LANGUAGE[name]().double()
    reference = copy.deepcopy(model)
    idx, targets = tokens()
    fields = dict(fields)
    if fields.get("tp", 1) > 1:
        fields["layers"] = tuple(pair_strategies(graph_of(model, idx, dtype="float64"), tp=fields["tp"]).items())
    if fields.get("pp", 1) > 1 and "stages" not in fields:
        fields["stages"] = STAGES[name][fields["pp"]]
    plan = Plan(global_batch=BATCH, input_shape=(BATCH, T), dtype="float64", **fields)
    parallel = parallelize(model, plan, plan_mesh(plan), loss_fn=lm_loss, example_input=idx)
    mine = replica_slice(parallel)
    loss = parallel.train_step(idx[mine], targets[mine])
    return check_step(parallel, reference, loss, lm_loss(reference(idx).logits, targets))


def _by_world(plans: dict) -> list:
    """The plans as test parameters, those of 4 ranks in the slow set."""
    return [pytest.param(*(key if isinstance(key, tuple) else (key,)), marks=pytest.mark.slow) if world == 4
            else key for key, (world, _) in plans.items()]


@pytest.mark.parametrize("plan", _by_world(LANGUAGE_PLANS))
@pytest.mark.parametrize("name", LANGUAGE)
def test_language_models(dist2, dist4, name, plan):
    world, fields = LANGUAGE_PLANS[plan]
    (dist2 if world == 2 else dist4).run(language_equivalence, name=name, fields=fields)


# --- MONAI volume networks ------------------------------------------------------------------------------

def monai_net(name: str):
    from monai.networks.nets import UNETR, BasicUNet, DynUNet, SegResNet, UNet

    return {
        "unet": lambda: UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8, 16), strides=(2, 2)),
        "unet-batchnorm": lambda: UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=(4, 8, 16),
                                       strides=(2, 2), norm="batch"),
        "segresnet": lambda: SegResNet(spatial_dims=3, init_filters=8, in_channels=1, out_channels=2,
                                       blocks_down=(1, 2), blocks_up=(1,)),
        "dynunet": lambda: DynUNet(3, 1, 2, kernel_size=[3, 3, 3], strides=[1, 2, 2], upsample_kernel_size=[2, 2],
                                   filters=[4, 8, 16]),
        "basicunet": lambda: BasicUNet(spatial_dims=3, in_channels=1, out_channels=2, features=(4, 4, 8, 8, 16, 4)),
        "unetr": lambda: UNETR(in_channels=1, out_channels=2, img_size=(16, 16, 16), feature_size=4, hidden_size=32,
                               mlp_dim=64, num_heads=4),
    }[name]()


EDGE = {"basicunet": 32}  # four halvings need 32 rows to end on two


def volumes(name: str, batch: int = 2):
    edge = EDGE.get(name, 16)
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch, 1, edge, edge, edge, dtype=torch.float64, generator=g),
            torch.randn(batch, 2, edge, edge, edge, dtype=torch.float64, generator=g))


def volume_equivalence(name: str, fields: dict, batch: int = 2) -> float:
    """One step of a MONAI network under the plan against one process; spatial ranks take their slab of each
    sample and the loss is the global volume's mean."""
    from hybridpar.spatial import mse_loss

    torch.manual_seed(0)
    model = monai_net(name).double()
    reference = copy.deepcopy(model)
    x, y = volumes(name, batch)
    plan = Plan(global_batch=batch, input_shape=tuple(x.shape), dtype="float64", **fields)
    mesh = plan_mesh(plan)
    spatial = plan.dims.num_spatial > 1
    loss_fn = (lambda out, target: mse_loss(out, target, mesh["spatial"])) if spatial else F.mse_loss
    parallel = parallelize(model, plan, mesh, loss_fn=loss_fn, example_input=x)
    mine = replica_slice(parallel)
    x_mine, y_mine = (shard(t[mine], mesh["spatial"], grid=plan.grid) if spatial else t[mine] for t in (x, y))
    loss = parallel.train_step(x_mine, y_mine)
    return check_step(parallel, reference, loss, F.mse_loss(reference(x), y))


VOLUME_PLANS = {  # network, plan: world size, plan fields
    ("unet", "spatial2"): (2, dict(spatial=(2, 1, 1))),
    ("unet", "dp2-spatial2"): (4, dict(dp=2, spatial=(1, 2, 1))),
    ("unet-batchnorm", "dp2"): (2, dict(dp=2)),
    ("unet-batchnorm", "dp2-spatial2"): (4, dict(dp=2, spatial=(2, 1, 1))),
    ("segresnet", "spatial2"): (2, dict(spatial=(2, 1, 1))),
    ("dynunet", "spatial2"): (2, dict(spatial=(1, 1, 2))),
    ("dynunet", "fsdp2"): (2, dict(dp=2, sharding=3)),
    ("basicunet", "spatial2"): (2, dict(spatial=(2, 1, 1))),
    ("unetr", "dp2"): (2, dict(dp=2)),
    # uneven slabs and shares (rebalancing around a slow rank): rows in proportion to the weights
    ("unet", "spatial2-slabs"): (2, dict(spatial=(2, 1, 1), slabs=((5, 3), (), ()))),
    ("unet-batchnorm", "dp2-shares-spatial2-slabs"): (4, dict(dp=2, shares=(3, 1), spatial=(1, 2, 1),
                                                            slabs=((), (1, 3), ()))),
    ("segresnet", "spatial2-slabs"): (2, dict(spatial=(2, 1, 1), slabs=((2, 1), (), ()))),
}


def unetr_spatial_refusal() -> str:
    """UNETR turns its volume into tokens (a patch embedding, a flatten): a spatial split is refused by name before
    any communication, with what to use instead."""
    model = monai_net("unetr")
    x, _ = volumes("unetr")
    plan = Plan(spatial=(2, 1, 1), global_batch=2, input_shape=tuple(x.shape))
    with pytest.raises(PlanError) as err:
        parallelize(model, plan, plan_mesh(plan), loss_fn=F.mse_loss, example_input=x)
    return str(err.value)


def test_unetr_refuses_a_spatial_split_before_any_communication(dist2):
    first, second = dist2.run(unetr_spatial_refusal)
    # the depth split survives the patch embedding's flatten into tokens (depth stays outermost) and breaks at the
    # first attention, which reshapes the tokens with their count given literally
    assert first == second and "reshape on a spatially split tensor in the forward of 'vit.blocks.0.attn" in first
    assert "use data, tensor or pipeline parallelism" in first


@pytest.mark.parametrize("name, plan", _by_world(VOLUME_PLANS))
def test_volume_networks(dist2, dist4, name, plan):
    world, fields = VOLUME_PLANS[name, plan]
    batch = sum(fields.get("shares", ())) or 2
    (dist2 if world == 2 else dist4).run(volume_equivalence, name=name, fields=fields, batch=batch)


# --- the catalogue: what the search proposes, the runtime runs ------------------------------------------

def catalogue_model(name: str):
    """A model of the catalogue (float32, seeded) and one step's global batch (8 samples) of its input and target."""
    from hybridpar.models.cosmoflow import cosmoflow
    from hybridpar.models.gpt import gpt
    from hybridpar.models.unet3d import unet3d

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if name in LANGUAGE or name == "gpt":
        model = LANGUAGE[name]() if name != "gpt" else gpt(vocab_size=VOCAB, seq_len=T, num_layers=2, num_heads=4,
                                                           d_model=16)
        window = torch.randint(0, VOCAB, (8, T + 1), generator=g)
        return model, window[:, :-1], window[:, 1:]
    if name == "cosmoflow":
        model = cosmoflow(size=32, in_channels=2, base_channels=4, num_blocks=2, fc_sizes=(8,), num_outputs=2)
        return model, torch.randn(8, 2, 32, 32, 32, generator=g), torch.randn(8, 2, generator=g)
    model = unet3d(in_channels=1, num_classes=2, base_channels=4, depth=2) if name == "unet3d" else monai_net(name)
    edge = EDGE.get(name, 16)
    return model, torch.randn(8, 1, edge, edge, edge, generator=g), torch.randn(8, 2, edge, edge, edge, generator=g)


CATALOGUE = ["cosmoflow", "unet3d", "gpt", "unet", "segresnet", "dynunet", "basicunet", "unetr", "llama-tied", "llama",
             "gpt2"]


def searched(name: str, devices: int, top: int = 3, **constraints):
    from hybridpar.plan import preset, search_plans

    model, x, _ = catalogue_model(name)
    return model, x, search_plans(model, x, preset("a100-80").with_devices(devices), top=top, **constraints).plans


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("unetr", "basicunet") else n
                                  for n in CATALOGUE])
def test_the_plans_the_search_proposes_pass_the_runtimes_checks(name):
    """For 2, 4 and 8 devices, the search's three best plans pass ``check_plan`` (what ``parallelize`` checks
    before any communication): one set of rules for both."""
    from hybridpar.parallel.plan_check import check_plan

    for devices in (2, 4, 8):
        model, x, plans = searched(name, devices)
        assert plans, (name, devices)
        for plan in plans:
            check_plan(model, plan, x)


def searched_equivalence(name: str, constraints: dict) -> str:
    """The search's best plan for this world's devices (under ``constraints``), run in float64 against one
    process."""
    from hybridpar.spatial import mse_loss

    model, x, plans = searched(name, dist_world(), **constraints)
    plan = plans[0]
    _, x, y = catalogue_model(name)
    model, x = model.double(), (x.double() if x.is_floating_point() else x)
    y = y.double() if y.is_floating_point() else y
    reference = copy.deepcopy(model)
    mesh = plan_mesh(plan)
    spatial = plan.dims.num_spatial > 1
    tokens_in = not x.is_floating_point()
    loss_fn = lm_loss if tokens_in else (
        (lambda out, target: mse_loss(out, target, mesh["spatial"])) if spatial else F.mse_loss)
    parallel = parallelize(model, plan, mesh, loss_fn=loss_fn, example_input=x)
    mine = replica_slice(parallel)
    x_mine, y_mine = (shard(t[mine], mesh["spatial"], grid=plan.grid) if spatial else t[mine] for t in (x, y))
    loss = parallel.train_step(x_mine, y_mine)
    output = reference(x)
    expected = lm_loss(output.logits if hasattr(output, "logits") else output, y) if tokens_in else \
        F.mse_loss(output, y)
    check_step(parallel, reference, loss, expected)
    return plan.describe()


def dist_world() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


SEARCHES = {"best": {}, "model-parallel": dict(dp=1), "tensor-parallel": dict(tp=2)}  # the first plan of each


@pytest.mark.slow
@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("name", CATALOGUE)
def test_the_searched_plan_equals_one_process(dist4, name, search):
    """On 4 processes, the search's best plan (and its best with dp = 1, and with tp = 2: tiny models are
    fastest data-parallel, and these reach the other runtimes) equals one process."""
    described = dist4.run(searched_equivalence, name=name, constraints=SEARCHES[search])
    assert len(set(described)) == 1


def tied_checkpoint(path: str, fields: dict, save: bool) -> dict:
    """A tied Llama saved under one plan (after an Adam step) and loaded under another: every name of the shared
    weight is kept, and the loaded model holds the saved weights."""
    from hybridpar.parallel import checkpoint

    torch.manual_seed(0 if save else 7)  # the model that loads starts from other weights
    model = llama(True).double()
    idx, targets = tokens()
    fields = dict(fields)
    if fields.get("tp", 1) > 1:
        fields["layers"] = tuple(pair_strategies(graph_of(model, idx, dtype="float64"), tp=fields["tp"]).items())
    if fields.get("pp", 1) > 1:
        fields["stages"] = STAGES["llama-tied"][fields["pp"]]
    plan = Plan(global_batch=BATCH, input_shape=(BATCH, T), dtype="float64", **fields)
    parallel = parallelize(model, plan, plan_mesh(plan), loss_fn=lm_loss, example_input=idx)
    optimizer = torch.optim.Adam(parallel.parameters(), lr=1e-2)
    if save:
        mine = replica_slice(parallel)
        parallel.train_step(idx[mine], targets[mine])
        optimizer.step()
        checkpoint.save(parallel, optimizer, path)
    else:
        checkpoint.load(parallel, optimizer, path)
    return parallel.full_state_dict()


def test_a_tied_checkpoint_moves_between_plans(dist2, tmp_path):
    path = str(tmp_path / "tied")
    saved = dist2.run(tied_checkpoint, path=path, fields=dict(tp=2), save=True)[0]
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(saved)
    assert torch.equal(saved["model.embed_tokens.weight"], saved["lm_head.weight"])
    for loaded in dist2.run(tied_checkpoint, path=path, fields=dict(pp=2, micro_batches=2), save=False):
        assert set(loaded) == set(saved)
        for name, value in saved.items():
            torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)

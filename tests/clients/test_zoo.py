"""The zoo: models nobody here wrote (``support.zoo``: Hugging Face decoders, encoders, encoder-decoders and vision
models, MONAI's 3D networks, built tiny from the libraries' own configs), each under the search's three best plans
at 2 and 4 ranks and a hand plan on every axis (``support.zoo_runs``): every plan equals one process in float64
(the loss, every gradient, one Adam step) or is refused before any communication with one line naming what stops
it. No crash, no mismatch, every rank alike. A parallel-trained model goes back to its library (``save_pretrained``
and ``from_pretrained``, a MONAI state dict) with the same weights."""

from __future__ import annotations

import re

import pytest
import torch

from hybridpar.errors import HybridparError
from support import zoo_runs
from support.zoo import ZOO

transformers = pytest.importorskip("transformers")
monai = pytest.importorskip("monai")

MODELS = [  # the zoo's classes of model, 50 of its 86 (its slowest, and near copies of these, left out)
    # decoders: grouped-query attention, rotary tables, gated MLPs, fused projections, tied heads, mixture of experts
    "hf-llama", "hf-mistral", "hf-qwen2", "hf-qwen3", "hf-gemma", "hf-phi", "hf-phi3", "hf-gpt-neox", "hf-opt",
    "hf-bloom", "hf-falcon", "hf-gptj", "hf-gpt-bigcode", "hf-gpt2", "hf-mixtral", "hf-cohere",
    # encoders: a head's bias under two names (BERT), one layer called several times (ALBERT), relative positions
    "hf-bert-mlm", "hf-bert", "hf-roberta-mlm", "hf-distilbert", "hf-albert", "hf-electra", "hf-deberta-v2",
    "hf-modernbert-mlm", "hf-esm-mlm",
    # encoder-decoders: one embedding shared by the encoder, the decoder and the head
    "hf-t5", "hf-bart", "hf-pegasus", "hf-marian",
    # vision: transformers, channels-last norms, CNNs with batch norm, windows
    "hf-vit", "hf-beit", "hf-swin", "hf-swinv2", "hf-convnext", "hf-resnet", "hf-regnet", "hf-poolformer",
    "hf-mobilenet-v2", "hf-segformer-seg",
    # MONAI: U-Nets, deep supervision, a module registered twice, a ViT encoder, regressors
    "monai-unet", "monai-unet-bn", "monai-segresnet", "monai-dynunet", "monai-dynunet-ds", "monai-attentionunet",
    "monai-highresnet", "monai-segresnetds", "monai-unetr", "monai-densenet", "monai-vit", "monai-autoencoder",
    "monai-localnet",
]


def names_a_place(message: str, model: str) -> bool:
    """A refusal names what stops the plan: a module, layer, block or parameter (quoted), or the model's class."""
    return bool(re.search(r"'[\w.:#<>]+'", message)) or re.search(rf"\b{model}\b", message) is not None


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_every_plan_equals_one_process_or_is_refused_in_one_line(dist2, dist4, name, world):
    pool = dist2 if world == 2 else dist4
    model = type(zoo_runs.build(name)).__name__
    try:
        plans = zoo_runs.plans_of(name, world)
    except HybridparError as err:  # the model cannot be analysed (a router that branches on the weights)
        assert "\n" not in str(err) and names_a_place(str(err), model), str(err)
        return
    outcomes = {}
    for key, plan in plans.items():
        kind, detail = zoo_runs.outcome(pool.run(zoo_runs.run, timeout=300, name=name, plan_json=plan.to_json()))
        outcomes[key] = (kind, plan.describe(), detail)
        if kind == "refused":
            assert "\n" not in detail and names_a_place(detail, model), f"{key} ({plan.describe()}): {detail}"
    assert outcomes, name
    assert any(kind == "exact" for kind, _, _ in outcomes.values()), outcomes  # a plan of the search runs


def round_trip(name: str) -> dict:
    """One Adam step of the model at tp=2 (where the search splits it, else dp=2), its whole state dict gathered,
    loaded into a fresh library model, saved by the library and loaded back: ``{name: max difference}``."""
    import tempfile

    import torch.distributed as dist

    from hybridpar import parallelize
    from hybridpar.ir.analysis import graph_of
    from hybridpar.ir.types import Plan
    from hybridpar.parallel.tensor import pair_strategies
    from support.equivalence import plan_mesh, replica_slice
    from support.zoo import to_library

    entry = ZOO[name]
    model = zoo_runs.build(name)
    x, y = zoo_runs.inputs(name)
    layers = tuple(pair_strategies(graph_of(model, x, dtype="float64"), tp=2).items())
    fields = dict(tp=2, layers=layers) if layers else dict(dp=2)
    plan = Plan(global_batch=len(x), input_shape=tuple(x.shape), dtype="float64", **fields)
    parallel = parallelize(model, plan, plan_mesh(plan), loss_fn=entry.loss, example_input=x)
    optimizer = torch.optim.Adam(parallel.parameters(), lr=1e-2)
    mine = replica_slice(parallel)
    parallel.train_step(x[mine], y[mine])
    optimizer.step()
    state = parallel.full_state_dict()
    if dist.get_rank() != 0:  # one process writes the folder, as a training script would
        return {}
    trained = to_library(name, state)
    with tempfile.TemporaryDirectory() as folder:
        if entry.library == "transformers":
            trained.save_pretrained(folder)
            loaded = type(trained).from_pretrained(folder, torch_dtype=torch.float64)
        else:
            torch.save(trained.state_dict(), folder + "/weights.pt")
            loaded = to_library(name, {f"model.{k}": v for k, v in
                                       torch.load(folder + "/weights.pt", weights_only=True).items()})
    mine = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
    theirs = loaded.state_dict()
    assert set(theirs) == set(mine), set(theirs) ^ set(mine)
    return {k: float((theirs[k].double() - v.double()).abs().max()) if v.numel() else 0.0 for k, v in mine.items()}


@pytest.mark.parametrize("name", ["hf-llama", "hf-gpt2", "hf-bert-mlm", "hf-t5", "monai-unet", "monai-segresnet"])
def test_a_parallel_trained_model_goes_back_to_its_library_unchanged(dist2, name):
    differences = dist2.run(round_trip, name=name)[0]
    assert differences and max(differences.values()) == 0, {k: v for k, v in differences.items() if v}

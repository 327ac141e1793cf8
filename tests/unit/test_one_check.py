"""One set of rules: on random plans over models of ours and of other libraries, the planner's ``validate`` and the
runtime's ``check_plan`` accept and refuse exactly the same plans (both read ``hybridpar.ir.check``; validate then
prices, the runtime dry-runs each pipeline stage on the meta device)."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from hybridpar.errors import HybridparError
from hybridpar.ir.rules import TP_STRATEGIES
from hybridpar.ir.types import SCHEDULES, Plan
from hybridpar.parallel.plan_check import check_plan
from hybridpar.parallel.tensor import pair_strategies
from hybridpar.plan import graph_of, preset, validate

PLANS = 1000
WORLDS = (1, 2, 4, 8)


def models() -> dict:
    """Ten models on the meta device with one step's example input: ours, and Hugging Face's and MONAI's."""
    from hybridpar.models.cosmoflow import cosmoflow
    from hybridpar.models.gpt import gpt
    from hybridpar.models.unet3d import unet3d
    from support.patterns import TensorHeads
    from support.zoo import ZOO

    out = {}
    with torch.device("meta"):
        out["gpt"] = (gpt(vocab_size=32, seq_len=8, num_layers=4, num_heads=4, d_model=16),
                      torch.zeros(8, 8, dtype=torch.long))
        out["cosmoflow"] = (cosmoflow(size=32, in_channels=2, base_channels=4, num_blocks=2, fc_sizes=(8,),
                                      num_outputs=2), torch.zeros(8, 2, 32, 32, 32))
        out["unet3d"] = (unet3d(in_channels=1, num_classes=2, base_channels=4, depth=2), torch.zeros(8, 1, 16, 16, 16))
        out["heads"] = (TensorHeads(), torch.zeros(8, 8, 16))
    for name in ("hf-llama", "hf-gpt2", "hf-bert-mlm", "hf-t5", "monai-unet", "monai-segresnet"):
        torch.manual_seed(0)
        x, _ = ZOO[name].batch(8)
        out[name] = (ZOO[name].build(), x)
    return out


def random_plan(rng: random.Random, graph) -> Plan:
    """A plan drawn from the whole space (most of them wrong in some way), for ``graph``'s model."""
    world = rng.choice(WORLDS)
    rest, degrees = world, {}
    for axis in ("pp", "tp", "spatial"):
        degrees[axis] = rng.choice([d for d in (1, 2, 4) if rest % d == 0])
        rest //= degrees[axis]
    dp, tp, pp, parts = rest, degrees["tp"], degrees["pp"], degrees["spatial"]
    ndim = max(graph.spatial_ndim, 1)
    spatial = [1] * ndim
    spatial[rng.randrange(ndim)] = parts
    m = rng.choice((1, 2, 4)) if pp > 1 else rng.choice((1, 1, 1, 2))
    schedule = rng.choice(SCHEDULES)
    boundaries = pp - 1 if schedule != "interleaved-1f1b" else rng.choice((pp - 1, 2 * pp - 1))
    starts = [graph.layers[i].name for i in graph.stage_starts] or [graph.layers[-1].name]
    names = [layer.name for layer in graph.layers]
    stages = sorted(rng.sample(starts, min(boundaries, len(starts))), key=names.index) if rng.random() < 0.8 else \
        rng.sample(names, min(boundaries, len(names)))
    layers = ()
    if tp > 1:
        if rng.random() < 0.6:
            layers = tuple(pair_strategies(graph, tp=tp).items())
        else:
            layers = tuple((rng.choice(names), rng.choice(TP_STRATEGIES)) for _ in range(rng.randint(1, 4)))
    batch = rng.choice((8, 8, 8, 6))
    return Plan(dp=dp, spatial=tuple(spatial), tp=tp, pp=pp, global_batch=batch, micro_batches=m,
                sharding=rng.choice((0, 0, 1, 2, 3)), checkpointing=rng.random() < 0.2, stages=tuple(stages),
                schedule=schedule, layers=layers, sequence_parallel=tp > 1 and rng.random() < 0.2,
                input_shape=tuple(graph.input_shape))


def verdict(run) -> str:
    try:
        run()
    except HybridparError as err:
        return f"refused: {err}"
    return "accepted"


@pytest.mark.slow
def test_validate_and_the_runtime_check_accept_and_refuse_the_same_plans():
    rng = random.Random(29)
    analysed = {name: (model, x, graph_of(model, x)) for name, (model, x) in models().items()}
    accepted = disagreed = 0
    for k in range(PLANS):
        name = rng.choice(sorted(analysed))
        model, x, graph = analysed[name]
        plan = random_plan(rng, graph)
        cluster = preset("a100-80").with_devices(plan.world_size)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            planner = verdict(lambda: validate(plan, graph, cluster))
            runtime = verdict(lambda: check_plan(model, plan, x, graph))
        assert (planner == "accepted") == (runtime == "accepted"), \
            f"plan {k} for {name} ({plan.describe()}, stages {plan.stages}): validate {planner}; check_plan {runtime}"
        accepted += planner == "accepted"
        disagreed += planner != runtime
    assert accepted >= PLANS // 10, accepted  # the plans reach the accepting side of the rules, not only refusals

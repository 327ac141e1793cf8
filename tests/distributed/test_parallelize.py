"""``hybridpar.parallelize``: a plan turns an ordinary model into a tensor- x pipeline- x (sharded) data-parallel
job; each combination against one process from the same weights and the same global batch (float64: the loss,
every gradient via ``gather_gradients()``, one Adam step via ``full_state_dict()``)."""

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridpar import parallelize
from hybridpar.errors import PlanError
from hybridpar.ir.types import Plan
from hybridpar.mesh import AXES
from hybridpar.models.cosmoflow import cosmoflow
from hybridpar.models.gpt import gpt, lm_loss
from hybridpar.parallel import checkpoint
from hybridpar.parallel.tensor import pair_strategies
from hybridpar.plan import cluster_of, graph_of, search_plans
from hybridpar.spatial import shard
from support import harness
from support.equivalence import TOL, check_step, plan_mesh, replica_slice
from support.models import TINY_GPT, Attention

BATCH, T, VOCAB = 8, 8, 16


def tiny_gpt(seed: int = 0):
    torch.manual_seed(seed)
    return gpt(vocab_size=VOCAB, seq_len=T, num_layers=4, num_heads=4, d_model=16).double()


def tokens():
    g = torch.Generator().manual_seed(1)
    window = torch.randint(0, VOCAB, (BATCH, T + 1), generator=g)
    return window[:, :-1], window[:, 1:]


def gpt_plan(**fields) -> Plan:
    """A plan for ``tiny_gpt`` on this world; ``tp > 1`` splits the layers ``pair_strategies`` finds."""
    tp = fields.get("tp", 1)
    layers = ()
    if tp > 1:
        model, (idx, _) = tiny_gpt(), tokens()
        layers = tuple(pair_strategies(graph_of(model, idx, dtype="float64"), tp=tp).items())
    return Plan(global_batch=BATCH, input_shape=(BATCH, T), layers=layers, dtype="float64", **fields)


def equivalence(fields: dict) -> float:
    """One training step of ``tiny_gpt`` under the plan against one process; returns the loss."""
    plan = gpt_plan(**fields)
    model = tiny_gpt()
    reference = copy.deepcopy(model)
    idx, targets = tokens()
    parallel = parallelize(model, plan, plan_mesh(plan), loss_fn=lm_loss, example_input=idx)
    tokens_seen = []
    if plan.sequence_parallel:  # the norms really run on sequence shards
        norm = next(m for module in parallel.modules.values() for m in module.modules()
                    if isinstance(m, torch.nn.LayerNorm))
        norm.register_forward_pre_hook(lambda m, args: tokens_seen.append(args[0].to_local().shape[1]))
    mine = replica_slice(parallel)
    loss = parallel.train_step(idx[mine], targets[mine])
    assert set(tokens_seen) == ({T // plan.tp} if plan.sequence_parallel else set())
    return check_step(parallel, reference, loss, lm_loss(reference(idx), targets))


def cnn_equivalence(fields: dict) -> float:
    """One step of a small CosmoFlow (two conv blocks on 32^3, global pooling, a dense head; ``batch_norm``
    in ``fields`` adds BatchNorm3d after each conv) against one process; spatial ranks take their slab of
    each sample."""
    torch.manual_seed(0)
    model = cosmoflow(size=32, in_channels=2, base_channels=4, num_blocks=2, fc_sizes=(8,), num_outputs=2,
                      pooling="average", batch_norm=fields.pop("batch_norm", False)).double()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 2, 32, 32, 32, dtype=torch.float64, generator=g), torch.randn(4, 2, dtype=torch.float64,
                                                                                          generator=g)
    layers = tuple(fields.pop("layers", {}).items())
    plan = Plan(global_batch=4, input_shape=tuple(x.shape), layers=layers, dtype="float64", **fields)
    parallel = parallelize(model, plan, plan_mesh(plan), loss_fn=F.mse_loss, example_input=x)
    mine = replica_slice(parallel)
    slab = shard(x[mine], parallel.mesh["spatial"], grid=plan.grid) if plan.dims.num_spatial > 1 else x[mine]
    loss = parallel.train_step(slab, y[mine])
    check_step(parallel, reference, loss, F.mse_loss(reference(x), y))
    # the outputs of any number of samples (3: a pipeline pads the last of its training-sized batches), in
    # evaluation mode, on every rank
    few = shard(x[:3], parallel.mesh["spatial"], grid=plan.grid) if plan.dims.num_spatial > 1 else x[:3]
    torch.testing.assert_close(parallel.predict(few), reference.eval()(x[:3]), **TOL)
    assert all(m.training for module in parallel.modules.values() for m in module.modules())
    return loss.item()


PP2 = ("blocks.2.ln_1",)
PP4 = ("blocks.1.ln_1", "blocks.2.ln_1", "blocks.3.ln_1")
CASES2 = {
    "dp2": dict(dp=2),
    "tp2": dict(tp=2),
    "pp2-gpipe": dict(pp=2, stages=PP2, schedule="gpipe", micro_batches=4),
    "pp2-1f1b": dict(pp=2, stages=PP2, schedule="1f1b", micro_batches=4),
    "pp2-interleaved": dict(pp=2, stages=PP4, schedule="interleaved-1f1b", micro_batches=4),
    "fsdp2": dict(dp=2, sharding=3),
    "dp2-shares": dict(dp=2, shares=(5, 3)),
    "fsdp2-shares": dict(dp=2, sharding=3, shares=(2, 6)),
    "tp2-checkpointing": dict(tp=2, checkpointing=True),
    "fsdp2-checkpointing": dict(dp=2, sharding=3, checkpointing=True),
    "tp2-sequence": dict(tp=2, sequence_parallel=True),
}
CASES4 = {
    "tp4": dict(tp=4),
    "pp4-gpipe": dict(pp=4, stages=PP4, schedule="gpipe", micro_batches=4),
    "pp4-1f1b": dict(pp=4, stages=PP4, schedule="1f1b", micro_batches=8),
    "dp2-tp2": dict(dp=2, tp=2),
    "fsdp2-tp2": dict(dp=2, tp=2, sharding=3),
    "zero2-tp2": dict(dp=2, tp=2, sharding=2),
    "tp2-pp2": dict(tp=2, pp=2, stages=PP2, micro_batches=2),
    "dp2-pp2-gpipe": dict(dp=2, pp=2, stages=PP2, micro_batches=2, schedule="gpipe"),
    "dp2-tp2-sequence": dict(dp=2, tp=2, sequence_parallel=True),
    "tp4-sequence": dict(tp=4, sequence_parallel=True),
    "tp2-pp2-sequence": dict(tp=2, pp=2, stages=PP2, micro_batches=2, sequence_parallel=True),
    "dp2-pp2-interleaved": dict(dp=2, pp=2, stages=PP4, micro_batches=4, schedule="interleaved-1f1b"),
    "fsdp2-pp2": dict(dp=2, pp=2, stages=PP2, micro_batches=2, sharding=3),
}


def searched_equivalence(constraints: dict) -> tuple:
    """The plan the search ranks first for a GPT wide enough to split (found on this world, as
    ``plan = "auto"`` does) runs and matches one process; it is analysed from the plan's input shape."""
    torch.manual_seed(0)
    model = gpt(vocab_size=512, seq_len=64, num_layers=2, num_heads=4, d_model=256).double()
    reference = copy.deepcopy(model)
    window = torch.randint(0, 512, (4, 65), generator=torch.Generator().manual_seed(1))
    idx, targets = window[:, :-1], window[:, 1:]
    cluster = dataclasses.replace(cluster_of("a100-80"), num_nodes=1, devices_per_node=dist.get_world_size())
    plan = search_plans(model, idx, cluster, dtype="float64", **constraints).plans[0]
    parallel = parallelize(model, plan, plan_mesh(plan), loss_fn=lm_loss)
    mine = replica_slice(parallel)
    check_step(parallel, reference, parallel.train_step(idx[mine], targets[mine]), lm_loss(reference(idx), targets))
    return plan.describe(), plan.stages, dict(plan.layers).get("blocks.0.attn.qkv")


def test_searched_plans_run(dist2):
    assert dist2.run(searched_equivalence, constraints=dict(tp=2))[0] == ("dp=1 tp=2", (), "column")
    described, stages, _ = dist2.run(searched_equivalence, constraints=dict(pp=2))[0]
    assert described.startswith("dp=1 pp=2") and stages == ("blocks.1.ln_1",)


FILTER_PAIR = {"features.0": "column", "features.1": "shard", "features.2": "shard", "features.3": "row"}
CNN_CASES = {
    "filter2": (2, dict(tp=2, layers=FILTER_PAIR)),
    "spatial2-dp2": (4, dict(dp=2, spatial=(2, 1, 1))),
    "pp2-spatial2": (4, dict(pp=2, spatial=(2, 1, 1), stages=("features.3",), micro_batches=2)),
    "spatial2-filter2": (4, dict(spatial=(2, 1, 1), tp=2, layers=FILTER_PAIR)),
    "dp2-batchnorm": (2, dict(dp=2, batch_norm=True)),  # statistics over the global batch without a spatial split
    "fsdp2-batchnorm": (2, dict(dp=2, sharding=3, batch_norm=True)),
    # rebalancing around a slow rank: uneven shares of the batch, slabs with rows in proportion to the weights
    "dp2-shares-batchnorm": (2, dict(dp=2, shares=(3, 1), batch_norm=True)),
    "spatial4-slabs": (4, dict(spatial=(2, 2, 1), slabs=((3, 1), (1, 2), ()))),
    "dp2-shares-spatial2-slabs": (4, dict(dp=2, shares=(1, 3), spatial=(2, 1, 1), slabs=((2, 7), (), ()))),
}


@pytest.mark.parametrize("case", CNN_CASES)
def test_cnn(dist2, dist4, case):
    world, fields = CNN_CASES[case]
    (dist2 if world == 2 else dist4).run(cnn_equivalence, fields=fields)


@pytest.mark.parametrize("case", CASES2)
def test_two_ranks(dist2, case):
    dist2.run(equivalence, fields=CASES2[case])


@pytest.mark.parametrize("case", CASES4)
def test_four_ranks(dist4, case):
    dist4.run(equivalence, fields=CASES4[case])


def refusals() -> list[str]:
    """Plans that do not match the model: each refused before any communication, the model untouched."""
    four_heads = dict(gpt_plan(tp=4).layers)
    cases = [
        (dict(tp=2, layers={"blocks.9.mlp.fc": "column"}), {}, "layer 'blocks.9.mlp.fc' is not in the model"),
        (dict(tp=4, layers=four_heads), dict(num_heads=2),
         "layer 'blocks.0.attn:scaled_dot_product_attention#0': 2 attention heads do not split into 4"),
        (dict(pp=4, schedule="interleaved-1f1b", stages=("blocks.0.ln_1",) * 7), {},
         "8 pipeline stages, but GPT has 7 blocks"),
        (dict(pp=4, stages=("blocks.1.attn.qkv", "blocks.2.ln_1", "blocks.3.ln_1")), {},
         "a stage cannot start at 'blocks.1.attn.qkv': stages start where a block starts"),
        (dict(pp=2, dp=2, stages=PP2, micro_batches=3), {}, "a global batch of 8 does not split into dp=2 "
         "replicas of micro_batches=3"),
        (dict(pp=2, dp=2, stages=PP2, schedule="zero-bubble"), {}, "schedule = 'zero-bubble'"),
        (dict(pp=4, stages=PP4, micro_batches=2), {}, "1F1B over 4 stages needs at least 4"),
        (dict(dp=4, micro_batches=2), {}, "micro_batches = 2: use 1 without pipeline stages"),
        (dict(dp=4, sharding=5), {}, r"sharding = 5: use 0 \(DDP\), 1, 2 or 3"),
        (dict(dp=4, sequence_parallel=True), {}, "sequence_parallel = true needs tp > 1"),
        (dict(tp=4, sequence_parallel=True, layers={"blocks.0.mlp.fc": "column", "blocks.0.mlp.act": "shard",
                                                    "blocks.0.mlp.proj": "row"}), {},
         r"layer 'embed.tok' \(Embedding\) is replicated, so sequence parallelism would run it on a sequence"),
    ]
    mesh = harness.mesh((1, 1, 1, 4), AXES)
    messages = []
    for fields, change, match in cases:
        layers = fields.pop("layers", {})
        plan = Plan(global_batch=BATCH, input_shape=(BATCH, T), layers=tuple(layers.items()), **fields)
        model = gpt(vocab_size=VOCAB, seq_len=T, num_layers=4, num_heads=change.get("num_heads", 4), d_model=16)
        before = copy.deepcopy(model.state_dict())
        target = mesh if plan.world_size == 4 and plan.pp == 1 and plan.dp == 1 else None
        target = target or harness.mesh(tuple(plan.dims.sizes()[a] for a in AXES), AXES)
        with pytest.raises(PlanError, match=match) as err:
            parallelize(model, plan, target, loss_fn=lm_loss)
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing was changed
        messages.append(str(err.value))
    # a fused projection whose output holds q, k and v one after another: a rank's features are a piece of q
    sections = Attention(d=16, heads=4)
    attention = "scaled_dot_product_attention#0"
    plan = Plan(tp=4, global_batch=2, input_shape=(2, 8, 16), layers=(("qkv", "column"), (attention, "shard"),
                                                                       ("proj", "row")))
    with pytest.raises(PlanError, match=r"layer '.*' reads 'qkv''s output, split over tp along its dim 2, "
                                        "through a view that cuts that dim"):
        parallelize(sections, plan, mesh, loss_fn=F.mse_loss)
    with pytest.raises(PlanError, match=r"the mesh has \{'pp': 1, 'dp': 1, 'spatial': 1, 'tp': 4\} ranks per axis"):
        parallelize(tiny_gpt(), gpt_plan(dp=2, tp=2), mesh, loss_fn=lm_loss)
    with pytest.raises(PlanError, match="batch_norm = 'replica': use one of global, spatial"):
        parallelize(tiny_gpt(), gpt_plan(tp=4), mesh, loss_fn=lm_loss, batch_norm="replica")
    return messages


def test_plans_that_do_not_match_the_model_fail_before_any_communication(dist4):
    first, *others = dist4.run(refusals)
    assert all(o == first for o in others)


def batch_of_step(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    window = torch.randint(0, VOCAB, (BATCH, T + 1), generator=torch.Generator().manual_seed(100 + step))
    return window[:, :-1], window[:, 1:]


def train(parallel, optimizer, steps) -> list[float]:
    """The global batch's loss of each step (the replicas' mean) on every rank."""
    losses = []
    for step in steps:
        idx, targets = batch_of_step(step)
        mine = replica_slice(parallel)
        optimizer.zero_grad()
        loss = parallel.train_step(idx[mine], targets[mine])
        optimizer.step()
        dist.all_reduce(loss)
        losses.append(loss.item() / dist.get_world_size())
    return losses


def save_under(fields: dict, path: str) -> list[float]:
    """Two Adam steps under the plan, then a checkpoint."""
    plan = gpt_plan(**fields)
    parallel = parallelize(tiny_gpt(), plan, plan_mesh(plan), loss_fn=lm_loss)
    optimizer = torch.optim.Adam(parallel.parameters(), lr=1e-2)
    losses = train(parallel, optimizer, range(2))
    checkpoint.save(parallel, optimizer, path)
    return losses


def resume_under(fields: dict, path: str) -> list[float]:
    """Another plan (and world size), other initial weights: load the checkpoint, two more steps."""
    plan = gpt_plan(**fields)
    parallel = parallelize(tiny_gpt(seed=7), plan, plan_mesh(plan), loss_fn=lm_loss)
    optimizer = torch.optim.Adam(parallel.parameters(), lr=1e-2)
    checkpoint.load(parallel, optimizer, path)
    return train(parallel, optimizer, range(2, 4))


def test_checkpoints_move_between_plans_and_world_sizes(dist2, dist4, tmp_path):
    """Saved at dp=2 x tp=2; resumed at pp=2 x fsdp=2, and at tp=2 on 2 ranks: the losses after the resume
    (the second one depends on Adam's moments too) are those of one uninterrupted process."""
    model = tiny_gpt()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    expected = []
    for step in range(4):
        idx, targets = batch_of_step(step)
        optimizer.zero_grad()
        loss = lm_loss(model(idx), targets)
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    path = str(tmp_path / "checkpoint")
    assert dist4.run(save_under, fields=dict(dp=2, tp=2), path=path)[0] == pytest.approx(expected[:2], rel=1e-10)
    for pool, fields in ((dist4, dict(pp=2, dp=2, sharding=3, stages=PP2, micro_batches=2)),
                         (dist2, dict(tp=2)), (dist2, dict(pp=2, stages=PP2, micro_batches=4))):
        resumed = pool.run(resume_under, fields=fields, path=path)
        assert all(r == resumed[0] for r in resumed)
        assert resumed[0] == pytest.approx(expected[2:], rel=1e-10), fields




def traces_of_a_pipeline_run(folder: str) -> int:
    """The analyses one worker runs to check a pipelined plan and set the run up (``Tokens.check`` then
    ``setup``): the model is traced once, and its micro-batch shapes derived from that trace."""
    from pathlib import Path

    from hybridpar.ir import analysis
    from hybridpar.train import load
    from hybridpar.train.tasks.tokens import Tokens

    plan = Plan(pp=2, micro_batches=2, stages=("blocks.1.ln_1",), global_batch=4, input_shape=(4, 8),
                dtype="float64")
    here = Path(folder) / str(dist.get_rank())
    here.mkdir(parents=True, exist_ok=True)
    (here / "plan.json").write_text(plan.to_json())
    (here / "run.toml").write_text(TINY_GPT.format(run=here / "run", plan=here / "plan.json"))
    calls, analyse = [], analysis.analyse

    def counted(*args, **kwargs):
        calls.append(args[1])
        return analyse(*args, **kwargs)

    analysis.analyse = counted
    try:
        task = Tokens(load(here / "run.toml"))
        checked = task.check(dist.get_world_size())
        task.setup(checked, plan_mesh(checked))
    finally:
        analysis.analyse = analyse
    return len(calls)


def test_a_pipeline_run_traces_its_model_once(dist2, tmp_path):
    assert dist2.run(traces_of_a_pipeline_run, folder=str(tmp_path)) == [1, 1]

"""``hybridpar train`` with a GPT on the synthetic token task: plans with tensor and pipeline parallelism from a
plan file and from ``plan = "auto"``, a run resumed under another plan and world size, the token task itself,
and the config errors."""

import math
import re
from pathlib import Path

import pytest
import torch

from hybridpar.data.tokens import MarkovTokens
from hybridpar.errors import HybridparError
from hybridpar.ir.types import Plan
from hybridpar.models.gpt import gpt
from hybridpar.parallel.checkpoint_files import read_tensors
from hybridpar.parallel.tensor import pair_strategies
from hybridpar.plan import graph_of, preset
from hybridpar.plan.io import write_cluster
from hybridpar.train import checkpoint_dir, load, metrics
from hybridpar.train.trainer import check
from test_train import expect_error, hybridpar

pytestmark = pytest.mark.slow  # each test trains through the CLI in fresh worker processes

MODEL = dict(vocab_size=32, seq_len=16, num_layers=4, num_heads=4, d_model=32)
GPT = """run_dir = "{run}"
seed = 0
{top}
[model]
name = "gpt"
vocab_size = 32
seq_len = 16
num_layers = 4
num_heads = 4
d_model = 32
{model_extra}
[data]
format = "tokens"
{data_extra}
[optimizer]
name = "adam"
lr = 0.01

[train]
steps = 6
batch_size = 8
dtype = "float64"
log_every = 2
{train_extra}
[checkpoint]
every = 3
"""


def config(path: Path, run: Path, *, top: str = "", model_extra: str = "", data_extra: str = "",
           train_extra: str = "") -> Path:
    path.write_text(GPT.format(run=run, top=top, model_extra=model_extra, data_extra=data_extra,
                               train_extra=train_extra))
    return path


def plan_file(path: Path, **fields) -> Path:
    """A hand-written plan for the config's GPT (batch 8 x 16 tokens, float64); tp > 1 splits the layers
    ``pair_strategies`` finds."""
    layers = ()
    if fields.get("tp", 1) > 1:
        with torch.device("meta"):
            model = gpt(**MODEL)
        graph = graph_of(model, torch.zeros(8, 16, dtype=torch.long))
        layers = tuple(pair_strategies(graph, tp=fields["tp"]).items())
    plan = Plan(global_batch=8, input_shape=(8, 16), dtype="float64", layers=layers, **fields)
    path.write_text(plan.to_json())
    return path


def losses(run: Path, split: str = "train") -> list[float]:
    return [r["loss"] for r in metrics.read(run / "metrics.jsonl") if r["split"] == split]


def test_resumed_under_another_plan_and_world_size_equals_one_process(tmp_path):
    """Steps 1-3 at dp=2 x tp=2 on 4 workers, steps 4-6 resumed at pp=2 on 2 workers: every loss (and the
    validation loss) is that of one process."""
    one = config(tmp_path / "one.toml", tmp_path / "one")
    hybridpar("train", one)
    first = config(tmp_path / "a.toml", tmp_path / "par", top=f'plan = "{plan_file(tmp_path / "a.json", dp=2, tp=2)}"')
    proc = hybridpar("train", first, "--stop-after", 3)
    assert "trained steps 0..3 on dp=2 tp=2 in" in proc.stdout, proc.stdout
    second_plan = plan_file(tmp_path / "b.json", pp=2, stages=("blocks.2.ln_1",), micro_batches=2)
    second = config(tmp_path / "b.toml", tmp_path / "par", top=f'plan = "{second_plan}"')
    proc = hybridpar("train", second, "--resume")
    assert "trained steps 3..6 on dp=1 pp=2 (m=2) in" in proc.stdout, proc.stdout
    expected, got = losses(tmp_path / "one"), losses(tmp_path / "par")
    assert len(expected) == len(got) == 6
    assert all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(expected, got)), (expected, got)
    assert math.isclose(losses(tmp_path / "one", "val")[-1], losses(tmp_path / "par", "val")[-1], rel_tol=1e-9)
    assert expected[-1] < expected[0]  # it learns


def last_checkpoint(run: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the run's last checkpoint (weights and optimizer moments), whole, read without a group."""
    return read_tensors(checkpoint_dir.checkpoints(run / "checkpoints")[-1][1])


@pytest.mark.parametrize("fields", [dict(dp=2, tp=2), dict(dp=2, pp=2, stages=("blocks.2.ln_1",), micro_batches=2)],
                         ids=["dp2-tp2", "dp2-pp2"])
def test_resume_is_bitwise_on_four_ranks(tmp_path, fields):
    """Stopped after step 3 and resumed under the same plan on 4 workers: every loss and every tensor of the last
    checkpoint (weights, Adam's moments) equal the uninterrupted run's, bit for bit."""
    plan = f'plan = "{plan_file(tmp_path / "plan.json", **fields)}"'
    full = config(tmp_path / "full.toml", tmp_path / "full", top=plan)
    part = config(tmp_path / "part.toml", tmp_path / "part", top=plan)
    hybridpar("train", full)
    hybridpar("train", part, "--stop-after", 3)
    proc = hybridpar("train", part, "--resume")
    assert "trained steps 3..6 on" in proc.stdout, proc.stdout
    assert losses(tmp_path / "full") == losses(tmp_path / "part")
    expected, got = last_checkpoint(tmp_path / "full"), last_checkpoint(tmp_path / "part")
    assert sorted(expected) == sorted(got) and any(key.startswith("model") for key in expected), sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key


def test_plan_auto_searches_tensor_and_pipeline_plans(tmp_path):
    cluster = tmp_path / "cluster.toml"
    write_cluster(preset("a100-80").with_devices(2), cluster)
    auto = config(tmp_path / "auto.toml", tmp_path / "auto", top=f'plan = "auto"\ncluster = "{cluster}"')
    proc = hybridpar("train", auto, "--nproc", 2)
    plan = Plan.from_json((tmp_path / "auto" / "plan.json").read_text())
    assert plan.world_size == 2 and plan.model == "gpt" and plan.input_shape == (8, 16)
    assert f"plan {plan.describe()} (searched for 2 x a100-80): predicted" in proc.stdout, proc.stdout
    assert len(losses(tmp_path / "auto")) == 6


def test_the_token_task_is_learnable_and_reproducible():
    task = MarkovTokens(vocab_size=32, seq_len=16, seed=3)
    idx, targets = task.batch(5, 4)
    assert idx.shape == targets.shape == (4, 16) and torch.equal(idx[:, 1:], targets[:, :-1])
    assert torch.equal(task.batch(5, 4)[0], idx) and not torch.equal(task.batch(6, 4)[0], idx)
    assert not torch.equal(task.batch(5, 4, "val")[0], idx)
    follows = (task.successors[idx] == targets.unsqueeze(-1)).any(-1)
    assert follows.all()  # every next token is one of its predecessor's successors
    assert 1.0 < task.entropy < math.log(4) < math.log(32)


def test_config_errors_name_the_key(tmp_path):
    """Checked before any worker starts (``check``, which the command runs first); one through the command,
    which prints it in one line."""
    run = tmp_path / "run"

    def variant(name: str, old: str = "", new: str = "", **parts) -> Path:
        path = config(tmp_path / name, run, **parts)
        path.write_text(path.read_text().replace(old, new))
        return path

    def refused(path: Path, match: str, world_size: int = 1) -> None:
        with pytest.raises(HybridparError, match=re.escape(match)):
            check(load(path), world_size)

    refused(variant("f.toml", data_extra="train = 'x'"), "data.train / data.val: the token task is synthetic")
    refused(variant("e.toml", "steps = 6", "epochs = 2"), "train.epochs: the token task is an endless stream")
    refused(variant("p.toml", model_extra='preset = "gpt5"'), "model.preset = 'gpt5': use one of gpt2-small")
    refused(variant("u.toml", model_extra="width = 3"), "unknown key model.width for model 'gpt'")
    refused(variant("c.toml", 'format = "tokens"', 'format = "cosmoflow"'), 'set data.format = "tokens"')
    refused(variant("d.toml", top="[mesh]\ndp = 2"), "mesh.dp = 2, but the world size is 1")
    stages = plan_file(tmp_path / "s.json", pp=2, stages=("blocks.1.attn.qkv",), micro_batches=2)
    refused(variant("s.toml", top=f'plan = "{stages}"'), "a stage cannot start at 'blocks.1.attn.qkv'", 2)
    heads = plan_file(tmp_path / "h.json", tp=2)
    expect_error("train", variant("h.toml", "num_heads = 4", "num_heads = 1", top=f'plan = "{heads}"'),
                 match="1 attention heads do not split into 2")
    assert not run.exists()

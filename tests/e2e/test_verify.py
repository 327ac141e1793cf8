"""``hybridpar.verify`` and ``hybridpar verify CONFIG``: a plan proved on a model against one process (one float64
step, every tensor compared), inside a process group or on local processes it starts; a plan that computes
something else is reported as differing, one refused says why."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hybridpar
from hybridpar.ir.types import Plan
from support.models import TINY_GPT
from support.patterns import HEAD_SPLIT, ConfigHeads, DroppedConvHead, TensorHeads
from test_train import hybridpar as command


class RankScaled(nn.Module):
    """A model that is wrong in parallel on purpose: its output depends on the rank that computes it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return self.linear(x) * (1 + dist.get_rank() if dist.is_initialized() else 1)


def verified(name: str, fields: dict) -> tuple[str, str]:
    """``verify`` inside the pool's process group: the verdict and the first line of the report."""
    torch.manual_seed(0)
    model = {"tensor-heads": TensorHeads, "config-heads": ConfigHeads, "rank-scaled": RankScaled,
             "dropped-conv-head": DroppedConvHead}[name]()
    g = torch.Generator().manual_seed(1)
    shape = (4, 1, 8, 8, 8) if "conv" in name else (4, 8, 16)
    batch = (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    report = hybridpar.verify(model, Plan(global_batch=4, **fields), batch, loss_fn=F.mse_loss)
    return report.verdict, report.lines()[0]


def test_verify_inside_a_process_group(dist2, dist4):
    for verdict, line in dist2.run(verified, name="tensor-heads", fields=dict(tp=2, layers=HEAD_SPLIT)):
        assert verdict == "exact", line
    for verdict, line in dist2.run(verified, name="config-heads", fields=dict(tp=2, layers=HEAD_SPLIT)):
        assert verdict == "refused" and "through view(4, -1, 4, 4)" in line, line
    for verdict, line in dist2.run(verified, name="rank-scaled", fields=dict(dp=2)):
        assert verdict == "differs" and "linear." in line, line  # the test can fail: a wrong plan is caught
    for verdict, line in dist4.run(verified, name="dropped-conv-head", fields=dict(dp=2, spatial=(2, 1, 1))):
        assert verdict == "exact", line  # the output gathered from its slabs for the one-process loss


def test_verify_starts_its_own_local_processes():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(4, 8, 16, generator=g), torch.randn(4, 8, 16, generator=g))
    report = hybridpar.verify(TensorHeads(), Plan(tp=2, global_batch=4, layers=HEAD_SPLIT), batch,
                              loss_fn=F.mse_loss)
    assert report.verdict == "exact" and len(report.differences) == 1 + 8 + 8, report.lines(None)




def test_the_command_verifies_a_configs_plan(tmp_path):
    plan = Plan(pp=2, micro_batches=2, stages=("blocks.1.ln_1",), global_batch=4, dtype="float64", input_shape=(4, 8))
    (tmp_path / "plan.json").write_text(plan.to_json())
    config = tmp_path / "run.toml"
    config.write_text(TINY_GPT.format(run=tmp_path / "run", plan=tmp_path / "plan.json"))
    proc = command("verify", config)
    assert "dp=1 pp=2 (m=2): exact" in proc.stdout and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    bad = Plan(pp=2, micro_batches=2, stages=("blocks.1.attn.qkv",), global_batch=4, dtype="float64",
               input_shape=(4, 8))
    (tmp_path / "plan.json").write_text(bad.to_json())
    proc = command("verify", config, check=False)
    assert proc.returncode == 2 and "a stage cannot start at 'blocks.1.attn.qkv'" in proc.stderr, proc.stderr

"""The training loop of ``hybridpar train`` for a GPT (``model.name = "gpt"``) on the synthetic token task.

The plan (``plan = "auto"``, a plan file, or ``[mesh] dp`` with ``data_parallel``) is checked on every rank
before any communication; ``hybridpar.parallelize`` applies it (tensor, pipeline, data and sharded data
parallelism, activation checkpointing). Step ``s`` trains on batch ``s`` of the token stream (the same on
every rank; each replica takes its rows), so a run resumed from a checkpoint, under this plan or another
one, repeats the uninterrupted run: checkpoints (``hybridpar.parallel.checkpoint``) hold the weights and
the optimizer state in the model's own names and global shapes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from hybridpar import parallelize
from hybridpar.data.tokens import MarkovTokens
from hybridpar.models.gpt import lm_loss
from hybridpar.plan import Plan
from hybridpar.train import checkpoint, planning
from hybridpar.train.config import Config, model_factory, model_options
from hybridpar.train.loop import DTYPES, agreed_mesh, mean_over_dp
from hybridpar.train.metrics import MetricsLog
from hybridpar.train.optim import build_optimizer, learning_rate, set_learning_rate
from hybridpar.train.progress import Progress

def build_model(config: Config) -> torch.nn.Module:
    torch.manual_seed(config.seed)
    return model_factory("gpt")(**model_options(config.model))


def example_input(config: Config, model) -> torch.Tensor:
    """One step's global batch of token ids (meta: a shape and a dtype)."""
    return torch.zeros(config.train.batch_size, model.config.seq_len, dtype=torch.long, device="meta")


def check(config: Config, world_size: int) -> Plan:
    """The checks that need no process group: the model (on the meta device) and the plan for
    ``world_size`` processes (searched, read, or from ``[mesh]``), priced and checked against the model."""
    with torch.device("meta"):
        model = build_model(config)
    return planning.plan_for(config, model, example_input(config, model), world_size)


@dataclass
class LMRun:
    config: Config
    plan: Plan
    parallel: object  # hybridpar.ParallelModel
    optimizer: torch.optim.Optimizer
    task: MarkovTokens
    total_steps: int


def setup(config: Config) -> LMRun:
    plan = check(config, dist.get_world_size())
    mesh = agreed_mesh(config, plan)
    model = build_model(config).to(DTYPES[config.train.dtype])
    parallel = parallelize(model, plan, mesh, loss_fn=lm_loss,
                           example_input=torch.zeros(plan.input_shape, dtype=torch.long))
    optimizer = build_optimizer(parallel.parameters(), config.optimizer)
    task = MarkovTokens(model.config.vocab_size, model.config.seq_len, config.seed)
    return LMRun(config, plan, parallel, optimizer, task, config.train.steps)


def _replica_rows(run: LMRun, batch: tuple[torch.Tensor, torch.Tensor]):
    per = run.plan.global_batch // run.plan.dp
    replica = run.parallel.mesh["dp"].get_local_rank()
    return tuple(t[replica * per:(replica + 1) * per] for t in batch)


def train_step(run: LMRun, step: int) -> tuple[float, float]:
    cfg = run.config
    lr = learning_rate(step, run.total_steps, cfg.optimizer.lr, cfg.schedule)
    set_learning_rate(run.optimizer, lr)
    torch.manual_seed(cfg.seed + 1_000_003 * (step + 1))  # dropout masks of this step, alike on a replica's ranks
    x, y = _replica_rows(run, run.task.batch(step, run.plan.global_batch))
    run.optimizer.zero_grad(set_to_none=True)
    loss = run.parallel.train_step(x, y)
    run.optimizer.step()
    return mean_over_dp(run.parallel.mesh, loss), lr


def validate(run: LMRun) -> dict:
    """The mean loss over the validation batches (the ``val`` split of the token stream, the same every
    time), and the least loss the task allows."""
    cfg = run.config
    batches = max(1, (cfg.validation.max_samples or run.plan.global_batch) // run.plan.global_batch)
    total = 0.0
    for i in range(batches):
        x, y = _replica_rows(run, run.task.batch(i, run.plan.global_batch, "val"))
        total += mean_over_dp(run.parallel.mesh, run.parallel.eval_loss(x, y))
    return {"loss": total / batches, "best_possible": run.task.entropy}


def train(config: Config, resume_from: Path | None, *, stop_after: int | None, show: bool) -> dict:
    """Train on this rank; returns the run's summary (on every rank)."""
    run = setup(config)
    config = run.config
    start = checkpoint.load(resume_from, run.parallel, run.optimizer) if resume_from else 0
    stop = min(run.total_steps, stop_after or run.total_steps)
    is_root = dist.get_rank() == 0
    run_dir = Path(config.run_dir)
    if is_root:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "plan.json").write_text(run.plan.to_json() + "\n")
        if config.plan:
            print(planning.describe(config, run.plan, str(run_dir / "plan.json")), flush=True)
    log = MetricsLog(run_dir, jsonl=config.metrics.jsonl and is_root,
                     tensorboard=config.metrics.tensorboard and is_root, resume_step=start if resume_from else None)
    progress = Progress(run, start, stop, show=show and is_root)
    summary = {"start_step": start, "steps": stop, "total_steps": run.total_steps, "val": None,
               "mesh": run.plan.describe(), "bytes_read_per_rank": []}
    begin = time.perf_counter()
    with progress:
        for step in range(start, stop):
            loss, lr = train_step(run, step)
            done = step + 1
            record = {"step": done, "split": "train", "loss": loss, "lr": lr}
            log.log(record)
            progress.advance(record)
            summary["loss"] = loss
            if checkpoint.due(done, config.checkpoint.every, stop, run.total_steps):
                summary["checkpoint"] = str(checkpoint.save(run_dir / "checkpoints", done, run.parallel,
                                                            run.optimizer, keep=config.checkpoint.keep))
            if checkpoint.due(done, config.validation.every, stop, run.total_steps):
                summary["val"] = validate(run)
                log.log({"step": done, "split": "val", **summary["val"]})
                progress.validated(done, summary["val"])
    summary["time_s"] = time.perf_counter() - begin
    log.close()
    return summary

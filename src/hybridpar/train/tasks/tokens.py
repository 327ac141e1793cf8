"""The synthetic token task of a GPT (``model.name = "gpt"``): next-token prediction on a Markov stream.

Step ``s`` trains on batch ``s`` of the token stream (the same on every rank; each replica takes its rows), so
a run resumed from a checkpoint, under this plan or another one, repeats the uninterrupted run.
"""

from __future__ import annotations

import torch

from hybridpar.data.tokens import MarkovTokens
from hybridpar.errors import ConfigError
from hybridpar.host import available_memory, gib
from hybridpar.ir.analysis import DTYPES
from hybridpar.models.gpt import lm_loss
from hybridpar.parallel.apply import parallelize
from hybridpar.plan import Plan
from hybridpar.train import planning
from hybridpar.train.agree import mean_over_dp
from hybridpar.train.config import Config, model_factory, model_options


def build_model(config: Config) -> torch.nn.Module:
    torch.manual_seed(config.seed)
    return model_factory("gpt")(**model_options(config.model))


def check_batch_memory(batch_size: int, seq_len: int) -> None:
    """Refuse a global batch whose token ids do not fit in this machine's memory: every rank draws the whole
    batch (``MarkovTokens.batch``: ``seq_len + 1`` tokens and ``seq_len`` choices per sample, int64) before it
    takes its replica's rows."""
    per_sample = (2 * seq_len + 1) * 8
    available = available_memory()
    if batch_size * per_sample > available:
        raise ConfigError(f"train.batch_size = {batch_size}: one global batch of token ids takes "
                          f"{gib(batch_size * per_sample)} (every rank draws it whole, {per_sample} bytes per sample "
                          f"at model.seq_len = {seq_len}), more than the {gib(available)} this machine has "
                          f"available; use a batch of at most {available // per_sample}")


class Tokens:
    has_validation = True
    reads_files = False  # the stream is computed, the same on every rank

    def __init__(self, config: Config):
        self.config = config

    def check(self, world_size: int, rescale: bool = False) -> Plan:
        planning.check_world_size(self.config, world_size, rescale)  # what the config tells, before the analysis
        with torch.device("meta"):
            model = build_model(self.config)
        check_batch_memory(self.config.train.batch_size, model.config.seq_len)
        example = torch.zeros(self.config.train.batch_size, model.config.seq_len, dtype=torch.long, device="meta")
        self.total_steps = self.config.train.steps
        self.analysed = planning.analysed(self.config, model, example)  # once: the plan, the run and a
        # rebalanced plan read it
        return planning.plan_for(self.config, model, example, world_size, rescale, self.analysed[2])

    def setup(self, plan: Plan, mesh):
        model = build_model(self.config).to(DTYPES[self.config.train.dtype])
        self.plan = plan
        self.parallel = parallelize(model, plan, mesh, loss_fn=lm_loss,
                                    example_input=torch.zeros(plan.input_shape, dtype=torch.long),
                                    graph=self.analysed[2])
        self.stream = MarkovTokens(model.config.vocab_size, model.config.seq_len, self.config.seed)
        return self.parallel

    def verification(self, plan: Plan) -> tuple:
        model = build_model(self.config)
        stream = MarkovTokens(model.config.vocab_size, model.config.seq_len, self.config.seed)
        return model, stream.batch(0, plan.global_batch), lm_loss

    def warnings(self) -> list[str]:
        return []

    def _replica_rows(self, batch: tuple[torch.Tensor, torch.Tensor]):
        start, stop = self.plan.batch_rows(self.parallel.mesh["dp"].get_local_rank())
        return tuple(t[start:stop] for t in batch)

    def batches(self, start: int, stop: int):
        for step in range(start, stop):
            yield (step, *self._replica_rows(self.stream.batch(step, self.plan.global_batch)))

    def seed_offset(self) -> int:
        return 0  # dropout masks alike on a replica's ranks

    def record(self) -> dict:
        return {}

    def validate(self) -> dict:
        """The mean loss over the validation batches (the ``val`` split of the token stream, the same every
        time), and the least loss the task allows."""
        global_batch = self.plan.global_batch
        batches = max(1, (self.config.validation.max_samples or global_batch) // global_batch)
        total = 0.0
        for i in range(batches):
            x, y = self._replica_rows(self.stream.batch(i, global_batch, "val"))
            total += mean_over_dp(self.parallel.mesh, self.parallel.eval_loss(x, y), self.parallel.loss_weight)
        return {"loss": total / batches, "best_possible": self.stream.entropy}

    def finish(self) -> dict:
        return {"bytes_read_per_rank": []}

    def close(self) -> None:
        pass

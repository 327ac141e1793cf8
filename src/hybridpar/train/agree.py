"""What every rank of a training run must agree on before and while it trains: the plan, the data files, the
batches (a data error on one rank is raised on all of them at the same step), and the reported loss.

Each check is one small collective whose failure is an error on every rank, never a rank left waiting in a
collective for one that stopped.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from hybridpar.errors import ConfigError, DataError
from hybridpar.mesh import build_mesh
from hybridpar.plan import Plan

ITEM, EXHAUSTED, ERROR = 0, 1, 2


def agreed(batches, device: torch.device):
    """``batches``, with a data error on any rank (a file that changed or broke since the checks, a label
    out of range) raised on every rank at the same step, so no rank waits forever in a collective for
    one that stopped. Ranks that run out of batches at different steps (their data differ) are an error
    on every rank too."""
    batches = iter(batches)
    while True:
        try:
            item, state, error = next(batches), ITEM, None
        except StopIteration:
            item, state, error = None, EXHAUSTED, None
        except DataError as err:
            item, state, error = None, ERROR, str(err)
        seen = torch.zeros(3, dtype=torch.int32, device=device)
        seen[state] = 1
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)  # which states any rank is in
        if seen[ERROR]:
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            raise DataError(next(e for e in errors if e is not None))
        if seen[ITEM] and seen[EXHAUSTED]:
            raise DataError("the ranks ran out of batches at different steps: their data sets differ (files that "
                            "changed while the run started?); put the data where every rank sees the same files")
        if state == EXHAUSTED:
            return
        yield item


def check_same_data(datasets) -> None:
    """Every rank must have built the same data sets (the same usable files): with ``data.skip_bad`` on a
    filesystem that changes under the run, they could differ, and would then read different samples."""
    paths = "\n".join(str(info.path) for d in datasets for info in d.infos)
    mine = (tuple(len(d.infos) for d in datasets), hashlib.sha256(paths.encode()).hexdigest())
    everyone = gather(mine)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            counts = [" / ".join(map(str, counts)) for counts, _ in (theirs, everyone[0])]
            raise DataError(f"rank {rank} sees other data files than rank 0 (usable training / validation files: "
                            f"{counts[0]} vs {counts[1]}); put the data where every rank sees the same files")


def agreed_mesh(config, plan: Plan):
    """The mesh of ``plan``, built once every rank has shown that it took the same plan (ranks with other
    plans would wait for each other in building it)."""
    check_same_plan(config, plan)
    return build_mesh(plan.dims, dist.get_world_size())


def check_same_plan(config, plan: Plan) -> None:
    """Every rank must have taken the same plan: the planner is deterministic, but the ranks could read
    different cluster or plan files (not on a shared filesystem)."""
    everyone = gather(plan.to_json())
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            source = f"plan = {config.plan!r}" if config.plan else "[mesh]"
            raise ConfigError(f"rank {rank} took another plan from {source} than rank 0 "
                              f"({Plan.from_json(theirs).describe()} vs {Plan.from_json(everyone[0]).describe()}); "
                              "put the config, plan and cluster files where every rank reads the same ones")


def gather(value) -> list:
    """``value`` of every rank, in rank order."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def mean_over_dp(mesh, value: torch.Tensor, weight: float = 1.0) -> float:
    """The mean of a scalar over the data-parallel replicas of ``mesh``, each replica's scaled by its ``weight``
    (``ParallelModel.loss_weight``): of every replica's mean loss, the global batch's."""
    value = value.detach().clone().double() * weight
    dist.all_reduce(value, group=mesh["dp"].get_group())
    return float(value) / mesh["dp"].size()

"""A data error on one rank stops every rank at the same batch with that rank's message, instead of
leaving the others waiting in the next collective."""

from types import SimpleNamespace

import torch
import torch.distributed as dist

from hybridpar.errors import DataError
from hybridpar.train.loop import agreed

HANG = 30  # seconds: a rank that kept going would wait in the all-reduce below; the harness calls it a hang


def _batches(fail_at: int | None):
    for i in range(4):
        if i == fail_at:
            raise DataError(f"sample {i} on rank {dist.get_rank()} is broken")
        yield i


def consume(fail_rank: int | None) -> tuple[list[int], str | None]:
    """Iterate, doing one collective per batch as training does; returns the batches seen and the error."""
    run = SimpleNamespace(device=torch.device("cpu"))
    seen = []
    try:
        for item in agreed(run, _batches(2 if dist.get_rank() == fail_rank else None)):
            dist.all_reduce(torch.ones(1))
            seen.append(item)
    except DataError as err:
        return seen, str(err)
    return seen, None


def test_error_on_one_rank_stops_all_ranks_at_the_same_batch(dist4):
    results = dist4.run(consume, timeout=HANG, fail_rank=3)
    assert results == [([0, 1], "sample 2 on rank 3 is broken")] * 4


def test_no_error_yields_every_batch(dist2):
    assert dist2.run(consume, timeout=HANG, fail_rank=None) == [([0, 1, 2, 3], None)] * 2

"""A data error on one rank stops every rank at the same batch with that rank's message, instead of
leaving the others waiting in the next collective."""

from types import SimpleNamespace

import torch
import torch.distributed as dist

from hybridpar.errors import ConfigError, DataError
from hybridpar.plan import Plan
from hybridpar.train.agree import agreed, check_same_data, check_same_plan

HANG = 30  # seconds: a rank that kept going would wait in the all-reduce below; the harness calls it a hang


def _batches(fail_at: int | None, count: int = 4):
    for i in range(count):
        if i == fail_at:
            raise DataError(f"sample {i} on rank {dist.get_rank()} is broken")
        yield i


def consume(fail_rank: int | None, short_rank: int | None = None) -> tuple[list[int], str | None]:
    """Iterate, doing one collective per batch as training does; returns the batches seen and the error.
    ``fail_rank`` fails reading batch 2; ``short_rank`` has only 3 batches."""
    rank = dist.get_rank()
    seen = []
    try:
        batches = _batches(2 if rank == fail_rank else None, 3 if rank == short_rank else 4)
        for item in agreed(batches, torch.device("cpu")):
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


def test_ranks_running_out_at_different_steps_is_an_error_everywhere(dist2):
    results = dist2.run(consume, timeout=HANG, fail_rank=None, short_rank=0)
    assert [seen for seen, _ in results] == [[0, 1, 2]] * 2
    assert all("ran out of batches at different steps" in error for _, error in results)


def check_files(odd_rank: int | None) -> str | None:
    """``check_same_data`` where ``odd_rank`` skipped one file the others could read."""
    names = ["a.h5", "b.h5", "c.h5"][: 2 if dist.get_rank() == odd_rank else 3]
    train_set = SimpleNamespace(infos=[SimpleNamespace(path=name) for name in names])
    try:
        check_same_data([train_set])
    except DataError as err:
        return str(err)
    return None


def test_ranks_with_other_data_files_are_refused(dist2):
    assert dist2.run(check_files, timeout=HANG, odd_rank=None) == [None, None]
    errors = dist2.run(check_files, timeout=HANG, odd_rank=1)
    assert errors[0] == errors[1] and "rank 1 sees other data files than rank 0" in errors[0]
    assert "usable training / validation files: 2 vs 3)" in errors[0]


def check_plans(odd_rank: int | None) -> str | None:
    """``check_same_plan`` where ``odd_rank`` took dp=2 from its plan and the others spatial=2x1x1 (a
    cluster file that differs between nodes)."""
    plan = Plan(dp=2) if dist.get_rank() == odd_rank else Plan(spatial=(2, 1, 1))
    try:
        check_same_plan(SimpleNamespace(plan="auto"), plan)
    except ConfigError as err:
        return str(err)
    return None


def test_ranks_with_other_plans_are_refused_before_the_mesh(dist2):
    assert dist2.run(check_plans, timeout=HANG, odd_rank=None) == [None, None]
    errors = dist2.run(check_plans, timeout=HANG, odd_rank=1)
    assert errors[0] == errors[1]
    assert "rank 1 took another plan from plan = 'auto' than rank 0 (dp=2 vs dp=1 spatial=2x1x1)" in errors[0]

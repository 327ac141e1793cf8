"""Dropout under spatial parallelism: element-wise masks drawn per slab, channel masks shared by the
spatial group, the replicated head's mask shared so every rank computes the same head, gradients that
follow the mask exactly, and identity in eval mode."""

import pytest

from support import cases_extra

SHAPE = (2, 2, 8, 6, 4)
SHAPE_UNEVEN = (2, 2, 9, 6, 5)
CHANNELS = (4, 8, 4, 4, 3)  # 32 (n, c) channels: a shared mask is not equal by chance


@pytest.mark.parametrize("shape,grid", [(SHAPE, (2, 1, 1)), (SHAPE, (1, 1, 2)), (SHAPE_UNEVEN, (2, 1, 1))], ids=str)
def test_dropout_on_slab_two_ranks(dist2, shape, grid):
    dist2.run(cases_extra.dropout_on_slab, shape=shape, grid=grid)


@pytest.mark.parametrize("grid,dp", [((2, 2, 1), 1), ((2, 1, 1), 2)], ids=str)
def test_dropout_on_slab_four_ranks(dist4, grid, dp):
    dist4.run(cases_extra.dropout_on_slab, shape=SHAPE, grid=grid, p=0.3, dp=dp)


@pytest.mark.parametrize("grid", [(2, 1, 1), (1, 2, 1)], ids=str)
def test_dropout3d_shares_channels_two_ranks(dist2, grid):
    dist2.run(cases_extra.dropout3d_on_slab, shape=CHANNELS, grid=grid)


@pytest.mark.parametrize("grid,dp", [((4, 1, 1), 1), ((1, 2, 2), 1), ((2, 1, 1), 2)], ids=str)
def test_dropout3d_shares_channels_four_ranks(dist4, grid, dp):
    dist4.run(cases_extra.dropout3d_on_slab, shape=CHANNELS, grid=grid, dp=dp)


@pytest.mark.parametrize("head", ["flatten", "flatten_linear", "global_pool"])
@pytest.mark.parametrize("shape,grid", [(SHAPE, (2, 1, 1)), (SHAPE_UNEVEN, (1, 1, 2))], ids=str)
def test_dropout_on_replicated_head_two_ranks(dist2, shape, grid, head):
    shape = CHANNELS if head == "global_pool" else shape  # enough (n, c) channels for a channel mask
    dist2.run(cases_extra.dropout_on_replicated, shape=shape, grid=grid, head=head)


@pytest.mark.parametrize("head", ["flatten", "flatten_linear", "global_pool"])
@pytest.mark.parametrize("grid,dp", [((2, 2, 1), 1), ((2, 1, 1), 2)], ids=str)
def test_dropout_on_replicated_head_four_ranks(dist4, grid, dp, head):
    shape = CHANNELS if head == "global_pool" else SHAPE_UNEVEN
    dist4.run(cases_extra.dropout_on_replicated, shape=shape, grid=grid, head=head, dp=dp)


def test_dropout_eval_is_identity(dist2, dist4):
    dist2.run(cases_extra.dropout_eval_is_identity, shape=SHAPE_UNEVEN, grid=(2, 1, 1))
    dist4.run(cases_extra.dropout_eval_is_identity, shape=SHAPE_UNEVEN, grid=(2, 1, 2))

"""``unshard(shard(x)) == x`` on every rank, for even and uneven 1-D, 2-D and 3-D grids, and its
gradient: each slab receives the sum over ranks of the gradient of the global tensor."""

import pytest

from support import cases_extra

TWO = [((2, 3, 8), (2,)), ((2, 3, 9), (2,)), ((1, 2, 7, 5), (2, 1)), ((1, 2, 6, 5), (1, 2)),
       ((1, 2, 5, 4, 3), (1, 1, 2))]
FOUR = [((2, 3, 8), (4,)), ((2, 3, 11), (4,)), ((1, 2, 6, 4), (2, 2)), ((1, 2, 7, 5), (2, 2)),
        ((1, 2, 9, 3), (4, 1)), ((1, 2, 3, 6), (1, 4)), ((1, 1, 5, 4, 3), (2, 2, 1))]


@pytest.mark.parametrize("shape,grid", TWO, ids=str)
def test_unshard_two_ranks(dist2, shape, grid):
    dist2.run(cases_extra.unshard_round_trip, shape=shape, grid=grid)


@pytest.mark.parametrize("shape,grid", FOUR, ids=str)
def test_unshard_four_ranks(dist4, shape, grid):
    dist4.run(cases_extra.unshard_round_trip, shape=shape, grid=grid)


@pytest.mark.parametrize("shape,grid", [((2, 3, 9), (2,)), ((1, 2, 7, 5), (1, 2))], ids=str)
def test_unshard_on_the_spatial_sub_mesh_of_dp2(dist4, shape, grid):
    dist4.run(cases_extra.unshard_round_trip, shape=shape, grid=grid, dp=2)

"""Partition geometry, single process: slab bounds, grid coordinates, exchange plans and windows, each
checked against a brute-force oracle (numpy padding for boundary rows, autograd through PyTorch's own
convolutions for which input rows reach which output rows)."""

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hybridpar.errors import GeometryError
from hybridpar.geometry import Grid, Piece, TransposedWindow, Window, plan_exchange, split_bounds

NUMPY_MODE = {"zeros": "constant", "circular": "wrap", "reflect": "reflect", "replicate": "edge"}


# -- split_bounds ------------------------------------------------------------------------------


def test_split_bounds_even():
    assert split_bounds(12, 4) == ((0, 3), (3, 6), (6, 9), (9, 12))
    assert split_bounds(7, 1) == ((0, 7),)


def test_split_bounds_uneven_larger_first():
    assert split_bounds(10, 4) == ((0, 3), (3, 6), (6, 8), (8, 10))
    assert split_bounds(5, 4) == ((0, 2), (2, 3), (3, 4), (4, 5))


def test_weighted_split_bounds_follow_the_weights():
    assert split_bounds(32, 2, (3, 1)) == ((0, 24), (24, 32))
    assert split_bounds(10, 3, (1, 2, 2)) == ((0, 2), (2, 6), (6, 10))
    assert split_bounds(2, 2, (1, 9)) == ((0, 1), (1, 2)), "every part keeps a row where there are enough"
    assert split_bounds(1, 2, (1, 3)) == ((0, 0), (0, 1))


@pytest.mark.parametrize("size", range(1, 40))
@pytest.mark.parametrize("weights", [(1, 2), (5, 3), (1, 1, 6), (2, 7, 3, 1), (9, 1, 1, 9)])
def test_weighted_split_bounds_tile_and_stay_near_the_proportion(size, weights):
    bounds = split_bounds(size, len(weights), weights)
    assert bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False)), bounds
    lengths = [hi - lo for lo, hi in bounds]
    if size >= len(weights):
        assert min(lengths) >= 1, bounds
        ideal = [size * w / sum(weights) for w in weights]
        # rounding moves each boundary by at most half a row; the one-row floor of thin parts by at most parts rows
        assert all(abs(n - i) <= len(weights) for n, i in zip(lengths, ideal, strict=True)), (bounds, ideal)


def test_grid_weights_have_one_form_and_are_checked():
    assert Grid((2, 1), ((4, 4), ())) == Grid((2, 1)), "weights all alike are the even split"
    assert Grid((2, 2), ((3, 1), ())).slab((8, 4), 2) == ((6, 8), (0, 2))
    with pytest.raises(GeometryError, match=r"slab weights \[3\] of spatial dim 0: give 2 whole numbers"):
        Grid((2,), ((3,),))
    with pytest.raises(GeometryError, match="give one list of weights per spatial dim"):
        Grid((2, 1), ((1, 2),))


@pytest.mark.parametrize("size", range(1, 30))
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
def test_split_bounds_tiles_and_balances(size, parts):
    bounds = split_bounds(size, parts)
    assert len(bounds) == parts
    assert bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])), bounds  # contiguous, no gap or overlap
    lengths = [hi - lo for lo, hi in bounds]
    assert sum(lengths) == size
    assert max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True), "larger slabs first"


# -- Grid ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("parts", [(4,), (2, 3), (2, 3, 4), (1, 2, 1), (3, 1, 2)])
def test_grid_coords_rank_round_trip(parts):
    grid = Grid(parts)
    assert grid.size == int(np.prod(parts)) and grid.ndim == len(parts)
    seen = set()
    for rank in range(grid.size):
        coords = grid.coords(rank)
        assert all(0 <= c < p for c, p in zip(coords, parts))
        assert grid.rank_of(coords) == rank
        seen.add(coords)
    assert seen == set(itertools.product(*(range(p) for p in parts)))
    # row-major: the coordinates in rank order are the lexicographic order
    assert [grid.coords(r) for r in range(grid.size)] == sorted(seen)


def test_grid_row_major_examples():
    grid = Grid((2, 3, 4))
    assert grid.coords(1) == (0, 0, 1)
    assert grid.coords(4) == (0, 1, 0)
    assert grid.coords(12) == (1, 0, 0)
    assert grid.coords(23) == (1, 2, 3)


@pytest.mark.parametrize("parts", [(2, 3, 4), (4, 1), (3,)])
def test_grid_neighbour(parts):
    grid = Grid(parts)
    for rank in range(grid.size):
        coords = grid.coords(rank)
        for axis, p in enumerate(parts):
            for part in range(p):
                other = grid.coords(grid.neighbour(rank, axis, part))
                assert other[axis] == part
                assert other[:axis] + other[axis + 1:] == coords[:axis] + coords[axis + 1:]
            assert grid.neighbour(rank, axis, coords[axis]) == rank


@pytest.mark.parametrize("parts,shape", [((2, 3, 4), (9, 7, 10)), ((4, 1), (5, 3)), ((2, 2, 2), (2, 3, 4))])
def test_grid_slabs_tile_the_volume(parts, shape):
    grid = Grid(parts)
    owner = np.full(shape, -1)
    for rank in range(grid.size):
        slab = grid.slab(shape, rank)
        for axis, (lo, hi) in enumerate(slab):
            assert (lo, hi) == split_bounds(shape[axis], parts[axis])[grid.coords(rank)[axis]]
        index = tuple(slice(lo, hi) for lo, hi in slab)
        assert (owner[index] == -1).all(), f"rank {rank} overlaps another slab"
        owner[index] = rank
    assert (owner >= 0).all(), "some voxel belongs to no slab"


def test_grid_check_shape_messages():
    with pytest.raises(GeometryError, match=r"here: spatial dim 1 has 3 rows but the grid splits it into 4 parts"):
        Grid((1, 4)).check_shape((8, 3), "here")
    with pytest.raises(GeometryError, match=r"grid of 2 spatial dims \(1, 4\) cannot split a tensor with 3"):
        Grid((1, 4)).check_shape((8, 8, 8), "here")
    Grid((1, 4)).check_shape((1, 4), "here")  # one row per part is fine


# -- plan_exchange -------------------------------------------------------------------------------


def _oracle_rows(need, size, boundary):
    """Global source row of each row of ``need`` (-1: a zero fill row), from numpy's own padding."""
    start, stop = need
    left, right = max(0, -start), max(0, stop - size)
    if boundary == "zeros":
        padded = np.pad(np.arange(size), (left, right), mode="constant", constant_values=-1)
    else:
        padded = np.pad(np.arange(size), (left, right), mode=NUMPY_MODE[boundary])
    return [int(v) for v in padded[start + left: stop + left]]


def _plans(size, parts, needs, boundary, axis=0):
    return [plan_exchange(axis=axis, size=size, bounds=split_bounds(size, parts), needs=needs, boundary=boundary,
                          part=q, where="test")
            for q in range(parts)]


def _check_consistent(size, parts, needs, boundary):
    """Pieces reproduce the oracle rows with the right owners; sends and receives pair up exactly."""
    bounds = split_bounds(size, parts)
    owner_of = {i: p for p, (lo, hi) in enumerate(bounds) for i in range(lo, hi)}
    plans = _plans(size, parts, needs, boundary)
    for q, ex in enumerate(plans):
        assert (ex.part, ex.lo, ex.hi) == (q, *bounds[q])
        rows = [i for piece in ex.pieces for i in piece.indices]
        assert rows == _oracle_rows(needs[q], size, boundary), f"part {q}"
        for piece in ex.pieces:
            assert piece.length == len(piece.indices) > 0
            if piece.owner is None:
                assert boundary == "zeros" and set(piece.indices) == {-1}
            else:
                assert all(owner_of[i] == piece.owner for i in piece.indices), (q, piece)
        assert ex.num_halo_rows == sum(1 for i in rows if i >= 0 and owner_of[i] != q)
    for r, ex in enumerate(plans):
        expected = sorted((q, piece.indices, tag) for q, other in enumerate(plans) if q != r
                          for tag, piece in enumerate(other.pieces) if piece.owner == r)
        assert sorted(ex.sends) == expected, f"what part {r} sends"
        assert all(q != r for q, _, _ in ex.sends)
        assert all(lo <= i < hi for _, idx, _ in ex.sends for i in idx for lo, hi in [bounds[r]])
    return plans


def _conv_needs(size, parts, kernel=3, pad=1, stride=1, dilation=1):
    window = Window(kernel, stride, pad, dilation)
    out = (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1
    return tuple(window.need(*b) for b in split_bounds(out, parts))


@pytest.mark.parametrize("boundary", ["zeros", "circular", "reflect", "replicate"])
@pytest.mark.parametrize("size,parts", [(8, 2), (9, 2), (12, 4), (13, 4), (7, 3), (5, 1), (6, 6)])
def test_plan_exchange_k3_p1(size, parts, boundary):
    plans = _check_consistent(size, parts, _conv_needs(size, parts), boundary)
    if boundary == "reflect" and min(hi - lo for lo, hi in split_bounds(size, parts)) < 2:
        return  # a 1-row edge slab reflects a row of its neighbour: counted by the oracle above
    # every interior border moves exactly one row each way
    for q, ex in enumerate(plans):
        inner = (q > 0) + (q < parts - 1)
        wraps = boundary == "circular" and parts > 1
        assert ex.num_halo_rows == inner + (wraps and (q == 0)) + (wraps and (q == parts - 1)), (q, ex.pieces)


@pytest.mark.parametrize("kernel,pad,stride,dilation", [(5, 2, 1, 1), (3, 2, 1, 2), (4, 1, 2, 1), (5, 2, 2, 1),
                                                        (3, 0, 1, 1), (2, 0, 2, 1), (3, 1, 3, 1)])
@pytest.mark.parametrize("boundary", ["zeros", "circular", "reflect", "replicate"])
@pytest.mark.parametrize("size,parts", [(12, 2), (11, 3), (17, 4)])
def test_plan_exchange_other_windows(size, parts, boundary, kernel, pad, stride, dilation):
    _check_consistent(size, parts, _conv_needs(size, parts, kernel, pad, stride, dilation), boundary)


def test_zero_padding_fill_pieces():
    plans = _plans(8, 2, _conv_needs(8, 2), "zeros")
    p0, p1 = plans
    assert [(p.owner, p.indices) for p in p0.pieces] == [(None, (-1,)), (0, (0, 1, 2, 3)), (1, (4,))]
    assert [(p.owner, p.indices) for p in p1.pieces] == [(0, (3,)), (1, (4, 5, 6, 7)), (None, (-1,))]
    assert p0.sends == ((1, (3,), 0),)  # tag = index of the piece in part 1's list
    assert p1.sends == ((0, (4,), 2),)
    assert not p0.is_local and not p0.is_identity
    # one part: only fills and own rows, nothing crosses
    (alone,) = _plans(8, 1, _conv_needs(8, 1), "zeros")
    assert alone.is_local and not alone.is_identity and alone.num_halo_rows == 0


def test_circular_wrap_four_parts():
    plans = _plans(8, 4, _conv_needs(8, 4), "circular")
    assert [(p.owner, p.indices) for p in plans[0].pieces] == [(3, (7,)), (0, (0, 1)), (1, (2,))]
    assert [(p.owner, p.indices) for p in plans[3].pieces] == [(2, (5,)), (3, (6, 7)), (0, (0,))]
    assert sorted(plans[3].sends) == [(0, (7,), 0), (2, (6,), 2)]
    assert sorted(plans[0].sends) == [(1, (1,), 0), (3, (0,), 2)]


def test_circular_two_parts_both_neighbours_are_the_same_part():
    p0, p1 = _plans(8, 2, _conv_needs(8, 2), "circular")
    assert [(p.owner, p.indices) for p in p0.pieces] == [(1, (7,)), (0, (0, 1, 2, 3)), (1, (4,))]
    assert [(p.owner, p.indices) for p in p1.pieces] == [(0, (3,)), (1, (4, 5, 6, 7)), (0, (0,))]
    # two messages to the same peer, told apart by their tags
    assert sorted(p1.sends) == [(0, (4,), 2), (0, (7,), 0)]
    assert sorted(p0.sends) == [(1, (0,), 2), (1, (3,), 0)]
    assert len({tag for _, _, tag in p1.sends}) == 2


def test_reflect_and_replicate_rows():
    p0, p1 = _plans(8, 2, _conv_needs(8, 2, kernel=5, pad=2), "reflect")
    rows0 = [i for p in p0.pieces for i in p.indices]
    rows1 = [i for p in p1.pieces for i in p.indices]
    assert rows0 == [2, 1, 0, 1, 2, 3, 4, 5] and rows1 == [2, 3, 4, 5, 6, 7, 6, 5]
    assert all(p.owner == 0 for p in p0.pieces[:-1]) and p0.pieces[-1] == Piece(1, (4, 5))
    p0, p1 = _plans(8, 2, _conv_needs(8, 2, kernel=5, pad=2), "replicate")
    assert [i for p in p0.pieces for i in p.indices] == [0, 0, 0, 1, 2, 3, 4, 5]
    assert [i for p in p1.pieces for i in p.indices] == [2, 3, 4, 5, 6, 7, 7, 7]
    assert p0.sends == ((1, (2, 3), 0),) and p1.sends == ((0, (4, 5), 2),)


def test_reflect_padding_past_the_other_side_is_refused():
    with pytest.raises(GeometryError, match=r"layer X: along spatial dim 1.*use a smaller padding"):
        plan_exchange(axis=1, size=2, bounds=split_bounds(2, 1), needs=((-2, 4),), boundary="reflect", part=0,
                      where="layer X")


def test_unknown_boundary_is_refused():
    with pytest.raises(GeometryError, match=r"layer X: padding mode 'mirror' is not one of"):
        plan_exchange(axis=0, size=8, bounds=split_bounds(8, 2), needs=((-1, 5), (3, 9)), boundary="mirror", part=0,
                      where="layer X")


@pytest.mark.parametrize("boundary", ["zeros", "circular", "replicate", "reflect"])
def test_halo_wider_than_neighbour_slab(boundary):
    # depth 5 over 4 parts: slabs of 2, 1, 1, 1 rows, and a k5 p2 window needs 2 rows each side
    needs = _conv_needs(5, 4, kernel=5, pad=2)
    with pytest.raises(GeometryError) as info:
        plan_exchange(axis=2, size=5, bounds=split_bounds(5, 4), needs=needs, boundary=boundary, part=3,
                      where="layer 'c1' (Conv3d)")
    msg = str(info.value)
    assert "layer 'c1' (Conv3d)" in msg
    assert "along spatial dim 2 (size 5, 4 parts)" in msg
    assert "part 0 holds rows [0, 2)" in msg and "needs rows [-2, 4)" in msg
    assert "thinnest slab has 1 rows" in msg
    assert "use fewer parts along dim 2 or a larger input" in msg
    assert isinstance(info.value, ValueError)


def test_circular_wrap_neighbour_is_not_too_far():
    # 3 parts of 2 rows with a 2-row halo: part 0's left halo wraps to part 2, which is its neighbour
    plans = _check_consistent(6, 3, _conv_needs(6, 3, kernel=5, pad=2), "circular")
    assert [(p.owner, p.indices) for p in plans[0].pieces] == [(2, (4, 5)), (0, (0, 1)), (1, (2, 3))]
    _check_consistent(6, 3, _conv_needs(6, 3, kernel=5, pad=2), "zeros")


def test_dim_exchange_is_identity_false_when_the_part_must_send():
    # k2 p0 s1 over 8 rows -> 7 outputs split (0, 4), (4, 7): part 1 needs exactly its own rows [4, 8) but
    # part 0 needs row 4 from it; part 1 must send even though it receives nothing (it once hung)
    needs = _conv_needs(8, 2, kernel=2, pad=0)
    assert needs == ((0, 5), (4, 8))
    p0, p1 = _plans(8, 2, needs, "zeros")
    assert [(p.owner, p.indices) for p in p1.pieces] == [(1, (4, 5, 6, 7))]
    assert p1.sends == ((0, (4,), 1),)
    assert not p1.is_identity
    assert not p1.is_local
    assert not p0.is_identity


def test_dim_exchange_is_identity_true_without_halo():
    needs = _conv_needs(8, 2, kernel=2, pad=0, stride=2)  # windows never cross a border
    for ex in _plans(8, 2, needs, "zeros"):
        assert ex.is_identity and ex.is_local and ex.num_halo_rows == 0 and ex.sends == ()


# -- Window.need / TransposedWindow.need against autograd ---------------------------------------


def _reach_conv(size, kernel, stride, pad_left, pad_right, dilation):
    """For each output row, the set of (padded) input rows in PyTorch's conv1d that affect it."""
    padded = size + pad_left + pad_right
    x = torch.zeros(1, 1, padded, dtype=torch.float64, requires_grad=True)
    y = F.conv1d(x, torch.ones(1, 1, kernel, dtype=torch.float64), stride=stride, dilation=dilation)
    reach = []
    for o in range(y.shape[-1]):
        (g,) = torch.autograd.grad(y[0, 0, o], x, retain_graph=True)
        reach.append({int(i) - pad_left for i in torch.nonzero(g[0, 0]).flatten()})
    return reach


WINDOW_CASES = [(k, s, p, d, n) for k in (1, 2, 3, 5) for s in (1, 2, 3) for p in (0, 1, 2) for d in (1, 2, 3)
                for n in (7, 10) if p <= (d * (k - 1)) and n + 2 * p >= d * (k - 1) + 1]


@pytest.mark.parametrize("kernel,stride,pad,dilation,size", WINDOW_CASES)
def test_window_need_matches_conv_reach(kernel, stride, pad, dilation, size):
    reach = _reach_conv(size, kernel, stride, pad, pad, dilation)
    window = Window(kernel, stride, pad, dilation)
    m = len(reach)
    for o0 in range(m):
        for o1 in range(o0 + 1, m + 1):
            rows = set().union(*reach[o0:o1])
            assert window.need(o0, o1) == (min(rows), max(rows) + 1), (o0, o1)


def _reach_conv_transpose(size, kernel, stride, padding, dilation, output_padding):
    """For each output row of conv_transpose1d, the set of input rows that add into it."""
    x = torch.zeros(1, 1, size, dtype=torch.float64, requires_grad=True)
    w = torch.ones(1, 1, kernel, dtype=torch.float64)
    y = F.conv_transpose1d(x, w, stride=stride, padding=padding, output_padding=output_padding, dilation=dilation)
    reach = []
    for o in range(y.shape[-1]):
        (g,) = torch.autograd.grad(y[0, 0, o], x, retain_graph=True)
        reach.append({int(i) for i in torch.nonzero(g[0, 0])[:, 0]} if g.any() else set())
    return reach


TRANSPOSED_CASES = [(k, s, p, d, op, n) for k in (1, 2, 3, 4) for s in (1, 2, 3) for d in (1, 2)
                    for p in range(0, d * (k - 1) + 1) for op in range(0, max(s, d)) for n in (4, 7)
                    if op < max(s, d) and (n - 1) * s - 2 * p + d * (k - 1) + op + 1 > 0]


@pytest.mark.parametrize("kernel,stride,padding,dilation,output_padding,size", TRANSPOSED_CASES)
def test_transposed_window_need_matches_conv_transpose_reach(kernel, stride, padding, dilation, output_padding,
                                                             size):
    reach = _reach_conv_transpose(size, kernel, stride, padding, dilation, output_padding)
    window = TransposedWindow(kernel, stride, padding, dilation, size)
    m = len(reach)
    for o0 in range(m):
        for o1 in range(o0 + 1, m + 1):
            rows = set().union(*reach[o0:o1])
            start, stop = window.need(o0, o1)
            assert 0 <= start <= stop <= size, (o0, o1, start, stop)
            assert rows <= set(range(start, stop)), f"outputs [{o0}, {o1}) need rows {rows}, plan {start, stop}"
            if dilation == 1:  # taps are contiguous, so the plan is exactly the rows that reach
                assert (start, stop) == ((min(rows), max(rows) + 1) if rows else (start, start)), (o0, o1)
            assert window.first_output(start) == start * stride - padding

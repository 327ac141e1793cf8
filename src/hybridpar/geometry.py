"""Partition geometry: how a global volume is split into slabs and which halo each slab needs.

Everything here is pure integer arithmetic on global shapes, so every rank computes the same answer
before any communication, and a split that cannot be exact is refused on all ranks alike.

Conventions: a *dim* is a tensor dim; along each spatial dim the global extent ``size`` is split
into ``parts`` contiguous slabs by ``split_bounds`` (the first ``size % parts`` slabs get one row
more), or, with ``weights`` (a slow or a smaller device holds fewer rows), in proportion to the weights.
Every tensor of a given global shape has the same split, so tensors of equal shape (a skip
connection and the decoder output it is concatenated with) always line up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridpar.errors import GeometryError

BOUNDARIES = ("zeros", "circular", "reflect", "replicate")


def split_bounds(size: int, parts: int, weights: tuple[int, ...] = ()) -> tuple[tuple[int, int], ...]:
    """``[start, stop)`` of each of ``parts`` slabs of ``size`` rows: balanced, larger slabs first; or, with
    ``weights`` (one whole number per part), rows in proportion to the weights, rounded to the nearest row
    boundary and at least one row per part where ``size >= parts`` (deep, small layers stay split)."""
    if weights:
        return _weighted_bounds(size, parts, weights)
    base, extra = divmod(size, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


def _weighted_bounds(size: int, parts: int, weights: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    total, cumulative, stops = sum(weights), 0, []
    for i, w in enumerate(weights):
        cumulative += w
        nearest = (2 * size * cumulative + total) // (2 * total)  # integers: the same on every rank
        low = (stops[-1] if stops else 0) + (1 if size >= parts else 0)
        stops.append(max(low, min(nearest, size - (parts - 1 - i) if size >= parts else size)))
    return tuple(zip((0, *stops[:-1]), stops))


def even_weights(weights: tuple[int, ...]) -> bool:
    """Weights that ask for no more than the balanced split (none, or all alike)."""
    return len(set(weights)) <= 1


@dataclass(frozen=True)
class Grid:
    """Parts per spatial dim; rank ``r`` of the spatial mesh sits at ``coords(r)`` (row-major). ``weights``:
    per spatial dim, one whole number per part (rows in proportion), or ``()`` for balanced slabs; weights
    that are all alike are stored as ``()``, so that a grid has one form."""

    parts: tuple[int, ...]
    weights: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        parts, weights = tuple(self.parts), tuple(tuple(w) for w in self.weights)
        object.__setattr__(self, "parts", parts)
        if weights and len(weights) != len(parts):
            raise GeometryError(f"slab weights {weights} give {len(weights)} spatial dims but the grid {parts} has "
                                f"{len(parts)}; give one list of weights per spatial dim")
        for axis, (w, p) in enumerate(zip(weights, parts)):
            if len(w) not in (0, p) or any(not isinstance(x, int) or x < 1 for x in w):
                raise GeometryError(f"slab weights {list(w)} of spatial dim {axis}: give {p} whole numbers >= 1 "
                                    f"(one per part), or none for even slabs")
        weights = tuple(() if even_weights(w) else w for w in weights)
        object.__setattr__(self, "weights", weights if any(weights) else ())

    def bounds(self, axis: int, size: int) -> tuple[tuple[int, int], ...]:
        """``[start, stop)`` of every part's slab along spatial dim ``axis`` of ``size`` rows."""
        return split_bounds(size, self.parts[axis], self.weights[axis] if self.weights else ())

    @property
    def size(self) -> int:
        return math.prod(self.parts)

    @property
    def ndim(self) -> int:
        return len(self.parts)

    def coords(self, rank: int) -> tuple[int, ...]:
        out = []
        for p in reversed(self.parts):
            rank, c = divmod(rank, p)
            out.append(c)
        return tuple(reversed(out))

    def rank_of(self, coords: tuple[int, ...]) -> int:
        rank = 0
        for c, p in zip(coords, self.parts):
            rank = rank * p + c
        return rank

    def neighbour(self, rank: int, axis: int, part: int) -> int:
        """The rank that has the same coordinates as ``rank`` except ``part`` along ``axis``."""
        coords = list(self.coords(rank))
        coords[axis] = part
        return self.rank_of(tuple(coords))

    def slab(self, spatial_shape: tuple[int, ...], rank: int) -> tuple[tuple[int, int], ...]:
        """``[start, stop)`` per spatial dim of the slab ``rank`` holds of a volume of ``spatial_shape``."""
        return tuple(self.bounds(axis, n)[c] for axis, (n, c) in enumerate(zip(spatial_shape, self.coords(rank))))

    def check_shape(self, spatial_shape: tuple[int, ...], where: str) -> None:
        """Refuse a volume that leaves some slab empty."""
        if len(spatial_shape) != self.ndim:
            raise GeometryError(
                f"{where}: a grid of {self.ndim} spatial dims {self.parts} cannot split a tensor with "
                f"{len(spatial_shape)} spatial dims {tuple(spatial_shape)}; give one part count per spatial dim"
            )
        for axis, (n, p) in enumerate(zip(spatial_shape, self.parts)):
            if n < p:
                raise GeometryError(
                    f"{where}: spatial dim {axis} has {n} rows but the grid splits it into {p} parts; "
                    f"use at most {n} parts along dim {axis} or a larger input"
                )


@dataclass(frozen=True)
class Piece:
    """A run of rows of an assembled slab: global ``indices`` owned by part ``owner`` (``None``: fill)."""

    owner: int | None
    indices: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.indices)


@dataclass(frozen=True)
class DimExchange:
    """What one part does along one tensor dim to build the rows ``[need_start, need_stop)`` it needs.

    ``pieces`` lists, in order, where each run of needed rows comes from; ``sends`` lists, for every
    other part that needs rows this part owns, ``(part, indices, tag)``. ``lo`` is the first global
    row this part holds, so a global index ``i`` is local row ``i - lo``.
    """

    axis: int
    part: int
    lo: int
    hi: int
    pieces: tuple[Piece, ...]
    sends: tuple[tuple[int, tuple[int, ...], int], ...]

    @property
    def is_identity(self) -> bool:
        """This part keeps its slab as it is and sends nothing."""
        return (
            not self.sends
            and len(self.pieces) == 1
            and self.pieces[0].owner == self.part
            and self.pieces[0].indices == tuple(range(self.lo, self.hi))
        )

    @property
    def is_local(self) -> bool:
        """No rows cross to another part (only own rows and fills)."""
        return not self.sends and all(p.owner in (None, self.part) for p in self.pieces)

    @property
    def num_halo_rows(self) -> int:
        return sum(p.length for p in self.pieces if p.owner not in (None, self.part))


def _source_index(i: int, size: int, boundary: str) -> int | None:
    """Global row that supplies row ``i`` of the padded axis, or ``None`` for a fill row."""
    if 0 <= i < size:
        return i
    if boundary == "zeros":
        return None
    if boundary == "circular":
        return i % size
    if boundary == "replicate":
        return 0 if i < 0 else size - 1
    if boundary == "reflect":
        j = -i if i < 0 else 2 * (size - 1) - i
        return j if 0 <= j < size else -1
    raise AssertionError(boundary)


def _pieces(need: tuple[int, int], size: int, bounds, boundary: str) -> list[Piece]:
    owners = [p for p, (lo, hi) in enumerate(bounds) for _ in range(lo, hi)]
    pieces: list[tuple[int | None, list[int]]] = []
    for i in range(*need):
        src = _source_index(i, size, boundary)
        if src == -1 or (src is None and boundary != "zeros"):
            raise GeometryError(f"padding of {need[0]} rows reaches past the other side of a dim of {size} rows")
        owner = None if src is None else owners[src]
        if pieces and pieces[-1][0] == owner and (owner is None or _extends(pieces[-1][1], src)):
            pieces[-1][1].append(src if src is not None else -1)
        else:
            pieces.append((owner, [src if src is not None else -1]))
    return [Piece(owner, tuple(idx)) for owner, idx in pieces]


def _extends(run: list[int], src: int) -> bool:
    """Rows of one piece step by +1, or stay in reverse order (reflect), or repeat (replicate)."""
    if len(run) == 1:
        return abs(src - run[-1]) <= 1
    return src - run[-1] == run[-1] - run[-2]


def plan_exchange(
    *,
    axis: int,
    size: int,
    bounds: tuple[tuple[int, int], ...],
    needs: tuple[tuple[int, int], ...],
    boundary: str,
    part: int,
    where: str,
) -> DimExchange:
    """The exchange along one spatial dim for ``part``, given the rows every part needs.

    ``bounds`` are the parts' slabs of the ``size`` rows (``Grid.bounds``); ``needs[q]`` is ``[start, stop)``
    in global rows (outside ``[0, size)`` means padding, filled per ``boundary``). Every part computes every
    part's pieces, so senders and receivers agree. A row owned by a part that is not a neighbour (halo wider
    than a slab) is refused.
    """
    if boundary not in BOUNDARIES:
        raise GeometryError(f"{where}: padding mode {boundary!r} is not one of {BOUNDARIES}")
    parts = len(bounds)
    all_pieces = []
    for q, need in enumerate(needs):
        try:
            pieces = _pieces(need, size, bounds, boundary)
        except GeometryError as err:
            raise GeometryError(f"{where}: along spatial dim {axis}, {err}; use a smaller padding") from None
        for piece in pieces:
            _check_neighbour(piece, q, parts, boundary, axis, size, bounds, need, where)
        all_pieces.append(pieces)
    sends = tuple(
        (q, piece.indices, tag)
        for q, pieces in enumerate(all_pieces)
        if q != part
        for tag, piece in enumerate(pieces)
        if piece.owner == part
    )
    lo, hi = bounds[part]
    return DimExchange(axis=axis, part=part, lo=lo, hi=hi, pieces=tuple(all_pieces[part]), sends=sends)


def _check_neighbour(piece, q, parts, boundary, axis, size, bounds, need, where) -> None:
    if piece.owner is None or piece.owner == q:
        return
    distance = abs(piece.owner - q)
    if boundary == "circular":
        distance = min(distance, parts - distance)
    if distance <= 1:
        return
    lo, hi = bounds[q]
    thinnest = min(b - a for a, b in bounds)
    raise GeometryError(
        f"{where}: along spatial dim {axis} (size {size}, {parts} parts), part {q} holds rows [{lo}, {hi}) "
        f"but needs rows [{need[0]}, {need[1]}), which reach past its neighbour (the thinnest slab has "
        f"{thinnest} rows, thinner than the halo); use fewer parts along dim {axis} or a larger input"
    )


@dataclass(frozen=True)
class Window:
    """A sliding window along one dim: output row ``o`` reads input rows
    ``o * stride - pad_left + dilation * j`` for ``j`` in ``range(kernel)``."""

    kernel: int
    stride: int
    pad_left: int
    dilation: int = 1

    def need(self, out_start: int, out_stop: int) -> tuple[int, int]:
        start = out_start * self.stride - self.pad_left
        stop = (out_stop - 1) * self.stride - self.pad_left + self.dilation * (self.kernel - 1) + 1
        return start, stop


@dataclass(frozen=True)
class TransposedWindow:
    """A transposed convolution along one dim: input row ``i`` adds into output rows
    ``i * stride - padding + dilation * j``; only input rows in ``[0, in_size)`` exist."""

    kernel: int
    stride: int
    padding: int
    dilation: int
    in_size: int

    def need(self, out_start: int, out_stop: int) -> tuple[int, int]:
        reach = self.dilation * (self.kernel - 1)
        start = max(0, -(-(out_start + self.padding - reach) // self.stride))
        stop = min(self.in_size, (out_stop - 1 + self.padding) // self.stride + 1)
        return start, max(stop, start)

    def first_output(self, in_start: int) -> int:
        """Global output row of the first row that a local transposed conv of rows from ``in_start`` makes."""
        return in_start * self.stride - self.padding


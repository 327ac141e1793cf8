"""Named parallel degrees of one run, pure (no torch): what the planner writes and the runtime builds a mesh from.

``ParallelDims(dp=2, spatial=(2, 1, 1))`` describes a run; its mesh axes are named ``pp``, ``dp``, ``spatial``
and ``tp`` (``AXES``, outermost first; an axis of size 1 is kept, so code can always ask for it by name). The
spatial axis is one mesh axis of size ``prod(spatial)``; the grid is the row-major factorisation of that axis.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridpar.errors import MeshError

AXES = ("pp", "dp", "spatial", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Parallel degrees of one run. ``spatial`` gives parts per spatial dim, ``(D, H, W)`` or ``(H, W)``."""

    dp: int = 1
    spatial: tuple[int, ...] = (1,)
    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        object.__setattr__(self, "spatial", tuple(self.spatial))
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise MeshError(f"{name}={value!r}: every parallel degree must be an integer >= 1")
        if not self.spatial or any(not isinstance(p, int) or p < 1 for p in self.spatial):
            raise MeshError(
                f"spatial={self.spatial!r}: give a tuple of parts per spatial dim, each an integer >= 1, "
                "e.g. spatial=(2, 1, 1) to split the depth of a 3D volume in two"
            )

    @property
    def num_spatial(self) -> int:
        return math.prod(self.spatial)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.num_spatial * self.tp

    def sizes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp, "spatial": self.num_spatial, "tp": self.tp}

    def coords(self, rank: int) -> dict[str, int]:
        """The index of global rank ``rank`` along each mesh axis (the mesh is row-major over ``AXES``)."""
        sizes, out = self.sizes(), {}
        for axis in reversed(AXES):
            rank, out[axis] = divmod(rank, sizes[axis])
        return {axis: out[axis] for axis in AXES}

    def describe(self) -> str:
        grid = "x".join(map(str, self.spatial))
        return f"pp={self.pp} x dp={self.dp} x spatial={grid} ({self.num_spatial}) x tp={self.tp}"

    def check_world_size(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise MeshError(
                f"{self.describe()} = {self.world_size} ranks, but the world size is {world_size}; "
                "change the degrees so that they multiply to the world size"
            )

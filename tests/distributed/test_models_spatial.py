"""The workload models (``hybridpar.models``) under spatial parallelism: exact against one process (float64)
on 2 and 4 gloo ranks; their shapes, structure and argument errors are in ``tests/unit/test_models.py``."""

import math

import pytest

from support import cases

EQUIVALENCE = [
    ("cosmoflow", dict(size=32, base_channels=2), (2, 4, 32, 32, 32)),
    ("cosmoflow", dict(size=32, base_channels=2, batch_norm=True), (2, 4, 32, 32, 32)),
    ("cosmoflow", dict(size=32, base_channels=2, batch_norm=True, num_blocks=2, pooling="average"),
     (2, 4, 32, 32, 32)),
    # uneven slabs below the top level: 10 -> 5 (3 + 2 on two parts), 12 -> 6 -> 3 (2 + 1)
    ("unet3d", dict(base_channels=2, depth=2, norm="instance"), (2, 1, 10, 6, 6)),
    ("unet3d", dict(base_channels=2, depth=2, norm="batch"), (2, 1, 10, 6, 6)),
    ("unet3d", dict(base_channels=2, depth=3, norm="instance"), (2, 1, 12, 8, 8)),
    ("unet3d", dict(base_channels=2, depth=3, norm="batch"), (2, 1, 12, 8, 8)),
]


def _case_id(case):
    name, kwargs, _ = case
    return name + "(" + ",".join(f"{k}={v}" for k, v in kwargs.items()) + ")"


@pytest.mark.parametrize("grid", [(2, 1, 1), (1, 2, 1), (2, 2, 1)], ids=str)
@pytest.mark.parametrize("case", EQUIVALENCE, ids=_case_id)
def test_spatially_parallel_matches_one_process(dist2, dist4, case, grid):
    """Forward, input gradient, every parameter gradient and running statistics (tolerance: cases.TOL)."""
    name, kwargs, shape = case
    pool = dist4 if math.prod(grid) == 4 else dist2
    pool.run(cases.check_equivalence, spec=("hybridpar", name, kwargs), shape=shape, grid=grid)

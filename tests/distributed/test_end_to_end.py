"""Two small networks trained 3 SGD steps with dp=2 x spatial=2 (4 ranks), equal to one process on the
global batch: every loss and every parameter after every step (float64, 1e-10)."""

import pytest

from support import cases


@pytest.mark.parametrize("grid", [(2, 1, 1), (1, 1, 2)], ids=str)
@pytest.mark.parametrize("batch_norm", [False, True], ids=["plain", "batchnorm"])
def test_cosmoflow_like_dp2_spatial2(dist4, grid, batch_norm):
    losses = dist4.run(cases.train_equivalence, model="TinyCosmoFlow",
                       kwargs=dict(size=16, channels=2, batch_norm=batch_norm, dropout=0.0),
                       shape=(4, 2, 16, 16, 16), grid=grid, dp=2, task="regression")
    assert len(losses[0]) == 3 and losses[0] == losses[3]


@pytest.mark.parametrize("norm", ["instance", "batch"])
def test_unet_like_dp2_spatial2(dist4, norm):
    losses = dist4.run(cases.train_equivalence, model="TinyUNet", kwargs=dict(channels=1, norm=norm),
                       shape=(2, 1, 12, 10, 8), grid=(2, 1, 1), dp=2, task="segmentation")
    assert len(losses[0]) == 3


def test_unet_like_spatial4_2d_grid(dist4):
    cases_losses = dist4.run(cases.train_equivalence, model="TinyUNet", kwargs=dict(channels=1),
                             shape=(2, 1, 12, 10, 8), grid=(2, 2, 1), dp=1, task="segmentation")
    assert len(cases_losses[0]) == 3


@pytest.mark.parametrize("model,kwargs,task,shape", [
    ("TinyCosmoFlow", dict(size=16, channels=2, batch_norm=True, dropout=0.0), "regression", (4, 2, 16, 16, 16)),
    ("TinyUNet", dict(channels=1), "segmentation", (2, 1, 12, 10, 8)),
], ids=["cosmoflow", "unet"])
def test_fsdp2_dp2_spatial2(dist4, model, kwargs, task, shape):
    dist4.run(cases.train_equivalence, model=model, kwargs=kwargs, shape=shape, grid=(2, 1, 1), dp=2,
              task=task, kind="fsdp")

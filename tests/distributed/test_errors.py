"""Bad inputs give a clear ValueError on every rank, before any halo exchange could hang: the message
names the place (module path or 'the model input'), the value and the fix."""

import pytest

from support import cases_extra

HANG = 30  # seconds: a rank that did not raise would wait in a collective; the harness reports it as a hang

def _parts(name):
    grid = cases_extra.ERROR_CASES[name][2]
    out = 1
    for p in grid:
        out *= p
    return out


@pytest.mark.parametrize("name", list(cases_extra.ERROR_CASES))
def test_model_errors_on_every_rank(dist2, dist4, name):
    pool = {2: dist2, 4: dist4}[_parts(name)]
    messages = pool.run(cases_extra.expect_value_error, timeout=HANG, case=name)
    assert len(set(messages)) == 1, f"ranks disagree: {messages}"


def test_functional_dropout_is_allowed_in_eval(dist2):
    dist2.run(cases_extra.allowed_ops_match_one_process, timeout=HANG, train=False)


def test_allowed_ops_match_one_process_in_training(dist2):
    dist2.run(cases_extra.allowed_ops_match_one_process, timeout=HANG, train=True)


@pytest.mark.parametrize("kind", ["smaller_first", "unequal_other_dim", "unequal_channels", "unequal_ndim"])
def test_untileable_hand_made_slabs(dist2, kind):
    messages = dist2.run(cases_extra.untileable_slabs, timeout=HANG, kind=kind)
    assert messages[0] == messages[1]


def test_shard_refuses_bad_grids(dist2, dist4):
    for pool in (dist2, dist4):
        results = pool.run(cases_extra.shard_errors, timeout=HANG)
        assert all(r == results[0] for r in results)


def test_wrong_mesh_size_for_the_grid(dist2, dist4):
    for pool in (dist2, dist4):
        pool.run(cases_extra.wrong_mesh_size_errors, timeout=HANG)


@pytest.mark.parametrize("what", ["parallelize", "shard", "unshard"])
def test_two_dim_mesh_instead_of_the_spatial_sub_mesh(dist4, what):
    messages = dist4.run(cases_extra.two_dim_mesh_error, timeout=HANG, what=what)
    assert len(set(messages)) == 1

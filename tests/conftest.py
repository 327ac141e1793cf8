"""Shared by every folder: one pool of gloo ranks per world size (``dist2``, ``dist4``, ``dist8``) and the
markers ``dist`` (a test that uses a pool) and ``e2e`` (a test under ``tests/e2e``)."""

from pathlib import Path

import pytest

from support.harness import SLACK, Pool

E2E = Path(__file__).parent / "e2e"

_POOLS: dict[int, Pool] = {}


def _pool(world_size: int) -> Pool:
    if world_size not in _POOLS:
        _POOLS[world_size] = Pool(world_size)
    return _POOLS[world_size]


@pytest.fixture(scope="session")
def dist2():
    return _pool(2)


@pytest.fixture(scope="session")
def dist4():
    return _pool(4)


@pytest.fixture(scope="session")
def dist8():
    return _pool(8)


def pytest_collection_modifyitems(items):
    """A test that runs in a pool of processes is marked ``dist`` (``-m "not dist"``: the single-process set);
    one under ``tests/e2e`` (the command line, training in fresh workers) ``e2e``. Each test's timeout (its
    marker's, or pyproject's) is scaled by ``HYBRIDPAR_TEST_SLACK`` (``support.harness``)."""
    for item in items:
        if {"dist2", "dist4", "dist8"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.dist)
        if item.path.is_relative_to(E2E):
            item.add_marker(pytest.mark.e2e)
        if SLACK != 1:
            marker = item.get_closest_marker("timeout")
            seconds = marker.args[0] if marker is not None and marker.args else item.config.getini("timeout")
            item.add_marker(pytest.mark.timeout(float(seconds) * SLACK), append=False)


def pytest_sessionfinish(session, exitstatus):
    for pool in _POOLS.values():
        pool.close()

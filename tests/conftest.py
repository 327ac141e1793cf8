import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import Pool  # noqa: E402

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
    """A test that runs in a pool of processes is marked ``dist`` (``-m "not dist"``: the single-process set)."""
    for item in items:
        if {"dist2", "dist4", "dist8"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.dist)


def pytest_sessionfinish(session, exitstatus):
    for pool in _POOLS.values():
        pool.close()

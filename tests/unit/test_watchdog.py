"""The watchdog's heartbeats: each beat reads the peers' counters, so that a hang names the ranks that stopped
beating at once, without a reading of its own after the deadline."""

import threading
import time

import pytest

from hybridpar.train import watchdog
from hybridpar.train.watchdog import Watchdog


class Store:
    """The run's store, as the watchdog uses it: counters."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + amount
            return self.counts[key]


@pytest.fixture
def fast(monkeypatch):
    """Beats every 0.1 s; a peer silent for 0.6 s stopped beating."""
    monkeypatch.setattr(watchdog, "BEAT_S", 0.1)
    monkeypatch.setattr(watchdog, "SILENT_S", 0.6)


def test_a_hang_names_the_peers_whose_heartbeat_stopped(fast):
    store = Store()
    dog = Watchdog(10.0, store, rank=0, world_size=4, attempt=2)
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # rank 1 beats on; ranks 2 and 3 beat once, then stop
            store.add("hybridpar/attempt_2/beat/1", 1)
            time.sleep(0.05)
        store.add("hybridpar/attempt_2/beat/2", 1)
        assert dog._stopped() == "rank 3 stopped beating (stopped, frozen or cut off)"
        time.sleep(0.7)
        store.add("hybridpar/attempt_2/beat/1", 1)
        assert dog._stopped() == "ranks 2, 3 stopped beating (stopped, frozen or cut off)"
        assert store.counts["hybridpar/attempt_2/beat/0"] >= 10  # its own beat went on meanwhile
    finally:
        dog.close()


def test_every_rank_beating_is_a_stalled_collective(fast):
    store = Store()
    dog = Watchdog(10.0, store, rank=1, world_size=2, attempt=0)
    try:
        for _ in range(20):
            store.add("hybridpar/attempt_0/beat/0", 1)
            time.sleep(0.05)
        assert dog._stopped() == "every rank beats: a collective or its link stalled"
    finally:
        dog.close()


def test_a_store_that_does_not_answer_is_told():
    class Gone:
        def add(self, key, amount):
            raise ConnectionError("gone")

    dog = Watchdog(10.0, Gone(), rank=0, world_size=2, attempt=0)
    try:
        assert dog._stopped() == "the run's store does not answer (its host stopped?)"
    finally:
        dog.close()

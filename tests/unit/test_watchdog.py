"""The watchdog's heartbeats: each beat reads the peers' counters, so that a hang names the ranks that stopped
beating at once, without a reading of its own after the deadline."""

import math
import threading
import time

import pytest

from hybridpar.train import watchdog
from hybridpar.train.watchdog import FIRST_S, FLOOR_S, Known, Watchdog


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


def test_a_phase_first_in_this_process_gets_the_limit_earlier_processes_measured(tmp_path):
    """A restart's (or a --resume's) first validation was given the process group's timeout: a rank stopped in it
    was found after 300 s. What the run's earlier processes measured on as many ranks is its limit now; a
    restart's set-up has one, the run's first has none."""
    path = tmp_path / "phase_times.json"
    first = Known(path, "2 ranks", carried=False, writes=True)
    first.record("validation", 1.5)
    first.record("validation", 1.2)  # the slowest is kept
    first.record("step", 0.3)
    first.record("set-up", 4.0)
    first.flush()
    again = Watchdog(10.0, Store(), rank=1, world_size=2, attempt=1,
                     known=Known(path, "2 ranks", carried=True, writes=False))
    try:
        assert again.limit("validation") == pytest.approx(15.0)
        assert again.limit("step") == FLOOR_S  # 3 s: never under the floor
        assert again.limit("checkpoint", expected=2.0) == pytest.approx(20.0)  # nothing measured: as expected
        assert again.limit("re-plan") == FIRST_S
        assert again.limit("set-up") == pytest.approx(40.0)
        again.phase("validation", 4)
        time.sleep(0.05)
        again.idle()
        assert again.limit("validation") == FLOOR_S  # this process's own measure first
    finally:
        again.close()
    for other in (Known(path, "4 ranks", carried=True, writes=False),  # on other ranks: says nothing
                  Known(path, "2 ranks", carried=False, writes=True)):  # a fresh run in the same folder
        dog = Watchdog(10.0, Store(), rank=0, world_size=2, attempt=0, known=other)
        try:
            assert dog.limit("validation") == FIRST_S
            assert dog.limit("set-up") == math.inf
        finally:
            dog.close()


def test_only_the_keeping_rank_writes_and_an_unreadable_file_is_nothing_known(tmp_path):
    path = tmp_path / "phase_times.json"
    reader = Known(path, "p", carried=True, writes=False)
    reader.record("step", 2.0)
    reader.flush()
    assert not path.exists()
    path.write_text("{not json")
    assert Known(path, "p", carried=True, writes=True).seconds == {}
    path.write_text('{"key": "p", "seconds": [1, 2]}')
    assert Known(path, "p", carried=True, writes=True).seconds == {}


def test_a_phase_that_failed_is_not_a_measure(tmp_path):
    """A set-up that raised (the watchdog closed while it ran) leaves no time behind: nothing in the run's folder
    of a run that failed before it trained."""
    known = Known(tmp_path / "phase_times.json", "2 ranks", carried=False, writes=True)
    dog = Watchdog(10.0, Store(), rank=0, world_size=2, attempt=0, known=known)
    dog.phase("set-up", 0)
    time.sleep(0.05)
    dog.close()
    assert known.seconds == {} and not (tmp_path / "phase_times.json").exists()

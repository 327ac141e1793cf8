"""Hangs are failures. A rank that stops (SIGSTOP, a frozen node) or a collective that stalls (a link that
drops packets without a reset) makes every rank wait, by default for the process group's timeout. Each rank of
a run started by an elastic agent (``hybridpar train``'s, or ``torchrun``'s) runs a watchdog thread instead:

- a **heartbeat**: every ``BEAT_S`` it adds 1 to its counter in the run's store, whatever its training thread
  does (a rank waiting in a collective beats; a stopped one does not);
- a **deadline** per phase of the training loop (a step, a checkpoint, a validation, a batch's reading): one knob,
  ``train.hang_factor``, times the slowest of the phase's last ``MEASURED`` runs, never under ``FLOOR_S``; a
  phase not measured yet, the same times what it is expected to take (a checkpoint: its bytes at an assumed
  rate), or the process group's timeout where nothing is expected (``FIRST_S``: compiling, first allocations).

Each beat also reads its peers' counters, so that a phase past its deadline is a hang told at once: the ranks
whose counter has not moved for ``SILENT_S`` stopped beating (else every rank is alive and a collective or its link
stalled); the rank writes that verdict to the store (the launcher tells it) and to its stderr, and ends itself with
SIGKILL. The agent sees the rank fail and
restarts the run from its newest checkpoint (``--max-restarts``), or stops it, as after any failure.
"""

from __future__ import annotations

import collections
import os
import signal
import sys
import threading
import time
from datetime import timedelta

from hybridpar.launch import hang_key

FLOOR_S = 10.0  # no phase is a hang sooner: a loaded machine stalls a process for seconds
FIRST_S = 300.0  # a phase not measured yet: the process group's timeout (launch.init_distributed)
BEAT_S = 1.0
SILENT_S = 2.5  # a peer whose counter has not moved for this long stopped beating
MEASURED = 20  # a phase's deadline follows its slowest of this many last runs
STORE_TIMEOUT_S = 5.0


class Watchdog:
    """The watchdog of this rank (``rank`` of ``world_size``) in restart attempt ``attempt``; ``factor``: the
    ``train.hang_factor``. ``phase(kind, step)`` starts a phase (ending the one before), ``idle()`` ends the last.
    ``store``: a client of the run's store of its own (the thread uses it while the training thread waits)."""

    def __init__(self, factor: float, store, rank: int, world_size: int, attempt: int):
        self.factor, self.store, self.rank, self.world_size = factor, store, rank, world_size
        self.prefix = f"hybridpar/attempt_{attempt}"
        self.attempt = attempt
        self._times: dict[str, collections.deque] = {}
        self._lock = threading.Lock()
        self._current: tuple[str, int, float, float] | None = None  # kind, step, began, deadline
        self._stop = threading.Event()
        self._heard: dict[int, tuple[int, float]] = {}  # a peer's counter, and when this rank saw it move
        self._thread = threading.Thread(target=self._watch, name="hybridpar-watchdog", daemon=True)
        self._thread.start()

    def limit(self, kind: str, expected: float | None = None) -> float:
        """Seconds a phase of ``kind`` may take before it is a hang (``expected``: its seconds, before any run of
        it was measured)."""
        times = self._times.get(kind)
        if not times and expected is None:
            return FIRST_S
        return max(FLOOR_S, self.factor * (max(times) if times else expected))

    def phase(self, kind: str, step: int, expected: float | None = None) -> None:
        now = time.monotonic()
        with self._lock:
            self._end(now)
            self._current = (kind, step, now, now + self.limit(kind, expected))

    def idle(self) -> None:
        with self._lock:
            self._end(time.monotonic())
            self._current = None

    def close(self) -> None:
        self.idle()
        self._stop.set()
        self._thread.join()

    def _end(self, now: float) -> None:
        if self._current is not None:
            kind, _, began, _ = self._current
            self._times.setdefault(kind, collections.deque(maxlen=MEASURED)).append(now - began)

    def _beat(self) -> None:
        """Add 1 to this rank's counter; read its peers'."""
        try:
            self.store.add(f"{self.prefix}/beat/{self.rank}", 1)
            now = time.monotonic()
            for r in range(self.world_size):
                if r != self.rank:
                    count = self.store.add(f"{self.prefix}/beat/{r}", 0)
                    if self._heard.get(r, (None,))[0] != count:
                        self._heard[r] = (count, now)
        except Exception:  # noqa: BLE001 - the store gone: the launcher is gone (launch.die_with)
            pass

    def _watch(self) -> None:
        beat = 0.0
        while not self._stop.wait(0.25):
            now = time.monotonic()
            if now - beat >= BEAT_S:
                beat = now
                self._beat()
            with self._lock:
                current = self._current
            if current is not None and now > current[3]:
                self._hung(*current, now)

    def _hung(self, kind: str, step: int, began: float, deadline: float, now: float) -> None:
        what = f"step {step}" if kind == "step" else f"the {kind} after step {step}"
        told = (f"no progress in {what} for {now - began:.1f} s on rank {self.rank} (its limit {deadline - began:.1f} "
                f"s: train.hang_factor = {self.factor:g}); {self._stopped()}")
        try:
            self.store.compare_set(hang_key(self.attempt), "", told)
        except Exception:  # noqa: BLE001 - told on stderr all the same
            pass
        print(f"warning: {told}; this attempt ends", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def _stopped(self) -> str:
        """Which ranks stopped beating: those whose counter this rank has not seen move for ``SILENT_S`` (read
        again first: a reading may be a beat old)."""
        self._beat()
        if len(self._heard) < self.world_size - 1:
            return "the run's store does not answer (its host stopped?)"
        now = time.monotonic()
        silent = [r for r, (_, moved) in sorted(self._heard.items()) if now - moved >= SILENT_S]
        if silent:
            ranks = ", ".join(map(str, silent))
            return f"rank{'s' if len(silent) > 1 else ''} {ranks} stopped beating (stopped, frozen or cut off)"
        return "every rank beats: a collective or its link stalled"


def for_this_rank(config):
    """The watchdog of a rank started by an elastic agent (``None`` elsewhere, or with ``train.hang_factor = 0``):
    its store client connects where the process group's did."""
    if not config.train.hang_factor or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=STORE_TIMEOUT_S))
    return Watchdog(config.train.hang_factor, store, dist.get_rank(), dist.get_world_size(),
                    int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

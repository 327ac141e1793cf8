"""Hangs are failures. A rank that stops (SIGSTOP, a frozen node) or a collective that stalls (a link that
drops packets without a reset) makes every rank wait, by default for the process group's timeout. Each rank of
a run started by an elastic agent (``hybridpar train``'s, or ``torchrun``'s) runs a watchdog thread instead:

- a **heartbeat**: every ``BEAT_S`` it adds 1 to its counter in the run's store, whatever its training thread
  does (a rank waiting in a collective beats; a stopped one does not);
- a **deadline** per phase of the training loop (a step, a checkpoint, a validation, a batch's reading): one knob,
  ``train.hang_factor``, times the slowest of the phase's last ``MEASURED`` runs, never under ``FLOOR_S``. A
  phase not measured yet in this process: the same times the slowest it took in this run's earlier processes
  on as many ranks (``Known``: a restart, a ``--resume``), else what it is expected to take (a checkpoint:
  its bytes at an assumed rate), else ``FIRST_S``, just under the process group's timeout (the run's first
  step: compiling, first allocations). Without what earlier processes measured, a rank stopped in the first
  validation after a restart was found only after 300 s. A restart's set-up (the model built and analysed)
  and its checkpoint's reading are phases too; the run's first set-up has no deadline (a large model's
  analysis takes minutes, on every rank at once).

Each beat also reads its peers' counters, so that a phase past its deadline is a hang told at once: the ranks
whose counter has not moved for ``SILENT_S`` stopped beating (else every rank is alive and a collective or its link
stalled); the rank writes that verdict to the store (the launcher tells it) and to its stderr, and ends itself with
SIGKILL. The agent sees the rank fail and
restarts the run from its newest checkpoint (``--max-restarts``), or stops it, as after any failure.
"""

from __future__ import annotations

import collections
import json
import math
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

from hybridpar.launch import PROCESS_GROUP_TIMEOUT_S, hang_key

FLOOR_S = 10.0  # no phase is a hang sooner: a loaded machine stalls a process for seconds
FIRST_S = 0.9 * PROCESS_GROUP_TIMEOUT_S  # nothing known of a phase: found before a collective's own timeout
BEAT_S = 1.0
SILENT_S = 2.5  # a peer whose counter has not moved for this long stopped beating
MEASURED = 20  # a phase's deadline follows its slowest of this many last runs
STORE_TIMEOUT_S = 5.0
PHASE_TIMES = "phase_times.json"  # in the run's folder: ``Known``
SET_UP = "set-up"  # from a process's start to its checkpoint's reading (or first batch): the model, its plan


class Known:
    """The slowest time each phase took in a run's processes so far, kept in ``path`` (JSON) for the processes
    after them with the same ``key`` (the world size: the times of a run on other ranks say nothing).
    ``carried``: whether this process goes on with the run of the file (a restart, a ``--resume``; a fresh run's
    folder may hold a file of a run moved away). ``writes``: whether this process keeps the file (one rank
    does); ``record`` is cheap (the training thread calls it), ``flush`` writes what changed (the watchdog's
    thread calls it)."""

    def __init__(self, path: Path, key: str, *, carried: bool, writes: bool):
        self.path, self.key, self.writes = path, key, writes
        self.seconds: dict[str, float] = {}
        self._changed = False
        if not carried:
            return
        try:
            saved = json.loads(path.read_text())
            if saved.get("key") == key:
                self.seconds = {str(k): float(v) for k, v in saved["seconds"].items()
                                if math.isfinite(float(v)) and float(v) >= 0}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # none yet, or unreadable: nothing known (the limits fall back, none is tighter)

    def record(self, kind: str, seconds: float) -> None:
        if self.writes and seconds > self.seconds.get(kind, 0.0):
            self.seconds = {**self.seconds, kind: seconds}
            self._changed = True

    def flush(self) -> None:
        if not self._changed:
            return
        seconds, self._changed = self.seconds, False  # a time recorded meanwhile is written at the next beat
        temporary = self.path.with_name(self.path.name + ".tmp")
        try:
            temporary.write_text(json.dumps({"key": self.key, "seconds": seconds}) + "\n")
            os.replace(temporary, self.path)
        except OSError:  # no folder yet (a fresh run's), a full disk: tried again at the next beat (meanwhile the
            self._changed = True  # next processes' first phases would get the longer limits, nothing else changes)


class Watchdog:
    """The watchdog of this rank (``rank`` of ``world_size``) in restart attempt ``attempt``; ``factor``: the
    ``train.hang_factor``. ``phase(kind, step)`` starts a phase (ending the one before), ``idle()`` ends the last.
    ``store``: a client of the run's store of its own (the thread uses it while the training thread waits);
    ``known``: what earlier processes of the run measured."""

    def __init__(self, factor: float, store, rank: int, world_size: int, attempt: int, known: Known | None = None):
        self.factor, self.store, self.rank, self.world_size = factor, store, rank, world_size
        self.prefix = f"hybridpar/attempt_{attempt}"
        self.attempt = attempt
        self.known = known
        self._times: dict[str, collections.deque] = {}
        self._lock = threading.Lock()
        self._current: tuple[str, int | None, float, float] | None = None  # kind, step, began, deadline
        self._stop = threading.Event()
        self._heard: dict[int, tuple[int, float]] = {}  # a peer's counter, and when this rank saw it move
        self._thread = threading.Thread(target=self._watch, name="hybridpar-watchdog", daemon=True)
        self._thread.start()

    def limit(self, kind: str, expected: float | None = None) -> float:
        """Seconds a phase of ``kind`` may take before it is a hang (``expected``: its seconds, before any run of
        it was measured)."""
        times = self._times.get(kind)
        if times:
            return max(FLOOR_S, self.factor * max(times))
        before = self.known.seconds.get(kind) if self.known is not None else None
        if before is None and expected is None:
            return math.inf if kind == SET_UP else FIRST_S
        return max(FLOOR_S, self.factor * (before if before is not None else expected))

    def phase(self, kind: str, step: int | None, expected: float | None = None) -> None:
        """A phase of ``kind`` begins, after step ``step`` (``None``: before training, as the set-up)."""
        now = time.monotonic()
        with self._lock:
            self._end(now)
            self._current = (kind, step, now, now + self.limit(kind, expected))

    def idle(self) -> None:
        with self._lock:
            self._end(time.monotonic())
            self._current = None

    def close(self) -> None:
        """The watchdog ends; a phase still running is not a measure of it (the set-up or step that failed)."""
        with self._lock:
            self._current = None
        self._stop.set()
        self._thread.join()

    def _end(self, now: float) -> None:
        if self._current is not None:
            kind, _, began, _ = self._current
            self._times.setdefault(kind, collections.deque(maxlen=MEASURED)).append(now - began)
            if self.known is not None:
                self.known.record(kind, now - began)

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
                if self.known is not None:
                    self.known.flush()
            with self._lock:
                current = self._current
            if current is not None and now > current[3]:
                self._hung(*current, now)

    def _hung(self, kind: str, step: int | None, began: float, deadline: float, now: float) -> None:
        what = f"step {step}" if kind == "step" else f"the {kind}" + (f" after step {step}" if step is not None
                                                                       else "")
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


def for_this_rank(config, carried: bool):
    """The watchdog of a rank started by an elastic agent (``None`` elsewhere, or with ``train.hang_factor = 0``):
    its store client connects where the process group's did; it knows what the run's earlier processes on as many
    ranks measured (``carried``: the run goes on from them; the file is in the run's folder, rank 0 keeps it)."""
    if not config.train.hang_factor or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    import torch.distributed as dist

    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=STORE_TIMEOUT_S))
    known = Known(Path(config.run_dir) / PHASE_TIMES, f"{dist.get_world_size()} ranks", carried=carried,
                  writes=dist.get_rank() == 0)
    return Watchdog(config.train.hang_factor, store, dist.get_rank(), dist.get_world_size(),
                    int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")), known)

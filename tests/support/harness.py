"""Multi-process test harness: a pool of gloo ranks started once per world size and reused by every
test, so a test costs its own work, not a process-group start-up.

``pool.run(fn, **kwargs)`` runs the module-level function ``fn`` on every rank (after
``torch.distributed`` is initialised) and returns the list of per-rank results. An exception on any
rank fails the test with that rank's traceback; a rank that does not answer within the timeout
(a hang) fails the test and the pool is restarted for the next one.

A loaded machine (a CI runner, a second ``make test`` beside this one) runs everything slower: every limit of
the suite is ``limit(seconds)``, the seconds times ``HYBRIDPAR_TEST_SLACK`` (default 1), and a run past its
limit whose ranks still use CPU time is slow, not hung: it gets more time, up to ``SLOW_TIMES`` its limit. A hang
is told with the machine's load.

A rank imports ``fn`` by its module's name with the parent's ``sys.path``: ``tests`` (pyproject's ``pythonpath``)
for ``support.*``, and each test folder, which pytest's default ``prepend`` import mode puts there, for a test
module (``tests/distributed/test_tensor.py`` is ``test_tensor``: test file names are unique across folders).
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue
import socket
import sys
import traceback

SLACK = float(os.environ.get("HYBRIDPAR_TEST_SLACK", "1"))
TASK_TIMEOUT = 60.0
AFTER_ERROR_TIMEOUT = 10.0  # once one rank failed, the others get this long before the pool restarts
SLOW_TIMES = 10  # a run still computing past its limit gets this many times it in all
_MESHES: dict = {}


def limit(seconds: float) -> float:
    """A limit of the suite (a hang's timeout, a wait) on this machine: ``seconds`` times ``HYBRIDPAR_TEST_SLACK``."""
    return seconds * SLACK


def load() -> str:
    """``load 12.1 8.0 4.2 on 2 cores``: what the machine was doing when a limit passed."""
    ones, fives, fifteens = os.getloadavg()
    return (f"load {ones:.1f} {fives:.1f} {fifteens:.1f} on {os.cpu_count()} cores; HYBRIDPAR_TEST_SLACK={SLACK:g} "
            "(raise it on a loaded machine)")


def cpu_seconds(pids) -> float:
    """The CPU time processes ``pids`` used so far (those gone count 0)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, tasks, results, paths) -> None:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world_size))
    sys.path[:0] = paths
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    while True:
        task = tasks.get()
        if task is None:
            break
        module, name, kwargs = task
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(**kwargs)))
        except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


def mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """A DeviceMesh over all ranks, cached per shape so tests do not create process groups again."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (shape, names)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


class Pool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world_size)]
        paths = [p for p in sys.path if p]
        self.procs = [
            ctx.Process(target=_worker, args=(r, self.world_size, port, self.tasks[r], self.results, paths),
                        daemon=True)
            for r in range(self.world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, timeout: float = TASK_TIMEOUT, **kwargs) -> list:
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.close()
            self._start()
        for q in self.tasks:
            q.put((fn.__module__, fn.__name__, kwargs))
        out: dict[int, object] = {}
        errors = []
        try:
            while len(out) + len(errors) < self.world_size:
                rank, ok, value = self._next(limit(timeout if not errors else AFTER_ERROR_TIMEOUT))
                if ok:
                    out[rank] = value
                else:
                    errors.append((rank, value))
        except queue.Empty:
            self.close()
            raise AssertionError(
                f"{fn.__name__}: ranks {sorted(set(range(self.world_size)) - set(out) - {r for r, _ in errors})} "
                f"did not answer within {limit(timeout):.0f}s and used no CPU time over the last of it (hang; "
                f"{load()}); errors so far: {errors}"
            ) from None
        if errors:
            rank, tb = min(errors)
            raise AssertionError(f"{fn.__name__} failed on rank {rank} of {self.world_size}:\n{tb}")
        return [out[r] for r in range(self.world_size)]

    def _next(self, seconds: float):
        """The next rank's answer within ``seconds``, or longer while the ranks compute (``SLOW_TIMES``); else
        ``queue.Empty``."""
        pids = [p.pid for p in self.procs]
        for _ in range(SLOW_TIMES):
            used = cpu_seconds(pids)
            try:
                return self.results.get(timeout=seconds)
            except queue.Empty:
                if cpu_seconds(pids) - used < 0.01 * seconds:  # the ranks wait for something that does not come
                    raise
        raise queue.Empty

    def close(self) -> None:
        for q in getattr(self, "tasks", []):
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self.procs = []

"""Multi-process test harness: a pool of gloo ranks started once per world size and reused by every
test, so a test costs its own work, not a process-group start-up.

``pool.run(fn, **kwargs)`` runs the module-level function ``fn`` on every rank (after
``torch.distributed`` is initialised) and returns the list of per-rank results. An exception on any
rank fails the test with that rank's traceback; a rank that does not answer within the timeout
(a hang) fails the test and the pool is restarted for the next one.

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

TASK_TIMEOUT = 60.0
AFTER_ERROR_TIMEOUT = 10.0  # once one rank failed, the others get this long before the pool restarts
_MESHES: dict = {}


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
                wait = timeout if not errors else AFTER_ERROR_TIMEOUT
                rank, ok, value = self.results.get(timeout=wait)
                if ok:
                    out[rank] = value
                else:
                    errors.append((rank, value))
        except queue.Empty:
            self.close()
            raise AssertionError(
                f"{fn.__name__}: ranks {sorted(set(range(self.world_size)) - set(out) - {r for r, _ in errors})} "
                f"did not answer within {timeout:.0f}s (hang); errors so far: {errors}"
            ) from None
        if errors:
            rank, tb = min(errors)
            raise AssertionError(f"{fn.__name__} failed on rank {rank} of {self.world_size}:\n{tb}")
        return [out[r] for r in range(self.world_size)]

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

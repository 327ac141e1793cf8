"""Starting workers: under ``torchrun`` (one or many nodes), or locally through PyTorch's elastic agent, which
restarts them after a failure (``max_restarts``). No process manager of our own: the local launcher is
PyTorch's ``LocalElasticAgent`` with its c10d rendezvous, its stores listening on loopback only (PyTorch's own
listen on every interface, and keep rendezvous state in them as pickles), and told of each failure.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

from hybridpar.mesh import accelerator_type

STORE_TIMEOUT_S = 60.0
STOP_GRACE_S = 120  # after SIGTERM / SIGINT, what the workers get to finish a step and a checkpoint


class Signalled(Exception):
    """The launcher received SIGTERM or SIGINT (number ``signal``): the agent passed it on to the workers and
    gave them ``STOP_GRACE_S`` to finish their step and write a checkpoint."""

    def __init__(self, signal: int):
        super().__init__(f"signal {signal}")
        self.signal = signal


class WorkersFailed(Exception):
    """Workers that failed (a signal, a crash) with no restart left: ``failures`` by global rank."""

    def __init__(self, failures: dict[int, ProcessFailure]):
        super().__init__(f"{len(failures)} worker(s) failed")
        self.failures = failures


def loopback_store() -> tuple[dist.TCPStore, socket.socket]:
    """A TCPStore server listening on 127.0.0.1 only, and the socket it listens on (keep it open)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    store = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=True, multi_tenant=True,
                          master_listen_fd=listener.fileno(), timeout=timedelta(seconds=STORE_TIMEOUT_S))
    return store, listener


class _LoopbackRendezvous(DynamicRendezvousHandler):
    """The c10d rendezvous whose store for the workers (shared with the agent) listens on loopback only."""

    def _create_tcp_store_server(self, master_addr, master_port) -> dist.TCPStore:
        store, self._listener = loopback_store()
        return store


class _Agent(LocalElasticAgent):
    """PyTorch's local agent, calling ``on_failure(failures, restarts_left)`` when its workers fail."""

    def __init__(self, *args, on_failure: Callable[[dict, int], None] | None, **kwargs):
        super().__init__(*args, **kwargs)
        self._on_failure = on_failure

    def _monitor_workers(self, worker_group) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.is_failed() and self._on_failure is not None:
            self._on_failure(result.failures, self._remaining_restarts)
        return result


def _loopback_interface() -> str:
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "lo")


def launch_local(entrypoint, args: tuple, nproc: int, *, max_restarts: int = 0,
                 on_failure: Callable[[dict, int], None] | None = None,
                 preload: tuple[str, ...] = ()) -> dict[int, object]:
    """Run ``entrypoint(*args)`` on ``nproc`` local workers; returns each local rank's return value. After a
    failure the agent stops the other workers and starts all of them again, up to ``max_restarts`` times
    (each attempt sees ``TORCHELASTIC_RESTART_COUNT``); then ``WorkersFailed``.

    With ``preload`` (module names), workers are forked from a server process that imported them (and the entry
    point's module) once, so neither the first start nor a restart pays for importing torch in every worker; the
    server keeps the environment of its start (the first launch of this process). Without, each is spawned."""
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # the workers' own connections: loopback too
        os.environ.setdefault(variable, _loopback_interface())
    run_id = f"hybridpar-{uuid.uuid4().hex[:8]}"
    store, listener = loopback_store()
    handler = _LoopbackRendezvous.from_backend(run_id, store, C10dRendezvousBackend(store, run_id), min_nodes=1,
                                               max_nodes=1, local_addr="127.0.0.1")
    spec = WorkerSpec(role="worker", local_world_size=nproc, entrypoint=entrypoint, args=tuple(args),
                      rdzv_handler=handler, max_restarts=max_restarts, monitor_interval=0.2, local_addr="127.0.0.1")
    if preload:
        multiprocessing.set_forkserver_preload([entrypoint.__module__, *preload])
    agent = _Agent(spec=spec, logs_specs=DefaultLogsSpecs(), start_method="forkserver" if preload else "spawn",
                   on_failure=on_failure, shutdown_timeout=STOP_GRACE_S)
    try:
        result = agent.run()
    except SignalException as err:
        raise Signalled(int(err.sigval)) from None
    finally:
        handler.shutdown()
        listener.close()
    if result.is_failed():
        raise WorkersFailed(result.failures)
    return result.return_values


def init_distributed(timeout_s: float = 300.0) -> None:
    """Join the process group that ``torchrun`` or ``launch_local`` set up, with PyTorch's backend for the
    accelerator at hand (gloo on CPU, NCCL on CUDA GPUs).

    Each restart attempt of the elastic agent gets its own store prefix, so restarted workers do not
    collide with the keys of the attempt before. On GPUs each worker takes GPU ``LOCAL_RANK`` of its node.
    """
    device = accelerator_type()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
        is_master=rank == 0 and not agent_store, timeout=timedelta(seconds=timeout_s),
    )
    store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    backend = dist.Backend.default_device_backend_map.get(device, "gloo")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))


def shutdown_distributed() -> None:
    """Leave the process group without the teardown deadlock of gloo.

    A gloo worker thread frees each finished request a moment after the caller saw it finish, and that
    needs the GIL; the group's destructor joins those threads while holding the GIL. The barrier ends
    every collective and the pause (which releases the GIL) lets the threads drop their requests first.
    """
    dist.barrier()
    time.sleep(0.1)
    dist.destroy_process_group()

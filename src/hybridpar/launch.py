"""Starting workers: under ``torchrun`` (one or many nodes), or locally through PyTorch's elastic agent, which
restarts them after a failure (``max_restarts``). No process manager of our own: the local launcher is
PyTorch's ``LocalElasticAgent`` with its c10d rendezvous, its stores listening on loopback only (PyTorch's own
listen on every interface, and keep rendezvous state in them as pickles), and told of each failure.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import select
import signal
import socket
import threading
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

from hybridpar.errors import RunStopped
from hybridpar.mesh import accelerator_type

STORE_TIMEOUT_S = 60.0
STOP_GRACE_S = 120  # after SIGTERM / SIGINT, what the workers get to finish a step and a checkpoint


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)  # what PyTorch's agent stops on


class Signalled(RunStopped):
    """The launcher received a stop signal (number ``signal``: SIGTERM, SIGINT, ...): the agent passed it on to
    the workers and gave them ``STOP_GRACE_S`` to finish their step and write a checkpoint."""

    def __init__(self, signal: int):
        super().__init__(f"stopped by {_name(signal)}", exit_code=128 + signal)
        self.signal = signal


class WorkersFailed(RunStopped):
    """Workers that failed (a signal, a crash) with no restart left: ``failures`` by global rank."""

    def __init__(self, failures: dict[int, ProcessFailure]):
        told = "; ".join(f"rank {rank} {_ended(failure)}" for rank, failure in sorted(failures.items()))
        super().__init__(f"{told}; nothing of this run was kept", exit_code=1)
        self.failures = failures


def _name(number: int) -> str:
    return signal.Signals(number).name


def _ended(failure: ProcessFailure) -> str:
    """``died (signal 9, SIGKILL)`` or ``exited with code 1``."""
    if failure.exitcode < 0:
        return f"died (signal {-failure.exitcode}, {failure.signal_name()})"
    return f"exited with code {failure.exitcode}"


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

    worker_store: dist.TCPStore | None = None

    def _create_tcp_store_server(self, master_addr, master_port) -> dist.TCPStore:
        self.worker_store, self._listener = loopback_store()
        return self.worker_store


def hang_key(attempt: int) -> str:
    """The store key where a rank's watchdog tells the first hang of restart attempt ``attempt``
    (``hybridpar.train.watchdog``)."""
    return f"hybridpar/attempt_{attempt}/hang"


class _Agent(LocalElasticAgent):
    """PyTorch's local agent, calling ``on_failure(failures, restarts_left, hang)`` when its workers fail (``hang``:
    what a watchdog told of the attempt's hang, or ``None``) and
    ``on_stop(signal)`` when a stop signal reaches it. From that signal on, the agent waits for its workers to
    finish their step and checkpoint (``STOP_GRACE_S``): a second signal (``timeout`` and SLURM send several)
    changes nothing, where PyTorch's agent would leave at once, its workers still writing; but a second Ctrl-C
    is a ``KeyboardInterrupt``, at once (the workers end with the launcher: ``die_with``)."""

    def __init__(self, *args, on_failure: Callable[[dict, int, str | None], None] | None,
                 on_stop: Callable[[int], None] | None, **kwargs):
        super().__init__(*args, **kwargs)
        self._on_failure, self._on_stop = on_failure, on_stop

    def _monitor_workers(self, worker_group) -> RunResult:
        ended = self._end_with_the_failed(worker_group)
        result = super()._monitor_workers(worker_group)
        if result.is_failed():
            result.failures = {r: f for r, f in result.failures.items() if r not in ended} or result.failures
            if self._on_failure is not None:
                self._on_failure(result.failures, self._remaining_restarts, self._hang())
        return result

    def _end_with_the_failed(self, worker_group) -> set[int]:
        """Once a worker failed, the others end at once (SIGKILL; their global ranks are returned): PyTorch's agent
        would send them SIGTERM and wait 30 s, in vain for a stopped one, and they have nothing left to save."""
        processes = getattr(getattr(self._pcontext, "_pc", None), "processes", None)
        if not processes or not any(p.exitcode not in (None, 0) for p in processes):
            return set()
        ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
        ended = set()
        for local_rank, process in enumerate(processes):
            if process.exitcode is None:
                process.kill()
                ended.add(ranks[local_rank])
        for process in processes:
            process.join(STOP_GRACE_S)
        return ended

    def _hang(self) -> str | None:
        key = hang_key(self._worker_group.spec.max_restarts - self._remaining_restarts)
        store = self._worker_group.spec.rdzv_handler.worker_store  # the store the workers share
        try:
            return store.get(key).decode() if store is not None and store.check([key]) else None
        except Exception:  # noqa: BLE001 - a store that cannot tell: the failure is told without it
            return None

    def _stop_workers(self, worker_group, *args, **kwargs) -> None:
        """The workers of a failed attempt end at once (SIGKILL): a stopped one would not see SIGTERM, and none
        has anything left to save (the run goes on from its newest checkpoint)."""
        self._shutdown(signal.SIGKILL, timeout=STOP_GRACE_S)

    def _invoke_run(self, role: str = "default") -> RunResult:
        try:
            return super()._invoke_run(role)
        except SignalException as err:  # the agent's run shuts the workers down next, within its grace
            for number in STOP_SIGNALS:
                signal.signal(number, signal.default_int_handler if number == signal.SIGINT else signal.SIG_IGN)
            if self._on_stop is not None:
                self._on_stop(int(err.sigval))
            raise


def die_with(pid: int) -> None:
    """End this process (SIGKILL) as soon as process ``pid``, its launcher, ends, whatever ended it: the kernel's
    OOM killer sends SIGKILL, which nothing can catch or pass on. A worker is forked by a fork server, not by its
    launcher, so the kernel's parent-death signal cannot tell; a thread waits on the launcher's pidfd instead
    (its pid polled where there are no pidfds). Its last intact checkpoint stays: a checkpoint's manifest comes last."""
    def end() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def watch(fd: int | None) -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while _alive(pid):
                time.sleep(0.5)
        end()

    try:
        fd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
    except ProcessLookupError:
        end()
    if fd is None and not _alive(pid):
        end()
    threading.Thread(target=watch, args=(fd,), name="hybridpar-lifeline", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _supervised(launcher: int, entrypoint, *args):
    """A local worker: ``entrypoint(*args)``, for as long as its launcher lives (``die_with``)."""
    die_with(launcher)
    return entrypoint(*args)


def _loopback_interface() -> str:
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "lo")


def _quiet_agent() -> None:
    """PyTorch's agent logs each failure, signal and shutdown in lines of its own: the callbacks tell them."""
    for name in list(logging.root.manager.loggerDict):  # each of PyTorch's agent modules sets its own level
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def launch_local(entrypoint, args: tuple, nproc: int, *, max_restarts: int = 0,
                 on_failure: Callable[[dict, int, str | None], None] | None = None,
                 on_stop: Callable[[int], None] | None = None,
                 preload: tuple[str, ...] = ()) -> dict[int, object]:
    """Run ``entrypoint(*args)`` on ``nproc`` local workers; returns each local rank's return value. After a
    failure the agent stops the other workers and starts all of them again, up to ``max_restarts`` times
    (each attempt sees ``TORCHELASTIC_RESTART_COUNT``); then ``WorkersFailed``. A stop signal (SIGTERM, Ctrl-C)
    is passed on to the workers, told to ``on_stop`` and waited out (``STOP_GRACE_S``); then ``Signalled``. The
    workers end with this process, however it ends (``die_with``).

    With ``preload`` (module names), workers are forked from a server process that imported them (and the entry
    point's module) once, so neither the first start nor a restart pays for importing torch in every worker; the
    server keeps the environment of its start (the first launch of this process). Without, each is spawned."""
    _quiet_agent()
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # the workers' own connections: loopback too
        os.environ.setdefault(variable, _loopback_interface())
    run_id = f"hybridpar-{uuid.uuid4().hex[:8]}"
    store, listener = loopback_store()
    handler = _LoopbackRendezvous.from_backend(run_id, store, C10dRendezvousBackend(store, run_id), min_nodes=1,
                                               max_nodes=1, local_addr="127.0.0.1")
    spec = WorkerSpec(role="worker", local_world_size=nproc, entrypoint=_supervised,
                      args=(os.getpid(), entrypoint, *args), rdzv_handler=handler, max_restarts=max_restarts,
                      monitor_interval=0.2, local_addr="127.0.0.1")
    if preload:
        multiprocessing.set_forkserver_preload([__name__, entrypoint.__module__, *preload])
    agent = _Agent(spec=spec, logs_specs=DefaultLogsSpecs(), start_method="forkserver" if preload else "spawn",
                   on_failure=on_failure, on_stop=on_stop, shutdown_timeout=STOP_GRACE_S)
    handlers = {number: signal.getsignal(number) for number in STOP_SIGNALS}  # the agent installs its own
    try:
        result = agent.run()
    except SignalException as err:
        raise Signalled(int(err.sigval)) from None
    finally:
        handler.shutdown()
        listener.close()
        if threading.current_thread() is threading.main_thread():
            for number, saved in handlers.items():
                signal.signal(number, saved)
    if result.is_failed():
        raise WorkersFailed(result.failures)
    return result.return_values


PROCESS_GROUP_TIMEOUT_S = 300.0  # a collective or the store waits this long before it fails


def init_distributed(timeout_s: float = PROCESS_GROUP_TIMEOUT_S) -> None:
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

"""Starting workers: under ``torchrun`` (one or many nodes), or locally through PyTorch's elastic agent
(``elastic_launch``), with the rendezvous bound to loopback. No process manager of our own."""

from __future__ import annotations

import os
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from hybridpar.mesh import accelerator_type


def launch_local(entrypoint, args: tuple, nproc: int) -> dict[int, object]:
    """Run ``entrypoint(*args)`` on ``nproc`` local workers; returns each local rank's return value."""
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"hybridpar-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        max_restarts=0,
        monitor_interval=0.2,
        local_addr="127.0.0.1",
    )
    return elastic_launch(config, entrypoint)(*args)


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

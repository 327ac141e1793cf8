"""Data parallelism over the ``dp x spatial`` ranks with PyTorch's DDP.

Under spatial parallelism every rank of a spatial group computes the same global loss, and autograd
through the halo exchanges and collectives gives each rank ``P`` times its share of each gradient
(see ``hybridpar.spatial.collectives``). Averaging over the ``P`` spatial ranks therefore *sums* the
true shares, and averaging over the ``dp`` replicas averages the per-replica gradients: one DDP
all-reduce-mean over the flattened ``dp x spatial`` group is exactly one process on the global
batch (for equal per-replica batches and a mean loss).

Each bucket's all-reduce is timed (``BucketClock``, read by ``hybridpar.train.links``): the gradient exchange's
share of a step, measured apart from the backward it overlaps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from hybridpar.mesh import flat_group, flat_mesh
from hybridpar.parallel.grads import mean_of_each_gradient


@dataclass
class BucketClock:
    """The gradient all-reduces of one DDP, timed: ``ranks``, its group's global ranks; ``seconds``, per bucket
    index, each all-reduce's seconds since ``take``, counted from the later of its start and the end of the
    all-reduce before (a process group runs them one after the other), so the backward it overlaps is left out;
    ``nbytes``, per bucket index, its bytes; both kept while ``timed``. ``hold``: seconds to hold a bucket of so
    many bytes before its all-reduce (an emulated slow link, ``hybridpar.train.faults``)."""

    ranks: tuple[int, ...]
    seconds: dict[int, list[float]] = field(default_factory=dict)
    nbytes: dict[int, int] = field(default_factory=dict)
    timed: bool = False
    hold: Callable[[int], float] | None = None
    _last_end: float = 0.0

    def take(self) -> tuple[dict[int, list[float]], dict[int, int]]:
        """The seconds and bytes per bucket since the last call, cleared."""
        seconds, self.seconds = self.seconds, {}
        return seconds, dict(self.nbytes)

    def _record(self, index: int, begin: float, nbytes: int) -> None:
        end = time.perf_counter()
        if self.timed:
            self.seconds.setdefault(index, []).append(end - max(begin, self._last_end))
            self.nbytes[index] = nbytes
        self._last_end = end


def _timed(state, bucket):  # unannotated: DDP compares a hook's annotations with its types
    """DDP's communication hook: ``state``'s hook on ``bucket`` (``(clock, hook, its state)``), timed."""
    clock, hook, hook_state = state
    begin = time.perf_counter()
    nbytes = bucket.buffer().numel() * bucket.buffer().element_size()
    if clock.hold is not None:
        time.sleep(clock.hold(nbytes))
    index = bucket.index()

    def done(future):
        clock._record(index, begin, nbytes)
        return future.value()

    return hook(hook_state, bucket).then(done)


def bucket_clock(module: nn.Module) -> BucketClock | None:
    """The ``BucketClock`` of a module ``data_parallel`` wrapped in DDP (``None``: another module)."""
    return getattr(module, "_hp_clock", None)


def data_parallel(module: nn.Module, mesh: DeviceMesh, *, axes: tuple[str, ...] = ("dp", "spatial"),
                  kind: str = "ddp", **kwargs):
    """Data parallelism over the ``axes`` of ``mesh``, flattened: ``kind="ddp"`` wraps the module in
    DDP (and returns the wrapper), over more than two ranks each gradient averaged on its own
    (``grads.mean_of_each_gradient``: the same order of sums in every step, whenever the DDP was built), each
    bucket's all-reduce timed (``bucket_clock``);
    ``kind="fsdp"`` shards it in place with FSDP2 ``fully_shard`` (parameters become DTensors sharded over
    those ranks; gradients are reduce-scattered)."""
    if kind == "ddp":
        group = flat_group(mesh, tuple(axes))
        ddp = DistributedDataParallel(module, process_group=group, **kwargs)
        # a sum of two is the same in either order: DDP's buckets (its own hook: halved, then summed) are cheaper
        hook = mean_of_each_gradient if dist.get_world_size(group) > 2 else allreduce_hook
        ddp._hp_clock = BucketClock(tuple(dist.get_process_group_ranks(group)))
        ddp.register_comm_hook((ddp._hp_clock, hook, group), _timed)
        return ddp
    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard  # imported here: it costs ~44 MiB per process

        return fully_shard(module, mesh=flat_mesh(mesh, tuple(axes)), **kwargs)
    raise ValueError(f"data_parallel kind={kind!r}: use 'ddp' or 'fsdp'")

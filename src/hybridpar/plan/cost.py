"""The cost model: small named functions of bytes, FLOPs and a ``ClusterSpec``; no hidden coefficients.

Times are seconds, sizes bytes. Collectives move the bytes of the ring algorithm and pay the latency of
the better of a ring (``n - 1`` steps) and a tree or recursive doubling (``log2 n`` steps), as NCCL and
gloo choose by size, over the group's link (the inter-node link once a group spans nodes); ``n`` ranks,
``bytes`` the full (unsharded) tensor, ``steps = min(n - 1, ceil(log2 n))``::

    all_reduce      2 · steps · latency + 2(n-1)/n · bytes / bus_bandwidth
    all_gather      steps · latency     + (n-1)/n  · bytes / bus_bandwidth     (reduce_scatter alike)
    send            latency + bytes / bandwidth

Where ranks meet after computing apart -- a layer's communication in each pass, a pipeline send, the
gradient synchronisation -- they also wait ``Link.sync_wait`` (0 unless calibrate measured it): the ranks
arrive at different moments, and the communication of one pass waits once (its later operations follow
at once; a split normalisation computes between its two collectives and meets twice, ``options._meetings``).

Compute follows the roofline: a layer takes the longer of its FLOPs at the achievable rate of its
kind and its bytes at the memory rate of its op (``layer_times``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridpar.ir.types import BUCKET_BYTES
from hybridpar.plan.cluster import ClusterSpec, Link

CONV_KINDS = frozenset({"conv", "conv_transpose"})
MATMUL_KINDS = frozenset({"linear", "attention", "embedding"})
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 1}  # state tensors per parameter
OPTIMIZER_TRAFFIC = {"adam": 7, "adamw": 7, "sgd": 5}  # tensors read + written per step: p, g, states in; p, states out
MEASURED_KERNEL = 3  # the kernel width of calibrate's conv rates


@dataclass(frozen=True)
class Group:
    """A process group of ``size`` ranks along one or more mesh axes, and the link it talks over."""

    size: int
    link: Link

    @staticmethod
    def of(cluster: ClusterSpec, size: int, stride: int) -> Group:
        """The group of ``size`` ranks ``stride`` apart (ranks fill a node before the next)."""
        return Group(size, cluster.link(size, spans_nodes=size > 1 and stride * size > cluster.devices_per_node))


def compute_time(flops: float, bytes_moved: float, kind: str, cluster: ClusterSpec, dtype: str) -> float:
    """Roofline time of one layer's forward at the cluster's rate for its kind and its memory bandwidth."""
    if kind in CONV_KINDS:
        rate = cluster.flops(dtype, "conv")
    elif kind in MATMUL_KINDS:
        rate = cluster.flops(dtype, "matmul")
    else:
        rate = 0.0
    flop_time = flops / rate if rate and flops else 0.0
    return max(flop_time, bytes_moved / cluster.memory_bandwidth)


def layer_times(kind: str, op: str, flops: float, bytes_moved: float, cluster: ClusterSpec, dtype: str, *,
                has_weight: bool, input_grad: bool, channels: tuple[int, int] = (0, 0), positions: float = 0,
                work: int = 0, kernel: tuple[int, ...] = ()) -> tuple[float, float]:
    """Forward and backward time of one layer on one device.

    - Convolutions: FLOPs at the cluster's rates for ``channels`` (in, out) and ``positions`` (output
      ``N·D·H·W``) -- forward, input gradient (if the input needs one), weight gradient -- each at least
      its bytes at the op's memory rate, except where the rates were measured on the conv's own kind of
      kernel (``measured_kernel``: they include its memory traffic, and the op's rows, from a 1x1 conv,
      would floor a 3x3x3 conv well above its time); ``work`` (N*C*D*H of the input) picks PyTorch's slow
      CPU kernel.
    - Matmul kinds: the roofline; the backward computes the input and the weight gradient, about a
      forward each (attention: the gradients of Q, K and V, about twice the forward).
    - Memory-bound layers: their bytes at the op's measured rate (``ClusterSpec.op_rate``), forward and
      backward; no backward when nothing before them needs a gradient.
    """
    if kind in MATMUL_KINDS:
        forward = compute_time(flops, bytes_moved, kind, cluster, dtype)
        grads = int(input_grad) + int(has_weight) if has_weight else 2 * int(input_grad)
        return forward, grads * forward
    forward_bw, backward_bw = cluster.op_rate(op, bytes_moved)
    memory, backward_memory = bytes_moved / forward_bw, bytes_moved / backward_bw
    if kind in CONV_KINDS:
        forward_rate, input_rate, weight_rate = cluster.conv_flops(dtype, *channels, positions, work)
        if measured_kernel(kind, kernel, cluster, dtype):
            memory = backward_memory = 0.0
        backward = (max(flops / input_rate, backward_memory) if input_grad else 0.0) + \
            (max(flops / weight_rate, backward_memory) if has_weight else 0.0)
        return max(flops / forward_rate, memory), backward
    return memory, backward_memory if input_grad or has_weight else 0.0


def measured_kernel(kind: str, kernel: tuple[int, ...], cluster: ClusterSpec, dtype: str) -> bool:
    """Whether a conv's rates were measured on its kind of kernel: calibrate's ``conv_rates`` (and
    ``slow_conv_rates``) of ``dtype`` time convs ``MEASURED_KERNEL`` wide in every dim."""
    return kind == "conv" and bool(kernel) and all(k == MEASURED_KERNEL for k in kernel) \
        and cluster.has_conv_rates(dtype)


def send_time(num_bytes: float, link: Link) -> float:
    return link.latency + num_bytes / link.bandwidth if num_bytes else 0.0


def collective_steps(n: int) -> int:
    """Latency-bound steps of a collective over ``n`` ranks: a ring's ``n - 1`` or a tree's ``log2 n``."""
    return min(n - 1, math.ceil(math.log2(n))) if n > 1 else 0


def all_reduce_time(num_bytes: float, group: Group) -> float:
    n = group.size
    if n == 1 or not num_bytes:
        return 0.0
    return 2 * collective_steps(n) * group.link.step_latency + 2 * (n - 1) / n * num_bytes / group.link.bus_bandwidth


def all_gather_time(num_bytes: float, group: Group) -> float:
    """Gather ``num_bytes`` in all (each rank holds ``num_bytes / n``): half a ring all-reduce, at the
    link's all-gather rates."""
    return _half_ring(num_bytes, group, "all_gather")


def reduce_scatter_time(num_bytes: float, group: Group) -> float:
    """Sum ``num_bytes`` and leave ``num_bytes / n`` of the sum on each rank: half a ring all-reduce, at the
    link's reduce-scatter rates."""
    return _half_ring(num_bytes, group, "reduce_scatter")


def _half_ring(num_bytes: float, group: Group, kind: str) -> float:
    n = group.size
    if n == 1 or not num_bytes:
        return 0.0
    latency, bandwidth = group.link.collective(kind)
    return collective_steps(n) * latency + (n - 1) / n * num_bytes / bandwidth


def halo_exchange_time(halo_bytes: tuple[float, ...], link: Link) -> float:
    """One exchange per split dim, one after the other; both sides of a dim travel at once."""
    return sum(send_time(b, link) for b in halo_bytes if b)


def exposed_halo_time(halo: float, interior_compute: float, overlap: bool) -> float:
    """What a halo exchange adds to a layer: all of it, or what the slab's interior conv cannot hide."""
    return max(0.0, halo - interior_compute) if overlap else halo


def gradient_sync_time(grad_bytes: float, group: Group, backward_time: float, sharding: int) -> float:
    """Exposed gradient communication of one step. Gradients are reduced in buckets while backward runs
    (all-reduced by DDP, ``sharding`` 0; reduce-scattered when sharded, 1-3): what exceeds the backward,
    and the last bucket, show. ZeRO-1 and -2 then all-gather the updated parameters after the step, in the
    open; FSDP (3) gathers them block by block in the next step instead (``fsdp_gather_time``)."""
    if group.size == 1 or not grad_bytes:
        return 0.0
    reduce = all_reduce_time if sharding == 0 else reduce_scatter_time
    wait = group.link.sync_wait
    last_bucket = reduce(min(grad_bytes, BUCKET_BYTES), group)
    exposed = max(reduce(grad_bytes, group) - backward_time, 0.0) + last_bucket + wait
    return exposed + (all_gather_time(grad_bytes, group) if sharding in (1, 2) else 0.0)


def fsdp_gather_time(param_bytes: float, group: Group, gathers: int = 1) -> float:
    """FSDP (sharding 3) gathers ``param_bytes`` of parameters, held by ``gathers`` separately wrapped
    modules (one all-gather each), before forward and again before backward; the ranks meet at each."""
    if group.size == 1 or not param_bytes:
        return 0.0
    latency, _ = group.link.collective("all_gather")
    per_gather = collective_steps(group.size) * latency + group.link.sync_wait
    return 2 * (all_gather_time(param_bytes, group) + (gathers - 1) * per_gather + group.link.sync_wait)


def pipeline_time(stage_times: list[float], num_micro_batches: int) -> float:
    """One step of a 1F1B (or GPipe) schedule: the first micro-batch crosses every stage, the others
    follow at the pace of the slowest stage."""
    return (num_micro_batches - 1) * max(stage_times) + sum(stage_times)


def interleaved_pipeline_time(stage_times: list[float], num_micro_batches: int, pp: int) -> float:
    """One step of interleaved 1F1B: ``v = len(stage_times) / pp`` stages per rank (stage ``k`` on rank
    ``k % pp``), so each micro-batch visits every rank ``v`` times; the busiest rank works
    ``m * T`` (``T``: its stages' time per micro-batch) plus a bubble ``v`` times smaller than 1F1B's,
    ``(pp - 1) * T / v`` (Narayanan et al. 2021)."""
    v = len(stage_times) // pp
    busiest = max(sum(stage_times[r::pp]) for r in range(pp))
    return (num_micro_batches + (pp - 1) / v) * busiest


def micro_batches_in_flight(stage: int, num_stages: int, num_micro_batches: int, schedule: str = "1f1b") -> int:
    """Activations stage ``stage`` holds at its peak: under GPipe all micro-batches' (every forward runs
    before the first backward); under 1F1B (and per stage of interleaved 1F1B) one per stage still to run
    forward."""
    if schedule == "gpipe":
        return num_micro_batches
    return min(num_micro_batches, num_stages - stage)


def combined(memories: list[Memory]) -> Memory:
    """The memory of one device that holds several stages (interleaved 1F1B): the sums of what they keep,
    the largest of what is transient (workspace) and the reserve once."""
    kept = (sum(getattr(m, f) for m in memories) for f in ("parameters", "gradients", "optimizer", "activations"))
    return Memory(*kept, max(m.workspace for m in memories), max(m.reserved for m in memories))


def optimizer_step_time(param_bytes: float, optimizer: str, cluster: ClusterSpec) -> float:
    """The update of ``param_bytes`` of parameters: memory-bound, every tensor of it read or written once."""
    return OPTIMIZER_TRAFFIC[optimizer] * param_bytes / cluster.memory_bandwidth


def optimizer_state_bytes(param_bytes: float, optimizer: str) -> float:
    return OPTIMIZER_STATES[optimizer] * param_bytes


@dataclass(frozen=True)
class Memory:
    """Bytes per device at the peak of a step, by kind."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    workspace: float
    reserved: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.workspace + self.reserved

    def as_dict(self) -> dict[str, float]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "workspace": self.workspace, "reserved": self.reserved,
                "total": self.total}


def model_state_memory(param_bytes: float, sharding: int, shards: int, optimizer: str) -> tuple[float, float, float]:
    """Parameters, gradients and optimizer state per device: ZeRO level ``sharding`` over ``shards`` ranks
    (1: optimizer state sharded, 2: and gradients, 3: and parameters, as FSDP)."""
    params = param_bytes / (shards if sharding >= 3 else 1)
    grads = param_bytes / (shards if sharding >= 2 else 1)
    state = optimizer_state_bytes(param_bytes, optimizer) / (shards if sharding >= 1 else 1)
    return params, grads, state


def checkpoint_interval(save_time: float, mtbf: float) -> float:
    """Seconds of training between checkpoints that lose the least time to saving and to redoing work after a
    failure: Daly's higher-order estimate (J. T. Daly, "A higher order estimate of the optimum checkpoint
    interval for restart dumps", FGCS 22, 2006), which refines Young's ``sqrt(2 * save_time * mtbf)`` (1974);
    ``mtbf`` is the whole job's mean time between failures. ``mtbf`` itself where saving takes half of it or
    more."""
    if save_time >= 2 * mtbf:
        return mtbf
    ratio = save_time / (2 * mtbf)
    return math.sqrt(2 * save_time * mtbf) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - save_time

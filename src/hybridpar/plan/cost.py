"""The cost model: small named functions of bytes, FLOPs and a ``ClusterSpec``; no hidden coefficients.

Times are seconds, sizes bytes. Collectives move the bytes of the ring algorithm and pay the latency of
the better of a ring (``n - 1`` steps) and a tree or recursive doubling (``log2 n`` steps), as NCCL and
gloo choose by size, over the group's link (the inter-node link once a group spans nodes); ``n`` ranks,
``bytes`` the full (unsharded) tensor, ``steps = min(n - 1, ceil(log2 n))``::

    all_reduce      2 · steps · latency + 2(n-1)/n · bytes / bus_bandwidth
    all_gather      steps · latency     + (n-1)/n  · bytes / bus_bandwidth     (reduce_scatter alike)
    send            latency + bytes / bandwidth

Compute follows the roofline: a layer takes the longer of its FLOPs at the achievable rate of its
kind (``conv`` or ``matmul``) and its bytes at the memory bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridpar.plan.cluster import ClusterSpec, Link

CONV_KINDS = frozenset({"conv", "conv_transpose"})
MATMUL_KINDS = frozenset({"linear", "attention", "embedding"})
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 1}  # state tensors per parameter
OPTIMIZER_TRAFFIC = {"adam": 7, "adamw": 7, "sgd": 5}  # tensors read + written per step: p, g, states in; p, states out
BUCKET_BYTES = 25 * 2**20  # DDP's default gradient bucket: the all-reduce left after backward ends


@dataclass(frozen=True)
class Group:
    """A process group of ``size`` ranks along one or more mesh axes, and the link it talks over."""

    size: int
    link: Link

    @staticmethod
    def of(cluster: ClusterSpec, size: int, stride: int) -> "Group":
        """The group of ``size`` ranks ``stride`` apart (ranks fill a node before the next)."""
        return Group(size, cluster.link(size, spans_nodes=size > 1 and stride * size > cluster.devices_per_node))


def compute_time(flops: float, bytes_moved: float, kind: str, cluster: ClusterSpec, dtype: str) -> float:
    """Roofline time of one layer's forward."""
    if kind in CONV_KINDS:
        rate = cluster.flops(dtype, "conv")
    elif kind in MATMUL_KINDS:
        rate = cluster.flops(dtype, "matmul")
    else:
        rate = 0.0
    flop_time = flops / rate if rate and flops else 0.0
    return max(flop_time, bytes_moved / cluster.memory_bandwidth)


def layer_times(kind: str, flops: float, bytes_moved: float, cluster: ClusterSpec, dtype: str, *,
                has_weight: bool, input_grad: bool, in_channels: int, work: int = 0) -> tuple[float, float]:
    """Forward and backward time of one layer. The backward computes the input gradient (if the input needs
    one) and the weight gradient (if it has weights): about the forward's work each. Convolutions use the
    cluster's rates for their input channels and ``work`` (N*C*D*H of the input: ``ClusterSpec.conv_flops``)."""
    grads = int(input_grad) + int(has_weight)
    if kind in CONV_KINDS:
        forward_rate, backward_rate, weight_rate = cluster.conv_flops(dtype, in_channels, work)
        rate = backward_rate if input_grad else weight_rate
        memory = bytes_moved / cluster.memory_bandwidth
        return max(flops / forward_rate, memory), max(grads * flops / rate, grads * memory) if grads else 0.0
    forward = compute_time(flops, bytes_moved, kind, cluster, dtype)
    if has_weight or kind in MATMUL_KINDS:  # attention: the gradients of Q, K and V take about twice the forward
        return forward, (grads if has_weight else 2 * int(input_grad)) * forward
    return forward, forward if input_grad else 0.0  # memory-bound: read the gradient and what was saved, write one


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
    """Gather ``num_bytes`` in all (each rank holds ``num_bytes / n``); a reduce-scatter costs the same."""
    n = group.size
    if n == 1 or not num_bytes:
        return 0.0
    return collective_steps(n) * group.link.step_latency + (n - 1) / n * num_bytes / group.link.bus_bandwidth


reduce_scatter_time = all_gather_time


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
    open; FSDP (3) gathers them layer by layer in the next step instead (``fsdp_gather_time``)."""
    if group.size == 1 or not grad_bytes:
        return 0.0
    reduce = all_reduce_time if sharding == 0 else reduce_scatter_time
    last_bucket = reduce(min(grad_bytes, BUCKET_BYTES), group)
    exposed = max(reduce(grad_bytes, group) - backward_time, 0.0) + last_bucket
    return exposed + (all_gather_time(grad_bytes, group) if sharding in (1, 2) else 0.0)


def fsdp_gather_time(param_bytes: float, group: Group) -> float:
    """FSDP (sharding 3) gathers each layer's parameters before forward and again before backward."""
    return 2 * all_gather_time(param_bytes, group)


def pipeline_time(stage_times: list[float], num_micro_batches: int) -> float:
    """One step of a 1F1B (or GPipe) schedule: the first micro-batch crosses every stage, the others
    follow at the pace of the slowest stage."""
    return (num_micro_batches - 1) * max(stage_times) + sum(stage_times)


def micro_batches_in_flight(stage: int, num_stages: int, num_micro_batches: int) -> int:
    """Activations stage ``stage`` holds at its peak under 1F1B: one per stage still to run forward."""
    return min(num_micro_batches, num_stages - stage)


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

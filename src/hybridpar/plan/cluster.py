"""What the planner knows of a cluster: devices, memory, peak FLOP/s, links. Pure: no I/O, no torch.

A :class:`ClusterSpec` describes identical nodes of identical devices. Numbers are in SI base units
(bytes, bytes/s, seconds, FLOP/s); the TOML form in human units is read and written by ``plan/io.py``.
``PRESETS`` are one-node data-sheet descriptions; ``spec.with_devices(n)`` scales one to ``n`` devices.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace

from hybridpar.errors import ClusterError
from hybridpar.plan.rates import DTYPES, ConvRate, OpRate, check_count, check_positive, interpolate, log2_weights, log2s

KINDS = ("matmul", "conv")  # compute kinds with their own efficiency; pointwise ops use memory_bandwidth

GiB = 2**30
GB = 1e9
# devices of one cluster: about ten times the largest machines built (some 10^5 GPUs); more is a mistake in a file
# or a flag (and would take the search past any sane time)
MAX_DEVICES = 2**20
TFLOPS = 1e12
US = 1e-6


class FrozenMap(Mapping):
    """A read-only, hashable mapping (so a ClusterSpec can be a dict key or a set member)."""

    def __init__(self, items: Mapping):
        self._items = dict(items)

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self) -> Iterator:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(frozenset(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)


OPTIONAL_RATES = ("collective_bandwidth", "collective_latency", "all_gather_bandwidth", "all_gather_latency",
                  "reduce_scatter_bandwidth", "reduce_scatter_latency")


@dataclass(frozen=True)
class Link:
    """A link as seen by one device: point-to-point and (optionally measured) collective performance."""

    bandwidth: float  # bytes/s, point-to-point, one direction, per device
    latency: float  # seconds per message
    collective_bandwidth: float | None = None  # bytes/s all-reduce bus bandwidth (nccl-tests); None: bandwidth
    collective_latency: float | None = None  # seconds per algorithm step of a collective; None: latency
    # seconds a synchronising operation (a send, a collective) waits beyond its latency when the ranks come to
    # it from computing: they arrive apart (scheduling, shared cores); measured by calibrate, else 0
    sync_wait: float = 0.0
    # an all-gather's and a reduce-scatter's own bus bandwidth (``(n-1)/n * bytes / time``) and step latency,
    # where measured (gloo's reduce-scatter takes longer than an all-reduce of the same bytes); None: the
    # all-reduce's (a ring's halves)
    all_gather_bandwidth: float | None = None
    all_gather_latency: float | None = None
    reduce_scatter_bandwidth: float | None = None
    reduce_scatter_latency: float | None = None

    def __post_init__(self):
        for field in ("bandwidth", "latency", *OPTIONAL_RATES):
            value = getattr(self, field)
            if value is not None or field in ("bandwidth", "latency"):
                check_positive(f"Link.{field}", value)
        wait = self.sync_wait
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not (math.isfinite(wait) and wait >= 0):
            raise ClusterError(f"Link.sync_wait = {wait!r}: must be a finite number >= 0 (seconds)")

    @property
    def bus_bandwidth(self) -> float:
        """Bytes/s of the ring model ``2(n-1)/n * bytes / bus_bandwidth`` (all-reduce, nccl-tests busbw)."""
        return self.bandwidth if self.collective_bandwidth is None else self.collective_bandwidth

    @property
    def step_latency(self) -> float:
        """Seconds per algorithm step of a collective (a ring all-reduce has ``2(n-1)`` steps)."""
        return self.latency if self.collective_latency is None else self.collective_latency

    def collective(self, kind: str) -> tuple[float, float]:
        """``(step latency, bus bandwidth)`` of ``"all_reduce"``, ``"all_gather"`` or ``"reduce_scatter"``."""
        if kind == "all_reduce":
            return self.step_latency, self.bus_bandwidth
        latency, bandwidth = getattr(self, f"{kind}_latency"), getattr(self, f"{kind}_bandwidth")
        return (self.step_latency if latency is None else latency,
                self.bus_bandwidth if bandwidth is None else bandwidth)


@dataclass(frozen=True)
class ClusterSpec:
    """``num_nodes`` identical nodes of ``devices_per_node`` identical devices."""

    name: str
    num_nodes: int
    devices_per_node: int
    device_memory: float  # bytes per device
    reserved_memory: float  # bytes per device taken before the model (runtime context, comm buffers, slack)
    peak_flops: Mapping[str, float]  # FLOP/s per dtype (dense), keys among DTYPES
    efficiency: Mapping[str, float]  # achievable fraction of peak per compute kind, keys KINDS, each in (0, 1]
    memory_bandwidth: float  # bytes/s of device memory (pointwise ops, normalisation, pooling)
    intra_node: Link
    inter_node: Link
    # Optional, measured by `hybridpar calibrate`: conv FLOP/s on a grid of (in channels, out channels, output
    # positions) per dtype (on CPUs thin convs run at a tenth of a wide one's rate, and a weight gradient from
    # few channels slower still), and the bytes/s of memory-bound layers by op (pooling, normalisation, ...).
    # Without rows: efficiency["conv"] for every conv, memory_bandwidth for every memory-bound layer.
    conv_rates: tuple[ConvRate, ...] = ()
    op_rates: tuple[OpRate, ...] = ()
    # Optional, CPUs: PyTorch runs a conv of one sample with a kernel up to 3 wide on its fast (oneDNN) kernel only
    # when N*C*D*H of its input exceeds `fast_conv_min`; below, on a slower one, whose rates on the same grid
    # axes are `slow_conv_rates` (calibrate measures them; given together).
    fast_conv_min: int = 0
    slow_conv_rates: tuple[ConvRate, ...] = ()

    def __post_init__(self):
        owner = f"ClusterSpec {self.name!r}"
        for field, kind in (("conv_rates", ConvRate), ("slow_conv_rates", ConvRate), ("op_rates", OpRate)):
            rows = tuple(getattr(self, field))
            if not all(isinstance(row, kind) for row in rows):
                raise ClusterError(f"{owner}: {field} holds {rows!r}: give {kind.__name__} rows")
            object.__setattr__(self, field, tuple(sorted(rows)))
        # lookup tables of log rates, built once (the search prices every layer of every candidate with them)
        object.__setattr__(self, "_conv_tables", self._conv_grids(owner, "conv_rates"))
        object.__setattr__(self, "_slow_conv_tables", self._conv_grids(owner, "slow_conv_rates"))
        object.__setattr__(self, "_op_tables", self._op_curves(owner))
        for field in ("peak_flops", "efficiency"):
            if not isinstance(getattr(self, field), Mapping):
                raise ClusterError(f"{owner}: {field} = {getattr(self, field)!r}: must be a mapping, e.g. a dict")
            object.__setattr__(self, field, FrozenMap(getattr(self, field)))
        if not isinstance(self.name, str) or not self.name:
            raise ClusterError(f"ClusterSpec.name = {self.name!r}: give a non-empty name, e.g. 'a100-80'")
        for field in ("num_nodes", "devices_per_node"):
            check_count(f"{owner}: {field}", getattr(self, field))
        if self.num_devices > MAX_DEVICES:
            raise ClusterError(f"{owner}: {self.num_nodes:,} nodes of {self.devices_per_node:,} devices make "
                               f"{self.num_devices:,} devices, more than {MAX_DEVICES:,} (ten times the largest "
                               "machines built); give the nodes and devices_per_node of the cluster you mean")
        for field in ("device_memory", "memory_bandwidth"):
            check_positive(f"{owner}: {field}", getattr(self, field))
        self._check_reserved(owner)
        self._check_flops(owner)
        if isinstance(self.fast_conv_min, bool) or not isinstance(self.fast_conv_min, int) or self.fast_conv_min < 0:
            raise ClusterError(f"{owner}: fast_conv_min = {self.fast_conv_min!r}: must be a whole number >= 0")
        if bool(self.fast_conv_min) != bool(self.slow_conv_rates):
            given, lacking = (("fast_conv_min", "slow_conv_rates") if self.fast_conv_min else
                              ("slow_conv_rates", "fast_conv_min"))
            raise ClusterError(f"{owner}: {given} is given without {lacking}; give both (hybridpar calibrate measures "
                               "them) or neither")
        for field in ("intra_node", "inter_node"):
            if not isinstance(getattr(self, field), Link):
                raise ClusterError(f"{owner}: {field} = {getattr(self, field)!r}: must be a Link")

    def _conv_grids(self, owner: str, field: str) -> dict:
        """Per dtype: the log2 of each axis's points (in, out, positions) and the log rates by grid index;
        the rows must fill the grid (every in x out x positions combination once) to interpolate."""
        tables = {}
        table = getattr(self, field)
        for dtype in {row.dtype for row in table}:
            rows = {row.point: row for row in table if row.dtype == dtype}
            axes = [sorted({p[i] for p in rows}) for i in range(3)]
            missing = [p for p in itertools.product(*axes) if p not in rows]
            if missing or len(rows) < sum(row.dtype == dtype for row in table):
                what = f"lacks (in, out, positions) = {missing[0]}" if missing else "repeats a point"
                raise ClusterError(f"{owner}: {field} for {dtype} {what}; give one row for every combination of "
                                   f"in_channels {axes[0]}, out_channels {axes[1]} and positions {axes[2]}")
            logs = {tuple(axes[a].index(p[a]) for a in range(3)):
                    tuple(math.log(r) for r in (row.forward, row.input_grad, row.weight_grad))
                    for p, row in rows.items()}
            tables[dtype] = (tuple(log2s(axis) for axis in axes), logs)
        return tables

    def _op_curves(self, owner: str) -> dict:
        """Per op: the log2 of its sizes and the log rates (forward, backward) at each (rows sorted by size)."""
        curves: dict[str, tuple[list, list]] = {}
        for row in self.op_rates:
            sizes, logs = curves.setdefault(row.op, ([], []))
            if row.bytes in sizes:
                raise ClusterError(f"{owner}: op_rates give {row.op} at {row.bytes} bytes twice; give one row per "
                                   "op and size")
            sizes.append(row.bytes)
            logs.append((math.log(row.forward), math.log(row.backward)))
        return {op: (log2s(sizes), tuple(logs)) for op, (sizes, logs) in curves.items()}

    def _check_reserved(self, owner: str) -> None:
        value = self.reserved_memory
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value >= 0):
            raise ClusterError(f"{owner}: reserved_memory = {value!r}: must be a finite number >= 0 (bytes)")
        if value >= self.device_memory:
            raise ClusterError(f"{owner}: reserved_memory ({value / GiB:.3g} GiB) leaves nothing of device_memory "
                               f"({self.device_memory / GiB:.3g} GiB); make it smaller")

    def _check_flops(self, owner: str) -> None:
        if not self.peak_flops:
            raise ClusterError(f"{owner}: peak_flops is empty; give FLOP/s for at least one of {', '.join(DTYPES)}")
        for dtype, value in self.peak_flops.items():
            if dtype not in DTYPES:
                raise ClusterError(f"{owner}: peak_flops[{dtype!r}]: unknown dtype; use {', '.join(DTYPES)}")
            check_positive(f"{owner}: peak_flops.{dtype}", value)
        if set(self.efficiency) != set(KINDS):
            given = ", ".join(sorted(map(str, self.efficiency))) or "none"
            raise ClusterError(f"{owner}: efficiency has keys {given}; give exactly {', '.join(KINDS)}")
        for kind, value in self.efficiency.items():
            check_positive(f"{owner}: efficiency.{kind}", value)
            if value > 1:
                raise ClusterError(f"{owner}: efficiency.{kind} = {value!r}: a fraction of peak, in (0, 1]")

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    def flops(self, dtype: str, kind: str) -> float:
        """Achievable FLOP/s of one device: ``peak_flops[dtype] * efficiency[kind]``."""
        if dtype not in self.peak_flops:
            raise ClusterError(f"cluster {self.name!r} has no peak FLOP/s for dtype {dtype!r}; it knows "
                               f"{', '.join(self.peak_flops)} (add [peak_tflops] {dtype} to its TOML file)")
        if kind not in self.efficiency:
            raise ClusterError(f"compute kind {kind!r} is unknown; use {', '.join(KINDS)}")
        return self.peak_flops[dtype] * self.efficiency[kind]

    def check_dtype(self, dtype: str) -> None:
        """Refuse a dtype this cluster has no peak FLOP/s for: what pricing a model in it would find out, after
        the model's analysis."""
        self.flops(dtype, KINDS[0])

    def conv_flops(self, dtype: str, in_channels: int, out_channels: int, positions: float,
                   work: int = 0) -> tuple[float, float, float]:
        """Achievable FLOP/s of a conv's forward, input gradient and weight gradient: the measured
        ``conv_rates`` of ``dtype`` interpolated in log2 of channels in and out and of output positions (log
        rates, trilinear, clamped at the grid's ends), or ``efficiency["conv"]`` of peak; the
        ``slow_conv_rates`` alike when ``work`` (N*C*D*H of the input) is at most ``fast_conv_min``."""
        if work and work <= self.fast_conv_min and dtype in self._slow_conv_tables:
            return interpolate(self._slow_conv_tables[dtype], in_channels, out_channels, positions)
        if dtype not in self._conv_tables:
            if dtype == "float32" and "tfloat32" in self.peak_flops:
                dtype = "tfloat32"  # PyTorch runs float32 convolutions on TF32 tensor cores (cudnn.allow_tf32)
            rate = self.flops(dtype, "conv")
            return rate, rate, rate
        return interpolate(self._conv_tables[dtype], in_channels, out_channels, positions)

    def has_conv_rates(self, dtype: str) -> bool:
        """Whether ``conv_rates`` of ``dtype`` were measured (else convs run at ``efficiency["conv"]`` of peak)."""
        return dtype in self._conv_tables

    def op_rate(self, op: str, num_bytes: float) -> tuple[float, float]:
        """Bytes/s of the forward and the backward of a layer ``op`` moving ``num_bytes``: its measured
        ``op_rates`` interpolated in log2 of the bytes (log rates, clamped at the ends), else
        ``memory_bandwidth`` for both."""
        if op not in self._op_tables:
            return self.memory_bandwidth, self.memory_bandwidth
        sizes, logs = self._op_tables[op]
        forward = backward = 0.0
        for i, w in log2_weights(sizes, num_bytes):
            forward += w * logs[i][0]
            backward += w * logs[i][1]
        return math.exp(forward), math.exp(backward)

    def with_devices(self, n: int) -> ClusterSpec:
        """The same hardware with ``n`` devices in all: one node of ``n`` or ``n / devices_per_node`` full nodes."""
        per_node = self.devices_per_node
        check_devices(n)
        if n <= per_node:
            return replace(self, num_nodes=1, devices_per_node=n)
        if n % per_node:
            below, above = n // per_node * per_node, (n // per_node + 1) * per_node
            raise ClusterError(f"{n:,} devices: not a whole number of {per_node}-device {self.name} nodes; use a "
                               f"multiple of {per_node} (e.g. {below:,} or {above:,})")
        return replace(self, num_nodes=n // per_node)

    def link(self, num_devices_in_group: int, spans_nodes: bool) -> Link:
        """The link a group of devices talks over: ``inter_node`` when it spans nodes, else ``intra_node``."""
        if num_devices_in_group < 1:
            raise ClusterError(f"a group of {num_devices_in_group} devices: give at least 1")
        if not spans_nodes and num_devices_in_group > self.devices_per_node:
            raise ClusterError(f"a group of {num_devices_in_group} devices cannot stay inside one "
                               f"{self.devices_per_node}-device {self.name} node; pass spans_nodes=True")
        return self.inter_node if spans_nodes else self.intra_node


def check_devices(n: int) -> None:
    """Refuse a device count that is not a whole number in ``[1, MAX_DEVICES]``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ClusterError(f"{n!r} devices: give a whole number >= 1")
    if n > MAX_DEVICES:
        raise ClusterError(f"{n:,} devices: more than {MAX_DEVICES:,} (ten times the largest machines built); give "
                           "the number of devices you mean")


def _one_node(name: str, memory_gib: float, hbm_gbs: float, tflops: dict, link_gbs: float, nic_gbs: float,
              link_us: float = 3, nic_us: float = 5) -> ClusterSpec:
    """A node of 8 devices; bandwidths in GB/s per device per direction, latencies in microseconds."""
    # Typical values, not measured: matmul reaches ~60% of peak, 3D conv ~45%; ~2 GiB per device go to
    # the runtime context (CUDA, ROCm), NCCL/RCCL buffers and allocator slack.
    # `hybridpar calibrate` or a TOML file (docs/cluster.md) overrides them.
    return ClusterSpec(
        name=name, num_nodes=1, devices_per_node=8, device_memory=memory_gib * GiB,
        reserved_memory=2 * GiB, peak_flops={k: v * TFLOPS for k, v in tflops.items()},
        efficiency={"matmul": 0.6, "conv": 0.45}, memory_bandwidth=hbm_gbs * GB,
        intra_node=Link(bandwidth=link_gbs * GB, latency=link_us * US),
        inter_node=Link(bandwidth=nic_gbs * GB, latency=nic_us * US),
    )


# Link bandwidths are per device, per direction; inter_node is the node's NICs divided among its devices.
PRESETS: dict[str, ClusterSpec] = {
    # NVIDIA V100 SXM2 32 GB data sheet; DGX-1V: NVLink2 6 x 25 GB/s, 4 x 100 Gb/s EDR IB per node. No bfloat16.
    "v100": _one_node("v100", 32, 900, {"float64": 7.8, "float32": 15.7, "float16": 125}, 150, 6.25),
    # NVIDIA A100 SXM4 40 GB data sheet (fp64 tensor core 19.5); DGX A100: NVLink3, 8 x 200 Gb/s HDR IB.
    "a100-40": _one_node("a100-40", 40, 1555, {"float64": 19.5, "float32": 19.5, "tfloat32": 156, "bfloat16": 312,
                                               "float16": 312}, 300, 25),
    # NVIDIA A100 SXM4 80 GB data sheet (HBM2e 2,039 GB/s); DGX A100: NVLink3, 8 x 200 Gb/s HDR IB.
    "a100-80": _one_node("a100-80", 80, 2039, {"float64": 19.5, "float32": 19.5, "tfloat32": 156, "bfloat16": 312,
                                               "float16": 312}, 300, 25),
    # NVIDIA H100 SXM5 80 GB data sheet (fp64 tensor core 67, bf16 989.5 dense); DGX H100: NVLink4 900 GB/s
    # both directions, 8 x 400 Gb/s NDR IB.
    "h100": _one_node("h100", 80, 3350, {"float64": 67, "float32": 67, "tfloat32": 494.7, "bfloat16": 989.5,
                                         "float16": 989.5}, 450, 50),
    # NVIDIA H200 SXM 141 GB data sheet (HBM3e 4.8 TB/s; nvidia-smi shows ~140 GiB); DGX H200: NVLink4, 8 x 400 Gb/s.
    "h200": _one_node("h200", 140, 4800, {"float64": 67, "float32": 67, "tfloat32": 494.7, "bfloat16": 989.5,
                                          "float16": 989.5}, 450, 50),
    # AMD Instinct MI250X data sheet, one GCD (half an OAM) per device: fp64/fp32 matrix 47.85, fp16/bf16 191.5,
    # 64 GiB HBM2e at 1.64 TB/s. Frontier node: 8 GCDs; one 50 GB/s Infinity Fabric link between packages (the
    # slowest hop of a ring; 200 GB/s inside a package); Slingshot 4 x 25 GB/s per node.
    "mi250x": _one_node("mi250x", 64, 1638.4, {"float64": 47.85, "float32": 47.85, "bfloat16": 191.5,
                                                "float16": 191.5}, 50, 12.5, link_us=4, nic_us=6),
}


def preset(name: str) -> ClusterSpec:
    """The one-node preset of that name; scale it with ``.with_devices(n)``."""
    if name not in PRESETS:
        raise ClusterError(f"unknown cluster preset {name!r}; presets: {', '.join(PRESETS)} (or give a TOML file)")
    return PRESETS[name]

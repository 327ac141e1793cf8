"""What ``hybridpar calibrate`` measures on and how: the method for a device type (``method_for``) and the devices
measured, in the words the report and the TOML file's header use (``Measured``). Pure: no torch.

The workers' device is their mesh's (``hybridpar.mesh.accelerator_type``, ``device_of``): a CUDA GPU each on a
GPU node, the CPU's cores shared among them elsewhere. What applies differs:

- CPU workers share the cores, the caches and the memory bandwidth: caches are flushed before each timed call,
  calls run in turns where the workers' threads outnumber the cores, a worker done early keeps computing, memory
  comes from /proc, with glibc's allocator warmed as in training, and PyTorch's slow batch-1 conv kernel is
  measured too;
- a CUDA GPU runs its kernels after their launch returns: a repeat is timed with CUDA events on the current
  stream (the end event waited for), and memory comes from the device (``torch.cuda.mem_get_info``). A GPU has
  no slow conv kernel of PyTorch's own, and no cores to share.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridpar.errors import HybridparError


@dataclass(frozen=True)
class Method:
    """How calibrate measures one device type."""

    timer: str  # "perf_counter" (the host's clock), or "cuda_events" (the stream's, the end event waited for)
    flush_caches: bool  # FLUSH_BYTES written before each timed call (a training step finds its data in memory)
    shares_host: bool  # workers share cores and memory bandwidth: calls in turns, a worker done early keeps busy
    memory: str  # "proc" (/proc, glibc's allocator warmed as in training) or "cuda" (torch.cuda.mem_get_info)
    slow_conv: bool  # PyTorch's slow batch-1 conv kernel exists: slow_conv_rates and fast_conv_min measured


METHODS = {
    "cpu": Method(timer="perf_counter", flush_caches=True, shares_host=True, memory="proc", slow_conv=True),
    "cuda": Method(timer="cuda_events", flush_caches=False, shares_host=False, memory="cuda", slow_conv=False),
}


def method_for(device_type: str) -> Method:
    """The method of ``device_type`` (a mesh's ``device_type``)."""
    if device_type not in METHODS:
        raise HybridparError(f"hybridpar calibrate measures {' and '.join(METHODS)} devices, not {device_type!r} (the "
                             "accelerator PyTorch found here); hide it (e.g. its *_VISIBLE_DEVICES variable) to "
                             "measure the CPU")
    return METHODS[device_type]


@dataclass(frozen=True)
class Measured:
    """The devices one launch of workers measured: ``count`` workers of ``device_type`` (``name``, e.g.
    "NVIDIA H100 80GB HBM3"; the CPU's ``cores`` shared among them) over ``backend``."""

    count: int
    device_type: str
    backend: str
    name: str = ""
    cores: int = 0

    def __str__(self) -> str:
        if self.device_type == "cpu":
            workers = f"{self.count} CPU worker{'s' if self.count != 1 else ''}"
            return f"{workers} on {self.cores} core{'s' if self.cores != 1 else ''} (cpu, {self.backend})"
        return f"{self.count} × {self.name or self.device_type} ({self.device_type}, {self.backend})"

    @property
    def spec_suffix(self) -> str:
        """The end of a calibrated spec's name: ``2proc`` (CPU worker processes) or ``4gpu``."""
        return f"{self.count}{'proc' if self.device_type == 'cpu' else 'gpu'}"


def measured_line(compute: Measured, comm: Measured) -> str:
    """What the report and the TOML header say was measured: the compute's devices, and the communication's
    where it ran on another kind of device (one GPU has no GPU to talk to)."""
    if comm.device_type == compute.device_type:
        return f"measured: {compute}"
    return f"measured: {compute}; communication: {comm}"

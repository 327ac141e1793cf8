"""Memory: what a training worker holds before its model, a device's total, and (CPU workers) an allocator warmed as
in training. CPU workers read /proc; a CUDA worker asks its GPU (``torch.cuda.mem_get_info``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from hybridpar.calibrate.settings import GLIBC_MMAP_CEILING, Settings


def allocate_as_in_training() -> None:
    """Put glibc's allocator where a training worker's is after its first step. glibc maps every block above
    its threshold afresh (each page then faults on first touch) and raises the threshold to a freed mapped
    block's size, up to ``GLIBC_MMAP_CEILING``: after one step of freed activations, tensors up to the ceiling
    come back warm from the heap, larger ones are mapped and faulted in at every step. A worker that has not
    freed a large block yet maps each fresh output instead: a 16 -> 16 conv over 2^17 positions measured
    180-250 GFLOP/s so, 350 with the threshold raised, 300 inside a training step (page faults are system
    time, and dear on a virtual machine).

    Freeing one mapped block just under the ceiling raises the threshold (and the heap's trim threshold to
    twice it). Raised alone, it left every other fresh process faulting anyway: the heap had not grown yet,
    so an output came from new pages at its top, and once a small allocation landed above a freed output, the
    next output of that size (an aligned request, a few bytes larger than the freed chunk) grew the heap
    again. So the heap is then grown by two blocks under the threshold, touched and freed: it keeps their
    pages (below the trim threshold), and outputs come from them as in a step that has run once."""
    torch.empty(GLIBC_MMAP_CEILING - 2**20, dtype=torch.uint8).fill_(0)
    blocks = [torch.empty(GLIBC_MMAP_CEILING - 3 * 2**20, dtype=torch.uint8).fill_(0) for _ in range(2)]
    del blocks


def runtime_bytes(settings: Settings) -> float:
    """What a training worker holds before its model, with hybridpar's trainer imported (checkpointing, HDF5)
    and a DDP wrapper built (which loads torch's compiler stack and allocates communication buffers): its
    resident set (CPU workers), or the memory in use on its GPU (total - free: the CUDA context and NCCL's
    buffers are in it, not in the counts of torch's allocator)."""
    import rich.progress  # noqa: F401  (what a training worker has loaded: the trainer, its tasks, the display)
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel

    import hybridpar.train.tasks.volumes  # noqa: F401
    import hybridpar.train.trainer  # noqa: F401

    device = torch.device(settings.device)
    DistributedDataParallel(nn.Linear(1, 1).to(device), device_ids=None if device.type == "cpu" else [device])
    if settings.method.memory == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return float(total - free)
    return _rss_bytes()


def device_bytes(settings: Settings, num_workers: int) -> float:
    """Bytes of memory of one device: its GPU's, or this machine's (MemTotal) shared by ``num_workers``."""
    if settings.method.memory == "cuda":
        return float(torch.cuda.mem_get_info(torch.device(settings.device))[1])
    return mem_total() / num_workers


def _proc_bytes(path: str, key: str) -> int | None:
    """The ``key:`` line of a /proc file in bytes (its kB value), or ``None`` where there is no /proc."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _rss_bytes() -> float:
    """This process's resident memory (VmRSS of /proc/self/status; peak RSS where there is no /proc)."""
    rss = _proc_bytes("/proc/self/status", "VmRSS")
    if rss is not None:
        return rss
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def mem_total() -> float:
    """Bytes of memory of this machine (MemTotal of /proc/meminfo)."""
    total = _proc_bytes("/proc/meminfo", "MemTotal")
    return total if total is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

"""What this machine offers a process before it allocates: the memory free now. Standard library only."""

from __future__ import annotations

import os
from pathlib import Path


def available_memory() -> int:
    """Bytes this process could allocate now without swapping: MemAvailable of /proc/meminfo (free memory plus
    the caches the kernel would give back), or the free pages where there is no /proc."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gib(num_bytes: float) -> str:
    """``12.3 GiB``; large amounts in TiB, PiB, EiB."""
    value, unit = num_bytes / 2**30, "GiB"
    for bigger in ("TiB", "PiB", "EiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.3g} {unit}"

"""What ``hybridpar calibrate`` measures: sizes, grids, repeats (``Settings``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hybridpar.calibrate.device import Method, method_for
from hybridpar.plan.cost import MEASURED_KERNEL

DTYPES = ("float32", "float64")
MATMUL_EDGE = 1024
CONV_INPUT = (2, 16, 32, 32, 32)  # (N, C, D, H, W): big enough for the mkldnn path in float32
CONV_KERNEL = MEASURED_KERNEL  # the planner reads the conv rates as those of this kernel width
MEMORY_BYTES = 64 * 2**20  # per tensor of the elementwise add
GLIBC_MMAP_CEILING = 32 * 2**20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit (allocate_as_in_training)
FLUSH_BYTES = 64 * 2**20  # written before each timed call: more than the last-level caches of most CPUs
# conv_rates: in channels x out channels x output positions (batch 2: PyTorch's fast CPU kernel)
CONV_GRID = ((1, 4, 8, 16, 64), (4, 8, 16, 64), (2**11, 2**14, 2**17))
CONV_GRID_QUICK = ((1, 16), (4, 64), (2**11, 2**14))
# One more positions row, LARGE_FACTOR x the grid's largest (where the caches give out): measured for the channel
# pairs up to LARGE_CHANNELS in and out (a large volume's layers are thin, and these take seconds), the wider
# pairs' largest rows scaled by what the step costs the nearest measured pair (measured, they would take minutes;
# the step costs 16 -> 16 a third of its rate and 4 -> 16 nothing, so one reference pair for all misprices)
LARGE_FACTOR = 8
LARGE_CHANNELS = 16
# slow_conv_rates: the same axes for a batch of 1 on the slow kernel (its domain, N*C*D*H <= FAST_CONV_MIN, holds
# smaller volumes than the fast grid's)
SLOW_CONV_GRID = ((1, 4, 8, 16, 64), (4, 8, 16, 64), (2**10, 2**13, 2**16))
SLOW_CONV_GRID_QUICK = ((1, 16), (4, 64), (2**10, 2**13))
FAST_CONV_MIN = 20480  # PyTorch's CPU rule: a batch of 1 takes oneDNN only when N*C*D*H of the input exceeds this
SMALL_BYTES = 256  # messages up to this size give the latency
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
# _sync_wait's sequences: SYNC_CONVS convs on slabs (2, C, depth, 32, 32) of one depth each, about 0.3 to
# 10 ms a conv on one core (the compute between a spatial step's exchanges)
SYNC_CONV_CHANNELS = 16
SYNC_CONV_DEPTHS = (2, 4, 8, 16, 32)
SYNC_CONVS = 8
# On more worker threads than cores a worker runs in turns with another: a call shorter than the scheduler's
# turn (a few ms) often runs whole in one turn, so calls are timed in runs of at least this long
SHARED_CORE_SECONDS = 0.03


@dataclass(frozen=True)
class Settings:
    dtype: str = "float32"
    quick: bool = False
    device: str = "cpu"  # where a worker measures: its mesh's device (hybridpar.mesh.device_of), e.g. "cuda:0"

    @property
    def method(self) -> Method:
        """How the device is measured (``calibrate.device``)."""
        return method_for(self.device.split(":")[0])

    @property
    def repeats(self) -> int:
        return 3 if self.quick else 7

    @property
    def max_inner(self) -> int:
        """Timed operations per repeat for the smallest messages (each takes microseconds)."""
        return 10 if self.quick else 50

    @property
    def conv_grid(self) -> tuple[tuple[int, int, int], ...]:
        """(in channels, out channels, output positions) of the measured convs: every combination."""
        grid = CONV_GRID_QUICK if self.quick else CONV_GRID
        return tuple(itertools.product(*grid))

    @property
    def largest_positions(self) -> int:
        return max(p[2] for p in self.conv_grid)

    @property
    def large_conv_pairs(self) -> tuple[tuple[int, int], ...]:
        """The (in, out) channel pairs measured at ``LARGE_FACTOR`` times the largest positions."""
        return tuple(sorted({(cin, cout) for cin, cout, _ in self.conv_grid
                             if cin <= LARGE_CHANNELS and cout <= LARGE_CHANNELS}))

    @property
    def slow_conv_grid(self) -> tuple[tuple[int, int, int], ...]:
        return tuple(itertools.product(*(SLOW_CONV_GRID_QUICK if self.quick else SLOW_CONV_GRID)))

    @property
    def sizes(self) -> tuple[int, ...]:
        """Message sizes in bytes: 4 B to 64 MiB, by 16x (quick) or 4x."""
        return tuple(4 * 16**i for i in range(7)) if self.quick else tuple(4 * 4**i for i in range(13))

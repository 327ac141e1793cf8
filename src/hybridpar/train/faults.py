"""Faults injected on purpose, to test and show recovery: the environment variable ``HYBRIDPAR_FAULTS`` lists
``KIND:RANK@STEP`` entries, e.g. ``HYBRIDPAR_FAULTS="kill:3@5,nan:1@2"``.

- ``kill``: the rank kills itself (SIGKILL) during step ``STEP`` (1-based), after its backward pass and before
  the update, as a crashed node would;
- ``nan``: the rank's loss of step ``STEP`` becomes NaN;
- ``inf``: one of the rank's weights becomes infinite after the update of step ``STEP`` (silent corruption);
- ``stall``: the rank stops sending during step ``STEP``, after its backward pass, and never goes on, while its
  process stays alive (a link that drops its packets without a reset; its heartbeat goes on:
  ``hybridpar.train.watchdog``);
- ``slow``: from step ``STEP`` on, the rank computes at about half speed (a throttled device, a noisy
  neighbour): its forward keeps the CPU busy as long again as it computed, its backward twice that;
  ``slow:RANK@STEPxF`` makes it ``F`` times slower;
- ``link``: from step ``STEP`` on, the rank's link is about half as fast (``link:RANK@STEPxF``: ``F`` times slower):
  each of its halo exchanges and gradient all-reduces is held, inside its timed span, ``F - 1`` times what its
  bytes take on gloo over loopback (``LOOPBACK``), so that its peers wait for its messages as they would behind a
  slow link, while its compute is untouched.

The ``i``-th fault of the list fires in restart attempt ``i`` of the elastic agent (``TORCHELASTIC_RESTART_COUNT``),
so a run restarted after a kill meets the next fault of the list, not the same one again.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridpar.errors import ConfigError

ENV = "HYBRIDPAR_FAULTS"
KINDS = ("kill", "nan", "inf", "slow", "stall", "link")
SCALED = ("slow", "link")  # the kinds that take a factor
_ENTRY = re.compile(r"^(\w+):(\d+)@(\d+)(?:x(\d+))?$")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int
    factor: int = 2  # how many times slower a ``slow`` rank computes, a ``link`` rank's link carries


def planned() -> tuple[Fault, ...]:
    """The faults ``HYBRIDPAR_FAULTS`` asks for (none when it is unset); a malformed entry is a ``ConfigError``."""
    return _parse(os.environ.get(ENV, ""))


@functools.cache
def _parse(text: str) -> tuple[Fault, ...]:
    faults = []
    for entry in filter(None, re.split(r"[,\s]+", text.strip())):
        match = _ENTRY.match(entry)
        factor = match.group(4) if match else None
        if not match or match.group(1) not in KINDS or (factor is not None and (match.group(1) not in SCALED
                                                                                or int(factor) < 2)):
            raise ConfigError(f"{ENV}: {entry!r} is not KIND:RANK@STEP with KIND one of {', '.join(KINDS)} (or "
                              "slow:RANK@STEPxF or link:RANK@STEPxF, F >= 2); e.g. kill:3@5 (rank 3 dies during "
                              "step 5)")
        faults.append(Fault(match.group(1), int(match.group(2)), int(match.group(3)), int(factor or 2)))
    return tuple(faults)


def _mine() -> Fault | None:
    """The fault planned for this rank in this attempt, if any."""
    faults = planned()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt >= len(faults) or faults[attempt].rank != dist.get_rank():
        return None
    return faults[attempt]


def _due(step: int) -> str | None:
    """The kind of fault planned for this rank at ``step`` in this attempt, if any."""
    fault = _mine()
    return fault.kind if fault is not None and fault.step == step else None


def after_backward(step: int, loss: torch.Tensor) -> torch.Tensor:
    """This rank's loss of step ``step``, after a ``kill``, ``stall`` or ``nan`` fault planned for it."""
    kind = _due(step)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    while kind == "stall":
        time.sleep(1)
    return loss * float("nan") if kind == "nan" else loss


def after_update(step: int, parameters) -> None:
    """An ``inf`` fault planned for step ``step``: one weight of this rank becomes infinite."""
    if _due(step) == "inf":
        with torch.no_grad():
            weight = next(iter(parameters))
            (weight.to_local() if isinstance(weight, DTensor) else weight).view(-1)[0] = float("inf")


class Slowdown:
    """A ``slow`` fault on this rank's modules: from its step on (``at``, set before each step), each forward keeps
    the CPU busy ``factor - 1`` times as long as it computed, and the backward of its output twice that (a backward
    costs about two forwards)."""

    def __init__(self, first: int, factor: int, modules):
        self.first, self.extra, self.step, self._begin = first, factor - 1, 0, 0.0
        for module in modules:
            module.register_forward_pre_hook(self._before)
            module.register_forward_hook(self._after)

    def at(self, step: int) -> None:
        self.step = step

    def _before(self, module, args) -> None:
        self._begin = time.perf_counter()

    def _after(self, module, args, output):
        if self.step < self.first:
            return None
        extra = (time.perf_counter() - self._begin) * self.extra
        _busy(extra)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            return _BusyInBackward.apply(output, 2 * extra)
        return None


class _BusyInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds: float):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _busy(ctx.seconds)
        return grad, None


def _busy(seconds: float) -> None:
    """Keep the CPU busy for ``seconds`` (a slow device takes longer and holds its core: it does not sleep)."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass


# gloo over loopback on the machine the faults were made on: ~140 us per message, ~2.2 GiB/s
LOOPBACK = (140e-6, 2.2 * 2**30)


class SlowLink:
    """A ``link`` fault on this rank's exchanges (``hold``: ``F - 1`` times a message's loopback time, from step
    ``first`` on; ``at`` set before each step)."""

    def __init__(self, first: int, factor: int):
        self.first, self.extra, self.step = first, factor - 1, 0

    def at(self, step: int) -> None:
        self.step = step

    def hold(self, nbytes: int) -> float:
        if self.step < self.first:
            return 0.0
        latency, bandwidth = LOOPBACK
        return self.extra * (latency + nbytes / bandwidth)


def slowdown(parallel, counters) -> Slowdown | SlowLink | None:
    """The ``slow`` or ``link`` fault planned for this rank in this attempt, hooked onto its modules or onto the
    ``counters`` of its exchanges (``hybridpar.train.links.Links.counters``) (``None``: none)."""
    fault = _mine()
    if fault is None or fault.kind not in SCALED:
        return None
    if fault.kind == "slow":
        return Slowdown(fault.step, fault.factor, parallel.computing_modules())
    link = SlowLink(fault.step, fault.factor)
    for counter in counters:
        counter.hold = link.hold
    return link

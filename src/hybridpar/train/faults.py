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

A ``slow`` or ``link`` fault lasts to the end of the attempt, or ``S`` seconds with ``forS`` after it
(``slow:1@5x3for60``: rank 1 three times slower for a minute from step 5).

The ``i``-th fault of the list fires in restart attempt ``i`` of the elastic agent (``TORCHELASTIC_RESTART_COUNT``),
so a run restarted after a kill meets the next fault of the list, not the same one again.

A ``stall``, ``slow`` or ``link`` fault may instead wait for a signal, ``KIND@usr1`` or ``KIND@usr2``
(``stall@usr1,slow@usr2x3for60``): then every rank of every attempt is armed, and the rank that receives the
signal (``kill -USR1 PID``) meets the fault, each time the signal comes. A chaos run (``benchmarks/chaos.py``)
draws its faults this way, at times of its own choosing, besides SIGKILL, SIGSTOP and SIGTERM.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridpar.errors import ConfigError

ENV = "HYBRIDPAR_FAULTS"
KINDS = ("kill", "nan", "inf", "slow", "stall", "link")
SCALED = ("slow", "link")  # the kinds that take a factor and a duration
SIGNALLED = ("stall", "slow", "link")  # the kinds a signal may fire
SIGNALS = {"usr1": signal.SIGUSR1, "usr2": signal.SIGUSR2}
_ENTRY = re.compile(r"^(\w+)(?::(\d+)@(\d+)|@(usr1|usr2))(?:x(\d+))?(?:for(\d+))?$")
_FORMS = ("KIND:RANK@STEP with KIND one of {kinds} (slow and link also take xF, F >= 2, and forS, S seconds), or "
          "KIND@usr1 / KIND@usr2 with KIND one of {signalled}; e.g. kill:3@5 (rank 3 dies during step 5), "
          "slow:1@5x3for60, stall@usr1")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None  # None: the rank that receives ``signal``
    step: int | None  # None: when ``signal`` comes
    factor: int = 2  # how many times slower a ``slow`` rank computes, a ``link`` rank's link carries
    seconds: int | None = None  # how long a ``slow`` or ``link`` fault lasts (None: to the end of the attempt)
    signal: str | None = None  # ``usr1`` or ``usr2``: the fault waits for it, on every rank of every attempt


def planned() -> tuple[Fault, ...]:
    """The faults ``HYBRIDPAR_FAULTS`` asks for (none when it is unset); a malformed entry is a ``ConfigError``."""
    return _parse(os.environ.get(ENV, ""))


@functools.cache
def _parse(text: str) -> tuple[Fault, ...]:
    faults = []
    for entry in filter(None, re.split(r"[,\s]+", text.strip())):
        match = _ENTRY.match(entry)
        kind, rank, step, signalled, factor, seconds = match.groups() if match else (None,) * 6
        if (kind not in KINDS or ((factor is not None or seconds is not None) and kind not in SCALED)
                or (factor is not None and int(factor) < 2) or (seconds is not None and int(seconds) < 1)
                or (signalled is not None and kind not in SIGNALLED)):
            raise ConfigError(f"{ENV}: {entry!r} is not " + _FORMS.format(kinds=", ".join(KINDS),
                                                                       signalled=", ".join(SIGNALLED)))
        faults.append(Fault(kind, None if rank is None else int(rank), None if step is None else int(step),
                            int(factor or 2), None if seconds is None else int(seconds), signalled))
    return tuple(faults)


def _mine() -> Fault | None:
    """The fault planned for this rank in this attempt, if any (the faults that wait for a signal apart)."""
    faults = [fault for fault in planned() if fault.signal is None]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt >= len(faults) or faults[attempt].rank != dist.get_rank():
        return None
    return faults[attempt]


_stall = threading.Event()  # a ``stall@usrN`` signal came: this rank stalls in its next step


def _due(step: int) -> str | None:
    """The kind of fault planned for this rank at ``step`` in this attempt, if any."""
    fault = _mine()
    return fault.kind if fault is not None and fault.step == step else None


def after_backward(step: int, loss: torch.Tensor) -> torch.Tensor:
    """This rank's loss of step ``step``, after a ``kill``, ``stall`` or ``nan`` fault planned for it."""
    kind = "stall" if _stall.is_set() else _due(step)
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


class Window:
    """When a ``slow`` or ``link`` fault acts: from step ``first`` (``at``, called before each step) or from each
    ``start()`` (its signal), for ``seconds`` (None: to the end of the attempt)."""

    def __init__(self, first: int | None, seconds: int | None):
        self.first, self.seconds, self.since = first, seconds, None

    def at(self, step: int) -> None:
        if self.since is None and self.first is not None and step >= self.first:
            self.start()

    def start(self, *_) -> None:
        self.since = time.monotonic()

    @property
    def active(self) -> bool:
        return self.since is not None and (self.seconds is None or time.monotonic() - self.since < self.seconds)


class Slowdown:
    """A ``slow`` fault on this rank's modules: while its ``window`` is active, each forward keeps the CPU busy
    ``factor - 1`` times as long as it computed, and the backward of its output twice that (a backward costs about
    two forwards)."""

    def __init__(self, window: Window, factor: int, modules):
        self.window, self.extra, self._begin = window, factor - 1, 0.0
        for module in modules:
            module.register_forward_pre_hook(self._before)
            module.register_forward_hook(self._after)

    def _before(self, module, args) -> None:
        self._begin = time.perf_counter()

    def _after(self, module, args, output):
        if not self.window.active:
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
    """A ``link`` fault on this rank's exchanges (``hold``: ``F - 1`` times a message's loopback time, while its
    ``window`` is active)."""

    def __init__(self, window: Window, factor: int):
        self.window, self.extra = window, factor - 1

    def hold(self, nbytes: int) -> float:
        if not self.window.active:
            return 0.0
        latency, bandwidth = LOOPBACK
        return self.extra * (latency + nbytes / bandwidth)


class Armed:
    """The faults of this rank in this attempt that act over time: their windows, told each step (``at``)."""

    def __init__(self, windows: list[Window]):
        self.windows = windows

    def at(self, step: int) -> None:
        for window in self.windows:
            window.at(step)


def arm(parallel, counters) -> Armed | None:
    """The ``slow`` and ``link`` faults planned for this rank in this attempt, hooked onto its modules or onto the
    ``counters`` of its exchanges (``hybridpar.train.links.Links.counters``), and the faults that wait for a signal,
    its handlers installed (``None``: none)."""
    windows = []
    mine = _mine()
    for fault in ([mine] if mine is not None and mine.kind in SCALED else []) + [
            f for f in planned() if f.signal is not None]:
        if fault.kind == "stall":
            signal.signal(SIGNALS[fault.signal], lambda *_: _stall.set())
            continue
        window = Window(fault.step, fault.seconds)
        if fault.signal is not None:
            signal.signal(SIGNALS[fault.signal], window.start)
        if fault.kind == "slow":
            Slowdown(window, fault.factor, parallel.computing_modules())
        else:
            link = SlowLink(window, fault.factor)
            for counter in counters:
                counter.hold = link.hold
        windows.append(window)
    return Armed(windows) if windows else None

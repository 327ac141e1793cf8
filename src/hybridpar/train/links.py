"""Slow links (fail-slow: a link that degrades without failing, about 40% of fail-slow cases in production
reports): each rank's communication timed apart from its compute, and a link slower than its peers named.

Each rank times every exchange it takes part in: its blocking halo exchanges, per peer
(``hybridpar.spatial.halo.ExchangeStats.links``), and its gradient all-reduces, per bucket
(``hybridpar.parallel.data.BucketClock``). A rank's time in an exchange is the transfer and its wait for the other
side, when that side came later (a slower neighbour's compute); the side that came last waited for nobody, so the
least of the sides' times is the transfer itself, with no clocks compared across hosts. Every ``train.slow_window``
steps one all-gather gives every rank every rank's times, and the last two windows are judged: a link's seconds in a
step are the sum over its exchanges (the same in every step) of the median over those steps of the least side's (a
busy machine's pauses, which lengthen both sides of an exchange now and then, do not move a median; a link slowed
for more than half of them does).

A link is slow when its seconds per byte are ``train.slow_factor`` times its peers' (the median of the other links
of its kind: the halo links between spatial neighbours; a link alone of its kind, the gradient all-reduce of a
``dp x spatial`` group, against itself when first judged), and what that costs is at least ``pace.MATTERS`` of a
step, in ``pace.PATIENCE`` judgements in a row (a busy machine starves one pair of ranks for a while now and then:
here, factors up to 2.25 in single judgements over 2,000 clean steps beside two busy processes). It is reported
once, the same on every rank, with its factor and seconds.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch.distributed as dist

from hybridpar.train.pace import MATTERS, PATIENCE

HALO, GRADIENTS = "halo", "gradients"


@dataclass(frozen=True, order=True)
class Link:
    """A link as measured: its kind (``HALO``: between two spatial neighbours; ``GRADIENTS``: a data-parallel
    group's all-reduce) and its global ranks."""

    kind: str
    ranks: tuple[int, ...]

    def describe(self) -> str:
        if self.kind == HALO:
            return f"the link between ranks {self.ranks[0]} and {self.ranks[1]} (halo exchanges)"
        return f"the gradient all-reduce of ranks {_span(self.ranks)}"


def _span(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 2 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


@dataclass(frozen=True)
class LinkWindow:
    """What the last two windows showed, the same on every rank: per link its seconds of transfer in a step, its
    bytes in a step and its factor (seconds per byte over its peers'); ``slow``: the links reported now
    (``link: factor``); ``step_s``: the windows' step time (the slowest rank's median)."""

    step: int
    seconds: dict[Link, float]
    nbytes: dict[Link, int]
    factors: dict[Link, float]
    slow: dict[Link, float]
    step_s: float

    def record(self) -> dict:
        return {"step": self.step, "split": "links", "step_s": self.step_s,
                "links": [{"kind": link.kind, "ranks": list(link.ranks), "s": self.seconds[link],
                           "bytes": self.nbytes[link], "factor": round(self.factors[link], 3)}
                          for link in sorted(self.seconds)]}


class Links:
    """The timing of one rank's exchanges under a plan: the halo counters of its spatial layers (``halos``,
    ``None`` without) and the clocks of its DDP all-reduces (``clocks``), read after each step."""

    def __init__(self, config, halos, clocks):
        self.window, self.threshold = config.train.slow_window, config.train.slow_factor
        self.halos, self.clocks = halos, list(clocks)
        self.counters = ([halos] if halos is not None else []) + self.clocks  # every counter, for a ``link`` fault
        for counter in self.counters:
            counter.timed = True
        self.rank = dist.get_rank()
        self._steps: list[dict] = []  # per step: {link: (seconds of each exchange, bytes)}
        self._warm = False  # the first step (connections made, DDP's first buckets) is not timed
        self._began = 0.0
        self._before: list | None = None  # the window before, as gathered
        self._first: dict[Link, float] = {}  # a link alone of its kind: its seconds per byte when first judged
        self._strikes: dict[Link, int] = {}  # judgements in a row over the factor
        self.reported: dict[Link, float] = {}

    def _measured(self) -> dict:
        """This step's exchanges, per link: (their seconds in order, bytes this rank sent)."""
        out = {}
        if self.halos is not None:
            seconds, sent = self.halos.take()
            for peer, times in seconds.items():
                out[Link(HALO, tuple(sorted((self.rank, peer))))] = (times, sent.get(peer, 0))
        for clock in self.clocks:
            seconds, nbytes = clock.take()
            if seconds:
                order = sorted(seconds)
                out[Link(GRADIENTS, clock.ranks)] = ([t for i in order for t in seconds[i]],
                                                     sum(nbytes[i] for i in order))
        return out

    def begin(self) -> None:
        """A step starts: what was exchanged since the last step (a validation's forwards) is not its."""
        for counter in self.counters:
            counter.take()
        self._began = time.perf_counter()

    def end(self, step: int) -> LinkWindow | None:
        """Step ``step`` ended; at the end of each window from the second on (as ``pace.Pace.end``: collective, on
        every rank after the same steps), the last two windows judged."""
        step_s = time.perf_counter() - self._began
        measured = self._measured()
        if self._warm:
            self._steps.append({"links": measured, "step_s": step_s})
        self._warm = True
        if len(self._steps) < self.window:
            return None
        mine, self._steps = self._steps, []
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        before, self._before = self._before, gathered
        if before is None:
            return None
        gathered = [a + b for a, b in zip(before, gathered, strict=True)]
        seconds, nbytes = _transfers(gathered)
        took = max(statistics.median(s["step_s"] for s in steps) for steps in gathered)
        factors = {link: _factor(link, seconds, nbytes, self._first) for link in seconds}
        slow = {}
        for link, factor in factors.items():
            over = factor >= self.threshold and seconds[link] * (1 - 1 / factor) >= MATTERS * took
            self._strikes[link] = self._strikes.get(link, 0) + 1 if over else 0
            if self._strikes[link] >= PATIENCE and link not in self.reported:
                slow[link] = self.reported[link] = factor
        return LinkWindow(step, seconds, nbytes, factors, slow, took)

    def close(self) -> None:
        for counter in self.counters:
            counter.timed = False
            counter.take()


def _transfers(gathered: list) -> tuple[dict[Link, float], dict[Link, int]]:
    """Per link, its seconds of transfer in a step (per exchange, the least of the sides' seconds, its median over
    the steps; summed over the exchanges) and its bytes in a step (what every side sent)."""
    seconds, nbytes = {}, {}
    links = sorted({link for steps in gathered for step in steps for link in step["links"]})
    for link in links:
        per_step = []  # per step: each exchange's least side
        for s in range(len(gathered[0])):
            sides = [gathered[r][s]["links"][link][0] for r in link.ranks if link in gathered[r][s]["links"]]
            per_step.append([min(times) for times in zip(*sides)] if sides else [])
        seconds[link] = sum(statistics.median(exchange) for exchange in zip(*per_step))
        sent = [gathered[r][-1]["links"][link][1] for r in link.ranks if link in gathered[r][-1]["links"]]
        nbytes[link] = sent[0] if link.kind == GRADIENTS and sent else sum(sent)
    return seconds, nbytes


def _factor(link: Link, seconds: dict[Link, float], nbytes: dict[Link, int], first: dict[Link, float]) -> float:
    """``link``'s seconds per byte over the median of the other links of its kind; alone of its kind, over its
    own in the first window (kept in ``first``). 1 where there is nothing to compare."""
    rate = seconds[link] / max(nbytes[link], 1)
    peers = [seconds[o] / max(nbytes[o], 1) for o in seconds if o.kind == link.kind and o != link]
    if peers:
        reference = statistics.median(peers)
    else:
        reference = first.setdefault(link, rate)
    return rate / reference if reference > 0 else 1.0

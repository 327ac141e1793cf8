"""Faults injected on purpose, to test and show recovery: the environment variable ``HYBRIDPAR_FAULTS`` lists
``KIND:RANK@STEP`` entries, e.g. ``HYBRIDPAR_FAULTS="kill:3@5,nan:1@2"``.

- ``kill``: the rank kills itself (SIGKILL) during step ``STEP`` (1-based), after its backward pass and before
  the update, as a crashed node would;
- ``nan``: the rank's loss of step ``STEP`` becomes NaN;
- ``inf``: one of the rank's weights becomes infinite after the update of step ``STEP`` (silent corruption).

The ``i``-th fault of the list fires in restart attempt ``i`` of the elastic agent (``TORCHELASTIC_RESTART_COUNT``),
so a run restarted after a kill meets the next fault of the list, not the same one again.
"""

from __future__ import annotations

import functools
import os
import re
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridpar.errors import ConfigError

ENV = "HYBRIDPAR_FAULTS"
KINDS = ("kill", "nan", "inf")
_ENTRY = re.compile(r"^(\w+):(\d+)@(\d+)$")


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int


def planned() -> tuple[Fault, ...]:
    """The faults ``HYBRIDPAR_FAULTS`` asks for (none when it is unset); a malformed entry is a ``ConfigError``."""
    return _parse(os.environ.get(ENV, ""))


@functools.cache
def _parse(text: str) -> tuple[Fault, ...]:
    faults = []
    for entry in filter(None, re.split(r"[,\s]+", text.strip())):
        match = _ENTRY.match(entry)
        if not match or match.group(1) not in KINDS:
            raise ConfigError(f"{ENV}: {entry!r} is not KIND:RANK@STEP with KIND one of {', '.join(KINDS)}; "
                              "e.g. kill:3@5 (rank 3 dies during step 5)")
        faults.append(Fault(match.group(1), int(match.group(2)), int(match.group(3))))
    return tuple(faults)


def _due(step: int) -> str | None:
    """The kind of fault planned for this rank at ``step`` in this attempt, if any."""
    faults = planned()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt >= len(faults) or (faults[attempt].rank, faults[attempt].step) != (dist.get_rank(), step):
        return None
    return faults[attempt].kind


def after_backward(step: int, loss: torch.Tensor) -> torch.Tensor:
    """This rank's loss of step ``step``, after a ``kill`` or ``nan`` fault planned for it."""
    kind = _due(step)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    return loss * float("nan") if kind == "nan" else loss


def after_update(step: int, parameters) -> None:
    """An ``inf`` fault planned for step ``step``: one weight of this rank becomes infinite."""
    if _due(step) == "inf":
        with torch.no_grad():
            weight = next(iter(parameters))
            (weight.to_local() if isinstance(weight, DTensor) else weight).view(-1)[0] = float("inf")

"""Processes for tests of the launcher: workers that only wait, and what /proc says of a process."""

from __future__ import annotations

import os
import time
from pathlib import Path


def wait_forever(folder: str) -> None:
    """A worker that writes its pid into ``folder`` and waits, until something ends it."""
    Path(folder, f"{os.getpid()}.pid").write_text(str(os.getpid()))
    while True:
        time.sleep(1)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (not ended, not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def gone_within(pids, seconds: float) -> list[int]:
    """The processes of ``pids`` still alive after ``seconds`` (sooner once all are gone)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def descendants(pid: int) -> list[int]:
    """The processes below ``pid``: its children, theirs, and so on (from /proc)."""
    found, todo = [], [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").iterdir():
            new = [int(c) for c in (task / "children").read_text().split()]
            found += new
            todo += new
    return found

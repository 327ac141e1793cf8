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


def children(pid: int) -> list[int]:
    """The processes ``pid`` started, from each of its threads' ``children`` file in /proc. A thread or process
    may end while it is read (a busy run starts and ends helper threads all the time): what has ended has no
    children to tell of."""
    found = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    for task in tasks:
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    """The processes below ``pid``: its children, theirs, and so on (from /proc)."""
    found, todo = [], [pid]
    while todo:
        new = children(todo.pop())
        found += new
        todo += new
    return found


def command_line(pid: int) -> str:
    """The command line of ``pid``, its arguments joined by NUL; "" once it has ended."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return ""


def workers(launcher: int) -> list[int]:
    """The training workers of a local run, sorted: the descendants of the fork server that ``launcher`` (the
    ``hybridpar train`` process) started."""
    servers = [p for p in children(launcher) if "forkserver" in command_line(p)]
    return sorted(d for server in servers for d in descendants(server))

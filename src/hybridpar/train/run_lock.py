"""One run per run directory: the process that starts a run (``hybridpar train``'s launcher) holds an advisory
lock on ``run_dir/.hybridpar.lock`` for as long as the run lives, so that a second run on the same folder (a
``--resume`` started while the first still trains) is refused, naming the holder. The kernel releases the lock
when its holder dies, however it died: a lock left by a dead run is free, and taken over. The file names its
holder (JSON: pid, host, start, command) for the message, and is removed when the run ends, with ``run_dir`` if
the run created it and left nothing else there.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from hybridpar.errors import ConfigError

NAME = ".hybridpar.lock"


class RunDirBusy(ConfigError):
    """``run_dir`` is locked by a run that is alive."""


class RunDirLock:
    """A context manager holding ``run_dir``'s lock (``RunDirBusy`` if another live run holds it)."""

    def __init__(self, run_dir: Path | str):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / NAME
        self._fd: int | None = None
        self._created: list[Path] = []

    def __enter__(self) -> RunDirLock:
        self._created = [p for p in (self.run_dir, *self.run_dir.absolute().parents) if not p.exists()]
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._fd = _locked(self.path)
        except OSError as err:
            self._remove_created()
            raise ConfigError(f"run_dir = {str(self.run_dir)!r}: cannot write there ({err.strerror}); set another "
                              "run_dir") from None
        if self._fd is None:
            self._remove_created()
            raise RunDirBusy(f"run_dir = {str(self.run_dir)!r} is in use by another run ({_holder(self.path)}); "
                             "wait for it to end or stop it, or set another run_dir")
        os.ftruncate(self._fd, 0)
        os.write(self._fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                                       "command": sys.argv[1:]}).encode())
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is None:
            return
        self.path.unlink(missing_ok=True)  # still held: no other run can have locked this file meanwhile
        os.close(self._fd)
        self._fd = None
        self._remove_created()

    def _remove_created(self) -> None:
        """The folders this lock made, where they stayed empty (the run failed a check before writing)."""
        for folder in self._created:
            try:
                folder.rmdir()
            except OSError:
                return


def _locked(path: Path) -> int | None:
    """A descriptor of ``path`` locked by this process, or ``None`` where a live process holds it. A holder
    removes the file before it lets go: a lock taken on a file that was replaced meanwhile is taken again."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def _holder(path: Path) -> str:
    """``pid 123 on host h since 11:02:03: hybridpar train c.toml``, from the lock file (what it says of itself)."""
    try:
        held = json.loads(path.read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(held["since"])))
        command = " ".join(["hybridpar", *map(str, held["command"])])
        return f"pid {int(held['pid'])} on host {held['host']} since {since}: {command}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"its lock file {path} says nothing readable yet"

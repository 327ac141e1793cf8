"""One run per run directory: a second run on a folder whose run is alive is refused naming its holder, a lock
left by a dead run is taken over, and a folder the lock made is removed when the run leaves nothing in it."""

import json
import os
import signal
import subprocess
import sys

import pytest

from hybridpar.errors import ConfigError
from hybridpar.train.run_lock import NAME, RunDirBusy, RunDirLock

HOLD = """
import sys, time
from hybridpar.train.run_lock import RunDirLock
with RunDirLock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


def holder(run_dir) -> subprocess.Popen:
    """Another process holding ``run_dir``'s lock (it says so before this returns)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_second_run_is_refused_naming_the_holder(tmp_path):
    proc = holder(tmp_path / "run")
    try:
        told = (rf"run_dir = '{tmp_path / 'run'}' is in use by another run \(pid {proc.pid} on host \S+ since "
                rf"[\d-]+ [\d:]+: hybridpar .*\); wait for it to end or stop it, or set another run_dir")
        with pytest.raises(RunDirBusy, match=told):
            with RunDirLock(tmp_path / "run"):
                pass
        assert (tmp_path / "run" / NAME).exists()  # the holder's lock untouched
    finally:
        proc.kill()
        proc.wait()


def test_a_lock_left_by_a_dead_run_is_taken_over(tmp_path):
    proc = holder(tmp_path / "run")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert json.loads((tmp_path / "run" / NAME).read_text())["pid"] == proc.pid  # left behind
    with RunDirLock(tmp_path / "run") as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
        with pytest.raises(RunDirBusy):  # held by this process now: a second lock of it is refused too
            with RunDirLock(tmp_path / "run"):
                pass
    assert not (tmp_path / "run" / NAME).exists()
    assert (tmp_path / "run").is_dir()  # it was there before


def test_folders_the_lock_made_go_when_the_run_left_nothing(tmp_path):
    with RunDirLock(tmp_path / "a" / "b"):
        assert (tmp_path / "a" / "b" / NAME).exists()
    assert list(tmp_path.iterdir()) == []
    with RunDirLock(tmp_path / "a" / "b"):
        (tmp_path / "a" / "b" / "metrics.jsonl").write_text("")
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == ["metrics.jsonl"]


def test_a_run_dir_that_cannot_be_written_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="run_dir = .*file/run.*: cannot write there"):
        with RunDirLock(tmp_path / "file" / "run"):
            pass


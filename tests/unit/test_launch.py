"""The local launcher: every socket it and its workers listen on is bound to 127.0.0.1 (PyTorch's stores would
listen on every interface), the workers' return values come back, and the workers end with their launcher."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridpar.launch import launch_local, loopback_store
from support.processes import descendants, gone_within

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def listening(pid: int) -> set[tuple[str, int]]:
    """The (address, port) pairs process ``pid`` listens on over TCP, from /proc."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                address, port = fields[1].split(":")
                found.add((_address(address), int(port, 16)))
    return found


def _address(hex_address: str) -> str:
    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words)


def worker_sockets() -> dict:
    from hybridpar.launch import init_distributed, shutdown_distributed

    init_distributed()
    import torch.distributed as dist

    dist.barrier()  # every worker's connections are up
    mine, rank = listening(os.getpid()) | listening(os.getppid()), dist.get_rank()
    dist.barrier()
    shutdown_distributed()
    return {"rank": rank, "listening": sorted(mine)}


def test_stores_and_workers_listen_on_loopback_only():
    results = launch_local(worker_sockets, (), 2)
    assert [results[r]["rank"] for r in (0, 1)] == [0, 1]
    everything = {address for r in results.values() for address, _ in r["listening"]}
    assert everything == {"127.0.0.1"}, results
    assert len(results[0]["listening"]) >= 2  # the agent's stores (the parent's), and gloo's own


def test_a_loopback_store_serves_clients():
    import torch.distributed as dist

    store, listener = loopback_store()
    try:
        assert listening(os.getpid()) >= {("127.0.0.1", listener.getsockname()[1])}
        store.set("key", "value")
        client = dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=False)
        assert client.get("key") == b"value"
    finally:
        listener.close()


_LAUNCHER = """
import sys
from hybridpar.launch import launch_local
from support.processes import wait_forever
launch_local(wait_forever, (sys.argv[1],), 2, preload=tuple(sys.argv[2:]))
"""


@pytest.mark.parametrize("start", ["forked by a fork server", "spawned"])
def test_workers_end_with_their_launcher_however_it_ends(tmp_path, start):
    """SIGKILL to the launcher (what the OOM killer sends): its workers, and the fork server, end within seconds."""
    preload = ["support.processes"] if start.startswith("forked") else []
    tests = str(Path(__file__).parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")]))
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(tmp_path), *preload], env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = [int(p.stem) for p in tmp_path.glob("*.pid")]
        assert len(workers) == 2
        others = [p for p in descendants(launcher.pid) if p not in workers]  # the fork server, the resource tracker
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        assert gone_within(workers + others, 30) == []
    finally:
        subprocess.run(["pkill", "-KILL", "-s", str(launcher.pid)], check=False)

"""``hybridpar calibrate`` on the device at hand: how each device type is measured (timer, cache flushing, shared
cores, memory probe, slow conv kernel), which device the workers take (their mesh's), and the "measured: ..." line
of the report and of the TOML file's header. The GPU's own test is marked ``gpu`` (benchmarks/gpu_check.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from hybridpar.calibrate import calibrate, default_nproc
from hybridpar.calibrate.device import METHODS, Measured, measured_line, method_for
from hybridpar.calibrate.fit import to_calibration
from hybridpar.calibrate.report import summary
from hybridpar.calibrate.settings import FAST_CONV_MIN, Settings
from hybridpar.calibrate.timing import Clock
from hybridpar.errors import HybridparError
from hybridpar.plan.io import cluster_from_toml, cluster_to_toml
from support.harness import limit

CPU2 = Measured(2, "cpu", "gloo", cores=2)
H100 = Measured(4, "cuda", "nccl", "NVIDIA H100 80GB HBM3")


def test_cpu_workers_flush_caches_share_cores_and_read_proc_a_gpu_uses_events_and_its_own_memory():
    cpu, cuda = method_for("cpu"), method_for("cuda")
    assert (cpu.timer, cpu.flush_caches, cpu.shares_host, cpu.memory, cpu.slow_conv) == (
        "perf_counter", True, True, "proc", True)
    assert (cuda.timer, cuda.flush_caches, cuda.shares_host, cuda.memory, cuda.slow_conv) == (
        "cuda_events", False, False, "cuda", False)
    assert Settings().method == cpu and Settings(device="cuda:3").method == cuda  # a worker's device, index and all
    with pytest.raises(HybridparError, match=r"measures cpu and cuda devices, not 'xpu'"):
        method_for("xpu")
    assert set(METHODS) == {"cpu", "cuda"}


def test_the_cpu_clock_is_the_hosts():
    clock = Clock(Settings())
    clock.start()
    time.sleep(0.02)
    assert 0.02 <= clock.stop() < 1.0


def test_the_measured_line_names_the_devices_their_type_and_backend():
    assert str(CPU2) == "2 CPU workers on 2 cores (cpu, gloo)"
    assert str(Measured(1, "cpu", "gloo", cores=1)) == "1 CPU worker on 1 core (cpu, gloo)"
    assert str(H100) == "4 × NVIDIA H100 80GB HBM3 (cuda, nccl)"
    assert measured_line(CPU2, CPU2) == "measured: 2 CPU workers on 2 cores (cpu, gloo)"
    one_gpu = Measured(1, "cuda", "nccl", "NVIDIA H100 80GB HBM3")
    assert measured_line(one_gpu, Measured(2, "cpu", "gloo", cores=16)) == (
        "measured: 1 × NVIDIA H100 80GB HBM3 (cuda, nccl); communication: 2 CPU workers on 16 cores (cpu, gloo)")
    assert (CPU2.spec_suffix, H100.spec_suffix) == ("2proc", "4gpu")


def _result(measured: Measured, slow: bool) -> dict:
    """A worker's numbers as ``calibrate.worker`` returns them (quick sizes; times of exact latency-bandwidth lines)."""
    sizes = Settings(quick=True).sizes
    ring = [1e-5 + b / 1e9 for b in sizes]
    grid = [(cin, cout, positions, 1e9, 2e9, 3e9)
            for cin in (1, 16) for cout in (4, 64) for positions in (2**11, 2**14)]
    return {"p2p_times": [2e-6 + b / 5e9 for b in sizes], "collective_ranks": measured.count, "sync_wait": 1e-4,
            "collective_times": {kind: ring for kind in ("all_reduce", "all_gather", "reduce_scatter")},
            "matmul_flops": 1e11, "conv_flops": 5e10, "memory_bandwidth": 1e10, "conv_rates": grid,
            "slow_conv_rates": grid if slow else [], "op_rates": [("MaxPool3d", 2**20, 1e9, 2e9)],
            "device_memory": 8 * 2**30, "reserved_memory": 2**29,
            "compute_measured": measured, "comm_measured": measured}


@pytest.mark.parametrize("measured, slow", [(CPU2, True), (H100, False)], ids=["cpu", "cuda"])
def test_the_report_and_the_written_spec_say_what_was_measured(measured, slow):
    cal = to_calibration(_result(measured, slow), measured.count, Settings(quick=True), [])
    assert cal.measured == f"measured: {measured}"
    toml = cluster_to_toml(cal.spec, comment=cal.comment)
    assert f"# measured: {measured}\n" in toml  # the header of the file calibrate writes
    spec = cluster_from_toml(toml)  # and it loads, as a file without the line does
    assert spec == cal.spec and spec.name.endswith(f"-{measured.spec_suffix}")
    assert spec.device_memory == 8 * 2**30 and spec.devices_per_node == measured.count
    # the slow batch-1 kernel is PyTorch's CPU kernel: measured there, and not on a GPU (both or neither)
    assert (spec.fast_conv_min, len(spec.slow_conv_rates)) == ((FAST_CONV_MIN, 8) if slow else (0, 0))
    memory = next(row for row in summary(cal) if row[0].startswith("device memory"))[0]
    assert memory == ("device memory (MemTotal / N)" if measured.device_type == "cpu" else
                      "device memory (the GPU total)")


def test_on_a_gpu_node_calibrate_takes_one_worker_per_gpu_and_refuses_more(monkeypatch):
    """The workers' device comes from hybridpar.mesh.accelerator_type: told there is no accelerator, then 4 CUDA
    GPUs."""
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert default_nproc() == (os.cpu_count() or 1)  # one CPU worker per core
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 4)
    assert default_nproc() == 4
    with pytest.raises(HybridparError, match=r"--nproc 8: this machine has 4 cuda device\(s\), one worker each; "
                                             r"give --nproc 4 or fewer"):
        calibrate(8, quick=True)  # before any worker starts


# One worker on its own (a process group of 1): its mesh's device, the backend, the clock, the memory probes.
_ONE_WORKER = """
import json, os, torch
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT="0")
from hybridpar.calibrate import on_mesh
from hybridpar.calibrate.memory import device_bytes, runtime_bytes
from hybridpar.calibrate.settings import Settings
from hybridpar.calibrate.timing import Clock
from hybridpar.launch import init_distributed, shutdown_distributed
init_distributed()
settings, measured = on_mesh(Settings(quick=True))
a = torch.randn(2048, 2048, device=settings.device)
clock = Clock(settings)
a @ a
clock.start()
a @ a
seconds = clock.stop()
out = {"device": settings.device, "measured": str(measured), "timer": settings.method.timer, "seconds": seconds,
       "reserved": runtime_bytes(settings), "memory": device_bytes(settings, 1)}
shutdown_distributed()
print(json.dumps(out))
"""


def _one_worker(env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", _ONE_WORKER], capture_output=True, text=True, timeout=limit(240),
                         env=os.environ | env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_a_cpu_worker_measures_on_the_cpu_over_gloo():
    got = _one_worker({"CUDA_VISIBLE_DEVICES": ""})  # the CPU path, on a GPU node too
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert got["device"] == "cpu" and got["timer"] == "perf_counter"
    assert got["measured"] == f"1 CPU worker on {cores} core{'s' if cores != 1 else ''} (cpu, gloo)"
    assert got["seconds"] > 0 and 0 < got["reserved"] < got["memory"]  # the resident set; MemTotal / 1


@pytest.mark.gpu
def test_a_gpu_worker_measures_on_its_gpu_over_nccl():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU here (benchmarks/gpu_check.sh runs this test on a GPU machine)")
    got = _one_worker({})
    assert got["device"] == "cuda:0" and got["timer"] == "cuda_events"
    assert got["measured"] == f"1 × {torch.cuda.get_device_name(0)} (cuda, nccl)"
    # a 2048^3 matmul (17 GFLOP) timed on the device: more than a launch, less than a second on any CUDA GPU
    assert 1e-5 < got["seconds"] < 1.0
    # the GPU's memory, and what the CUDA context and NCCL took of it before any model (hundreds of MiB)
    assert 0.9 < got["memory"] / torch.cuda.get_device_properties(0).total_memory <= 1
    assert 2**24 < got["reserved"] < got["memory"] / 2

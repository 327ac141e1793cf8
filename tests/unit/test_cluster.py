"""Cluster specs: presets, scaling to n devices, validation, the TOML form (exact round trip, errors that
name the file and the key), and ``hybridpar calibrate`` writing a file that reads back."""

from __future__ import annotations

import dataclasses
import itertools
import math
import platform
import resource
import subprocess
import sys

import pytest
import torch

from hybridpar.calibrate.compute import _large_row
from hybridpar.calibrate.fit import fit_p2p, fit_ring
from hybridpar.calibrate.settings import LARGE_FACTOR, Settings
from hybridpar.cli import main
from hybridpar.errors import ClusterError, HybridparError
from hybridpar.plan.cluster import GB, PRESETS, TFLOPS, GiB, Link, preset
from hybridpar.plan.io import cluster_from_toml, cluster_to_toml, load_cluster, write_cluster
from hybridpar.plan.rates import ConvRate, OpRate

A100 = PRESETS["a100-80"]


def peak(name: str, dtype: str) -> float:
    return PRESETS[name].peak_flops[dtype]


# --- presets ---


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_are_one_node_of_eight(name):
    spec = preset(name)
    assert spec.name == name and spec.num_nodes == 1 and spec.devices_per_node == 8 and spec.num_devices == 8
    assert 0 < spec.reserved_memory < spec.device_memory
    assert spec.inter_node.bandwidth < spec.intra_node.bandwidth  # NICs are shared by the node's devices
    assert 1e-6 <= spec.intra_node.latency <= 1e-5 and 1e-6 <= spec.inter_node.latency <= 1e-5
    for dtype in spec.peak_flops:
        assert spec.flops(dtype, "conv") < spec.flops(dtype, "matmul") <= spec.peak_flops[dtype]


def test_presets_compare_as_the_data_sheets_say():
    assert peak("h100", "bfloat16") > peak("a100-80", "bfloat16") > peak("v100", "float16")
    assert peak("h100", "float64") > peak("mi250x", "float64") > peak("a100-80", "float64") > peak("v100", "float64")
    assert peak("a100-40", "float32") == peak("a100-80", "float32") == 19.5 * TFLOPS
    memory = {name: spec.device_memory / GiB for name, spec in PRESETS.items()}
    assert memory == {"v100": 32, "a100-40": 40, "a100-80": 80, "h100": 80, "h200": 140, "mi250x": 64}
    hbm = [PRESETS[n].memory_bandwidth for n in ("v100", "a100-40", "a100-80", "h100", "h200")]
    assert hbm == sorted(hbm) and PRESETS["h200"].memory_bandwidth == 4800 * GB
    assert PRESETS["a100-80"].intra_node.bandwidth == 300 * GB and PRESETS["a100-80"].inter_node.bandwidth == 25 * GB
    assert PRESETS["h100"].inter_node.bandwidth == 50 * GB  # 8 x 400 Gb/s NDR for 8 GPUs


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ClusterError, match="unknown cluster preset 'a100'; presets: v100, a100-40, a100-80"):
        preset("a100")


# --- ClusterSpec ---


def test_flops_and_a_missing_dtype():
    assert A100.flops("bfloat16", "matmul") == 312 * TFLOPS * 0.6
    assert A100.flops("float32", "conv") == 19.5 * TFLOPS * 0.45
    with pytest.raises(ClusterError, match="'v100' has no peak FLOP/s for dtype 'bfloat16'; it knows float64, "
                                           "float32, float16"):
        PRESETS["v100"].flops("bfloat16", "matmul")
    with pytest.raises(ClusterError, match="compute kind 'attention' is unknown; use matmul, conv"):
        A100.flops("float32", "attention")


def test_with_devices():
    four = A100.with_devices(4)
    assert (four.num_nodes, four.devices_per_node, four.num_devices) == (1, 4, 4)
    assert A100.with_devices(8) == A100
    big = A100.with_devices(2048)
    assert (big.num_nodes, big.devices_per_node) == (256, 8)
    assert big.peak_flops == A100.peak_flops and big.inter_node == A100.inter_node and big.name == A100.name


@pytest.mark.parametrize("n, message", [
    (2050, "2,050 devices: not a whole number of 8-device a100-80 nodes; use a multiple of 8 (e.g. 2,048 or 2,056)"),
    (12, "12 devices: not a whole number of 8-device a100-80 nodes; use a multiple of 8"),
    (0, "0 devices: give a whole number >= 1"),
])
def test_with_devices_errors(n, message):
    with pytest.raises(ClusterError, match=message.replace("(", r"\(").replace(")", r"\)")):
        A100.with_devices(n)


def test_link_choice():
    assert A100.link(8, spans_nodes=False) is A100.intra_node
    assert A100.link(16, spans_nodes=True) is A100.inter_node
    with pytest.raises(ClusterError, match="a group of 16 devices cannot stay inside one 8-device a100-80 node"):
        A100.link(16, spans_nodes=False)


def test_link_collective_fallbacks():
    link = Link(bandwidth=100 * GB, latency=3e-6)
    assert (link.bus_bandwidth, link.step_latency) == (100 * GB, 3e-6)
    link = Link(bandwidth=100 * GB, latency=3e-6, collective_bandwidth=80 * GB, collective_latency=5e-6)
    assert (link.bus_bandwidth, link.step_latency) == (80 * GB, 5e-6)
    assert link.collective("all_reduce") == link.collective("all_gather") == link.collective("reduce_scatter")
    link = dataclasses.replace(link, reduce_scatter_bandwidth=20 * GB, all_gather_latency=9e-6)
    assert link.collective("reduce_scatter") == (5e-6, 20 * GB) and link.collective("all_gather") == (9e-6, 80 * GB)


def test_specs_are_frozen_and_hashable():
    same = dataclasses.replace(A100, peak_flops=dict(A100.peak_flops))
    assert same == A100 and hash(same) == hash(A100) and len({same, A100, PRESETS["h100"]}) == 2
    with pytest.raises(TypeError):
        A100.peak_flops["float32"] = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        A100.num_nodes = 2


@pytest.mark.parametrize("change, field", [
    ({"num_nodes": 0}, "num_nodes = 0"),
    ({"devices_per_node": 2.0}, "devices_per_node = 2.0"),
    ({"device_memory": -1.0}, "ClusterSpec 'a100-80': device_memory = -1.0: must be a positive"),
    ({"memory_bandwidth": math.inf}, "memory_bandwidth = inf"),
    ({"reserved_memory": -1.0}, "reserved_memory = -1.0"),
    ({"reserved_memory": 80 * GiB}, "reserved_memory (80 GiB) leaves nothing of device_memory"),
    ({"peak_flops": {}}, "peak_flops is empty"),
    ({"peak_flops": {"float8": 1e15}}, "peak_flops['float8']: unknown dtype"),
    ({"peak_flops": {"float32": 0.0}}, "ClusterSpec 'a100-80': peak_flops.float32 = 0.0"),
    ({"peak_flops": None}, "peak_flops = None: must be a mapping"),
    ({"efficiency": {"matmul": 0.6}}, "efficiency has keys matmul; give exactly matmul, conv"),
    ({"efficiency": {"matmul": 1.5, "conv": 0.4}}, "efficiency.matmul = 1.5: a fraction of peak"),
    ({"efficiency": {"matmul": 0.6, "conv": 0}}, "efficiency.conv = 0"),
    ({"intra_node": "nvlink"}, "intra_node = 'nvlink': must be a Link"),
    ({"name": ""}, "ClusterSpec.name = ''"),
])
def test_validation_names_the_field(change, field):
    with pytest.raises(ClusterError) as err:
        dataclasses.replace(A100, **change)
    assert field in str(err.value)


@pytest.mark.parametrize("kwargs, field", [
    ({"bandwidth": 0, "latency": 1e-6}, "Link.bandwidth = 0"),
    ({"bandwidth": 1e9, "latency": math.nan}, "Link.latency = nan"),
    ({"bandwidth": 1e9, "latency": 1e-6, "collective_bandwidth": -1}, "Link.collective_bandwidth = -1"),
])
def test_link_validation(kwargs, field):
    with pytest.raises(ClusterError, match=field):
        Link(**kwargs)


# --- TOML ---


@pytest.mark.parametrize("name", list(PRESETS))
def test_toml_round_trip_of_every_preset(name, tmp_path):
    spec = PRESETS[name].with_devices(64)
    assert cluster_from_toml(cluster_to_toml(spec)) == spec
    write_cluster(spec, tmp_path / "sub" / "c.toml", comment="a comment\nof two lines")
    assert load_cluster(str(tmp_path / "sub" / "c.toml")) == spec


def test_toml_round_trip_is_exact_for_awkward_numbers():
    link = Link(bandwidth=1 / 3 * GB, latency=0.1 + 0.2, collective_bandwidth=1e-7, collective_latency=7.123456789e-6,
                all_gather_bandwidth=2 / 3 * GB, reduce_scatter_latency=1 / 9 * 1e-3)
    spec = dataclasses.replace(A100, name='odd "name" \\ tab\t', device_memory=math.pi * GiB,
                               reserved_memory=0.0, memory_bandwidth=2039.000000001 * GB,
                               peak_flops={"float64": 1 / 7 * TFLOPS, "float16": 123456789.123456789e12},
                               efficiency={"matmul": 0.1 + 0.2, "conv": 1.0}, intra_node=link)
    back = cluster_from_toml(cluster_to_toml(spec))
    assert back == spec and back.intra_node.latency == 0.1 + 0.2


def test_the_documented_example_reads():
    spec = cluster_from_toml(EXAMPLE)
    assert spec.device_memory == 80 * GiB and spec.memory_bandwidth == 2039e9 and spec.peak_flops["float16"] == 312e12
    assert spec.intra_node.bus_bandwidth == 240e9 and spec.intra_node.step_latency == 5e-6
    assert spec.inter_node.step_latency == spec.inter_node.latency == 5e-6


def test_load_cluster_of_a_preset_name_and_of_a_path(tmp_path):
    assert load_cluster("h100") is PRESETS["h100"]
    (tmp_path / "mine.toml").write_text(EXAMPLE)
    assert load_cluster(tmp_path / "mine.toml") == cluster_from_toml(EXAMPLE)


EXAMPLE = """
name = "a100-80"
nodes = 1
devices_per_node = 8
device_memory_gib = 80
reserved_memory_gib = 2.0
memory_bandwidth_gbs = 2039      # GB/s = 1e9 bytes/s
[peak_tflops]
float64 = 19.5
float32 = 19.5
bfloat16 = 312
float16 = 312
[efficiency]
matmul = 0.6
conv = 0.45
[intra_node]
bandwidth_gbs = 300
latency_us = 3
collective_bandwidth_gbs = 240
collective_latency_us = 5
[inter_node]
bandwidth_gbs = 25
latency_us = 5
"""


@pytest.mark.parametrize("old, new, message", [
    ("bandwidth_gbs = 300", 'bandwidth_gbs = "fast"', 'intra_node.bandwidth_gbs = "fast": expected a number'),
    ("bandwidth_gbs = 300", "bandwith_gbs = 300", "unknown key intra_node.bandwith_gbs; [intra_node] takes "
                                                  "bandwidth_gbs, latency_us"),
    ("nodes = 1", "nodes = 1\ncolour = 1", "unknown key colour; the top level takes name, nodes"),
    ("bandwidth_gbs = 25\nlatency_us = 5", "bandwidth_gbs = 25", "missing key inter_node.latency_us (microseconds)"),
    ("device_memory_gib = 80", "", "missing key device_memory_gib (GiB"),
    ("\nfloat16 = 312", "\nfloat8 = 1000", "unknown key peak_tflops.float8; [peak_tflops] takes float64"),
    ("conv = 0.45", "conv = 1.5", "efficiency.conv = 1.5: a fraction of peak, in (0, 1]"),
    ("conv = 0.45", "", "missing key efficiency.conv"),
    ("nodes = 1", "nodes = 2.5", "nodes = 2.5: expected a whole number >= 1"),
    ("nodes = 1", "nodes = true", "nodes = true: expected a whole number >= 1"),
    ("memory_bandwidth_gbs = 2039", "memory_bandwidth_gbs = -2039",
     "memory_bandwidth_gbs = -2039: must be a finite number greater than 0 (GB/s, 1e9 bytes/s)"),
    ("memory_bandwidth_gbs = 2039", "memory_bandwidth_gbs = nan", "memory_bandwidth_gbs = NaN: must be a finite"),
    ("reserved_memory_gib = 2.0", "reserved_memory_gib = 90", "reserved_memory_gib = 90 leaves nothing of "
                                                              "device_memory_gib = 80"),
    ('name = "a100-80"', "name = 80", "name = 80: expected a non-empty string"),
    ("[inter_node]\nbandwidth_gbs = 25\nlatency_us = 5\n", "", "missing table [inter_node]"),
    ('name = "a100-80"', 'inter_node = 3\nname = "a100-80"', "inter_node = 3: expected a table [inter_node]"),
    ("nodes = 1", "nodes = = 1", "not valid TOML"),
    ("nodes = 1", "nodes = 100000000000000000", "nodes = 100000000000000000: more than 1,048,576 devices"),
    ("nodes = 1", "nodes = 200000", "200,000 nodes of 8 devices make 1,600,000 devices, more than 1,048,576"),
])
def test_toml_errors_name_the_file_and_the_key(tmp_path, old, new, message):
    assert old in EXAMPLE
    path = tmp_path / "cluster.toml"
    text = EXAMPLE.replace(old, new, 1)
    if "inter_node = 3" in text:  # a value where a table is expected; the table itself must go
        text = text.replace("[inter_node]\nbandwidth_gbs = 25\nlatency_us = 5\n", "")
    path.write_text(text)
    with pytest.raises(ClusterError) as err:
        load_cluster(str(path))
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value), str(err.value)


@pytest.mark.parametrize("group, message", [
    ("cluster = 5\nnodes = 1", 'group[0].cluster = 5: give a preset name (v100, a100-40, a100-80, h100, h200, '
                               'mi250x) or the path of a cluster TOML file, as a string, e.g. cluster = "a100-80"'),
    ('cluster = "a100-80"\nnodes = 100000000000000000',
     "group[0].nodes = 100000000000000000: more than 1,048,576 devices (ten times the largest machines built)"),
    ('cluster = "a100-80"\nnodes = 100000\n[[group]]\ncluster = "h100"\nnodes = 100000',
     "its groups make 1,600,000 devices, more than 1,048,576"),
])
def test_group_errors_name_the_key_and_what_it_takes(tmp_path, group, message):
    path = tmp_path / "mixed.toml"
    path.write_text(f'name = "mixed"\n[[group]]\n{group}\n')
    with pytest.raises(ClusterError) as err:
        load_cluster(str(path))
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value), str(err.value)


def test_device_counts_are_bounded():
    with pytest.raises(ClusterError, match="2,097,152 devices: more than 1,048,576"):
        A100.with_devices(2**21)
    assert A100.with_devices(2**20).num_devices == 2**20


def test_missing_file_names_the_file_and_the_presets(tmp_path):
    with pytest.raises(ClusterError, match=r"nope\.toml: no such file, and not a preset name; presets: v100, "):
        load_cluster(str(tmp_path / "nope.toml"))


# --- calibrate ---


def test_fits_recover_the_model():
    sizes = tuple(4 * 4**i for i in range(13))
    p2p = tuple(20e-6 + b / 3e9 for b in sizes)
    latency, bandwidth = fit_p2p(sizes, p2p)
    assert latency == pytest.approx(20e-6, rel=1e-3) and bandwidth == pytest.approx(3e9, rel=1e-6)
    n = 4
    ring = tuple(2 * (n - 1) * 50e-6 + 2 * (n - 1) / n * b / 1.5e9 for b in sizes)
    step_latency, bus_bandwidth = fit_ring(sizes, ring, n)
    assert step_latency == pytest.approx(50e-6, rel=1e-3) and bus_bandwidth == pytest.approx(1.5e9, rel=1e-6)
    half = tuple((n - 1) * 70e-6 + (n - 1) / n * b / 0.5e9 for b in sizes)  # an all-gather / reduce-scatter
    step_latency, bus_bandwidth = fit_ring(sizes, half, n, "reduce_scatter")
    assert step_latency == pytest.approx(70e-6, rel=1e-3) and bus_bandwidth == pytest.approx(0.5e9, rel=1e-6)
    with pytest.raises(HybridparError, match="point-to-point times did not grow with the message size"):
        fit_p2p(sizes, tuple(1e-3 for _ in sizes))


def test_the_large_positions_row_is_measured_for_thin_pairs_and_scaled_from_the_nearest_for_wide_ones():
    settings = Settings(quick=True)  # in (1, 16) x out (4, 64) x positions (2**11, 2**14)
    largest = settings.largest_positions
    assert settings.large_conv_pairs == ((1, 4), (16, 4))  # at most LARGE_CHANNELS in and out
    rates = {point: (float(point[0] * point[1]), 2.0, 3.0) for point in settings.conv_grid}
    measured = {(1, 4): (2.0, 1.0, 1.5), (16, 4): (32.0, 2.0, 6.0)}
    rows = {row[:3]: row[3:] for row in _large_row(settings, rates, measured)}
    assert set(rows) == {(cin, cout, LARGE_FACTOR * largest) for cin in (1, 16) for cout in (4, 64)}
    assert rows[1, 4, LARGE_FACTOR * largest] == (2.0, 1.0, 1.5)  # as measured
    # 1 -> 64 from 1 -> 4 (half the forward rate, half the input gradient's, the weight gradient's alike)
    assert rows[1, 64, LARGE_FACTOR * largest] == pytest.approx((64 * 0.5, 2.0 * 0.5, 3.0 * 0.5))
    assert rows[16, 64, LARGE_FACTOR * largest] == pytest.approx((1024 * 0.5, 2.0 * 1.0, 3.0 * 2.0))  # from 16 -> 4


_FAULTS_OF_A_FRESH_TENSOR = """
import resource, sys, torch
from hybridpar.calibrate.memory import allocate_as_in_training
if sys.argv[1] == "raised":
    allocate_as_in_training()
torch.empty(2**24, dtype=torch.uint8).fill_(1)  # 16 MiB allocated, touched and freed
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(2**24, dtype=torch.uint8).fill_(1)  # again: the same pages from the heap, or fresh ones
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mmap threshold")
def test_calibrate_measures_with_the_allocator_of_a_training_worker():
    # a fresh process maps a 16 MiB tensor afresh each time (4,096 pages, each faulting on first touch); once
    # a large mapped block was freed, as a training step frees its activations, it comes back from the heap
    faults = {state: int(subprocess.run([sys.executable, "-c", _FAULTS_OF_A_FRESH_TENSOR, state], check=True,
                                        capture_output=True, text=True).stdout)
              for state in ("fresh", "raised")}
    pages = 2**24 // resource.getpagesize()
    assert faults["fresh"] > pages // 2 and faults["raised"] < pages // 16, faults


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_calibrate_writes_a_file_that_loads_and_refuses_to_overwrite(tmp_path, capsys, monkeypatch):
    # CPU workers (what this test checks: their name, the slow conv kernel), on a GPU machine too
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    out = tmp_path / "tmp" / "cluster.toml"
    assert main(["calibrate", "--quick", "--nproc", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "point-to-point latency" in printed and "measured: 2 CPU workers on" in printed
    spec = load_cluster(str(out))
    assert spec.name.startswith("calibrated-") and spec.name.endswith("-2proc")
    assert (spec.num_nodes, spec.devices_per_node) == (1, 2) and spec.inter_node == spec.intra_node
    assert spec.efficiency["matmul"] == 1.0 and 0 < spec.efficiency["conv"] <= 1
    assert 1e8 < spec.peak_flops["float32"] < 1e14 and 1e8 < spec.memory_bandwidth < 1e13
    assert 0 < spec.reserved_memory < spec.device_memory
    # the quick conv grid (2 x 2 x 2 points) and the row scaled to 8x its largest positions; two sizes per op
    assert len(spec.conv_rates) == 12 and {r.positions for r in spec.conv_rates} == {2**11, 2**14, 2**17}
    # the slow kernel's quick grid; a thin batch-1 conv runs slower on it than on the fast one
    assert spec.fast_conv_min == 20480 and len(spec.slow_conv_rates) == 8
    slow, fast = (spec.conv_flops("float32", 16, 64, 2**13, work=work)[0] for work in (16 * 16 * 16, 0))
    assert slow < fast
    ops = [r.op for r in spec.op_rates]
    assert {"MaxPool3d", "InstanceNorm3d", "ConvTranspose3d", "add", "cat", "LayerNorm"} <= set(ops)
    assert all(ops.count(op) == 2 for op in ops)
    link = spec.intra_node
    assert 0 < link.latency < 0.1 and 0 < link.step_latency < 0.1 and link.bandwidth > 1e6 and link.bus_bandwidth > 1e6
    for kind in ("all_gather", "reduce_scatter"):  # measured, not the all-reduce's
        assert getattr(link, f"{kind}_bandwidth") > 1e6 and 0 < getattr(link, f"{kind}_latency") < 0.1
    assert "inter_node = intra_node" in out.read_text()

    before = out.read_text()
    assert main(["calibrate", "--quick", "--nproc", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out} exists; pass --overwrite" in err and "Traceback" not in err
    assert out.read_text() == before


def _grid(rate) -> tuple[ConvRate, ...]:
    """A float32 conv grid: in (1, 16) x out (4, 64) x positions (2**10, 2**20), rates from ``rate(point)``."""
    points = itertools.product((1, 16), (4, 64), (2**10, 2**20))
    return tuple(ConvRate("float32", *p, *rate(p)) for p in points)


def test_conv_rates_round_trip_and_interpolate_in_log_space():
    # forward 1e9 * in * out, input gradient constant, weight gradient halving as positions grow 1024x
    rows = _grid(lambda p: (1e9 * p[0] * p[1], 5e9, 8e9 if p[2] == 2**10 else 4e9))
    spec = dataclasses.replace(preset("a100-80"), conv_rates=rows[::-1])
    assert spec.conv_rates == tuple(sorted(rows))  # kept sorted
    assert cluster_from_toml(cluster_to_toml(spec)) == spec
    assert spec.conv_flops("float32", 1, 4, 2**10) == pytest.approx((4e9, 5e9, 8e9))  # a grid point
    # half way in log2 along every axis: the geometric mean of the corners
    assert spec.conv_flops("float32", 4, 16, 2**15) == pytest.approx((1e9 * 4 * 16, 5e9, 8e9 / 2**0.5))
    assert spec.conv_flops("float32", 256, 1024, 2**30) == pytest.approx((1e9 * 16 * 64, 5e9, 4e9))  # clamped
    # PyTorch's slow CPU kernel (a batch of one, N*C*D*H up to fast_conv_min): its own grid, here a quarter
    quarter = [dataclasses.replace(r, forward=r.forward / 4, input_grad=r.input_grad / 4, weight_grad=r.weight_grad / 4)
               for r in rows]
    slow = dataclasses.replace(spec, fast_conv_min=20480, slow_conv_rates=quarter)
    assert cluster_from_toml(cluster_to_toml(slow)) == slow
    assert slow.conv_flops("float32", 1, 4, 2**10, work=4096) == pytest.approx((1e9, 1.25e9, 2e9))
    assert slow.conv_flops("float32", 4, 16, 2**15, work=4096) == pytest.approx((16e9, 1.25e9, 2e9 / 2**0.5))
    assert slow.conv_flops("float32", 1, 4, 2**10, work=40960) == pytest.approx((4e9, 5e9, 8e9))
    assert slow.conv_flops("float32", 1, 4, 2**10) == pytest.approx((4e9, 5e9, 8e9))  # work 0: not a slow conv
    # other dtypes, and specs without rows: efficiency.conv of the peak (TF32 for float32 where the device has it)
    assert spec.conv_flops("bfloat16", 3, 3, 10) == (spec.flops("bfloat16", "conv"),) * 3
    plain = preset("a100-80")
    assert plain.conv_flops("float32", 3, 3, 10) == (plain.flops("tfloat32", "conv"),) * 3
    assert preset("v100").conv_flops("float32", 3, 3, 10) == (preset("v100").flops("float32", "conv"),) * 3


def test_conv_rates_are_checked():
    with pytest.raises(ClusterError, match=r"conv_rates\[float32, 4 -> 8, 64 positions\].forward = -1"):
        ConvRate("float32", 4, 8, 64, -1.0, 1.0, 1.0)
    with pytest.raises(ClusterError, match=r"unknown dtype 'float8'"):
        ConvRate("float8", 4, 8, 64, 1.0, 1.0, 1.0)
    with pytest.raises(ClusterError, match=r"lacks \(in, out, positions\) = \(16, 64, 1048576\)"):
        dataclasses.replace(preset("a100-80"), conv_rates=_grid(lambda p: (1.0, 1.0, 1.0))[:-1])
    with pytest.raises(ClusterError, match=r"slow_conv_rates for float32 lacks \(in, out, positions\)"):
        dataclasses.replace(preset("a100-80"), fast_conv_min=20480,
                            slow_conv_rates=_grid(lambda p: (1.0, 1.0, 1.0))[1:])
    with pytest.raises(ClusterError, match=r"fast_conv_min is given without slow_conv_rates; give both"):
        dataclasses.replace(preset("a100-80"), fast_conv_min=20480)
    with pytest.raises(ClusterError, match=r"slow_conv_rates is given without fast_conv_min"):
        dataclasses.replace(preset("a100-80"), slow_conv_rates=_grid(lambda p: (1.0, 1.0, 1.0)))
    with pytest.raises(ClusterError, match=r"old.toml: slow_conv_factor is no longer read.*rerun `hybridpar calib"):
        cluster_from_toml("fast_conv_min = 20480\nslow_conv_factor = 0.1\n" + cluster_to_toml(preset("a100-80")),
                          "old.toml")
    text = cluster_to_toml(preset("a100-80")) + '\n[[conv_rates]]\ndtype = "float32"\nin_channels = 4\n'
    with pytest.raises(ClusterError, match=r"c.toml: missing key conv_rates\[0\].out_channels"):
        cluster_from_toml(text, "c.toml")


def test_sync_wait_round_trips_and_is_checked():
    link = Link(bandwidth=2e9, latency=1e-4, sync_wait=2e-3)
    spec = dataclasses.replace(preset("a100-80"), intra_node=link)
    assert cluster_from_toml(cluster_to_toml(spec)).intra_node == link
    assert "sync_wait_us = 2000" in cluster_to_toml(spec) and "sync_wait" not in cluster_to_toml(preset("a100-80"))
    with pytest.raises(ClusterError, match=r"Link.sync_wait = -1"):
        Link(bandwidth=1.0, latency=1.0, sync_wait=-1)
    text = cluster_to_toml(spec).replace("sync_wait_us = 2000", "sync_wait_us = -3")
    with pytest.raises(ClusterError, match=r"c.toml: intra_node.sync_wait_us = -3: must be a finite number >= 0"):
        cluster_from_toml(text, "c.toml")


def test_op_rates_interpolate_by_size_and_fall_back_to_the_memory_bandwidth():
    rows = (OpRate("MaxPool3d", 2**20, 8e9, 16e9), OpRate("MaxPool3d", 2**26, 2e9, 4e9))
    spec = dataclasses.replace(preset("a100-80"), op_rates=rows[::-1])
    assert cluster_from_toml(cluster_to_toml(spec)) == spec
    assert spec.op_rate("MaxPool3d", 2**20) == pytest.approx((8e9, 16e9))
    assert spec.op_rate("MaxPool3d", 2**23) == pytest.approx((4e9, 8e9))  # half way in log2 bytes
    assert spec.op_rate("MaxPool3d", 1) == pytest.approx((8e9, 16e9))  # clamped
    assert spec.op_rate("ReLU", 2**20) == (spec.memory_bandwidth,) * 2
    with pytest.raises(ClusterError, match="op_rates give MaxPool3d at 1048576 bytes twice"):
        dataclasses.replace(spec, op_rates=rows + rows[:1])
    with pytest.raises(ClusterError, match=r"op_rates\[ReLU\].bytes = 0"):
        OpRate("ReLU", 0, 1.0, 1.0)

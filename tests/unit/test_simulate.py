"""``hybridpar.simulate`` and ``hybridpar simulate``: weak and strong scaling points from the planner, the
PNG, the table and JSON, one-line errors, and the models by name it plans."""

import json

import pytest

from hybridpar.cli import main
from hybridpar.cli.args import device_counts
from hybridpar.errors import ClusterError, HybridparError
from hybridpar.models.registry import build_for_planning, known_names
from hybridpar.plan import graph_of
from hybridpar.simulate import default_families, family_name, global_batches, plot, scaling
from support.argv import with_options

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
COUNTS = (8, 16, 32, 64)


@pytest.fixture(scope="module")
def graph():
    return graph_of(*build_for_planning("cosmoflow", (1, 4, 64, 64, 64)))


@pytest.fixture(scope="module")
def strong(graph):
    return scaling(graph, "a100-80", COUNTS, mode="strong", batch=64, families=("dp", "dp x spatial"))


def _family(points, name):
    return [p for p in points if p.family == name]


def test_strong_scaling_step_time_falls_while_the_batch_splits(strong):
    dp = _family(strong, "dp")
    assert [p.devices for p in dp] == list(COUNTS) and all(p.global_batch == 64 for p in dp)
    assert all(p.plan is not None and p.plan.world_size == p.devices for p in dp)
    times = [p.step_time for p in dp]
    assert all(later <= earlier for earlier, later in zip(times, times[1:])), times
    assert dp[0].efficiency == 1.0 and all(0 < p.efficiency <= 1.0 + 1e-9 for p in dp)
    # strong scaling: efficiency is the speedup over the first point divided by the device ratio
    for p in dp:
        assert p.efficiency == pytest.approx(dp[0].step_time / p.step_time / (p.devices / dp[0].devices))


def test_weak_scaling_grows_the_batch_and_the_throughput(graph):
    # 32 samples per device: compute outweighs the all-reduce that leaves the node at 16 devices
    points = scaling(graph, "a100-80", COUNTS, mode="weak", batch=256, families=("dp",))
    assert [p.global_batch for p in points] == [256, 512, 1024, 2048]
    rates = [p.samples_per_second for p in points]
    assert all(later > earlier for earlier, later in zip(rates, rates[1:])), rates
    assert points[0].efficiency == 1.0
    for p in points:  # weak scaling: throughput per device relative to the first point's
        assert p.efficiency == pytest.approx(p.samples_per_second / p.devices / (rates[0] / 8))


def test_a_family_without_a_plan_says_why(graph):
    # batch 16 on 128 devices: no dp=128 (dp must divide the batch); the last 4^3 layers cannot take 8 parts
    points = scaling(graph, "a100-80", (16, 128), mode="strong", batch=16, families=("dp", "spatial"))
    dp, spatial = _family(points, "dp"), _family(points, "spatial")
    assert dp[0].plan is not None and dp[0].efficiency == 1.0
    missing = dp[1]
    assert missing.plan is None and missing.step_time is None and missing.samples_per_second is None
    assert missing.efficiency is None and "no dp arrangement of 128 devices" in missing.reason
    assert spatial[0].plan is not None and spatial[0].plan.dp == 1 and spatial[0].plan.spatial == (4, 2, 2)
    assert spatial[1].plan is None and "fewer than its 8 parts" in spatial[1].reason


def test_efficiency_is_relative_to_the_first_point_that_has_a_plan(graph):
    points = scaling(graph, "a100-80", (1, 2, 4), mode="weak", batch=1, families=("dp",))
    assert points[0].plan is None and points[1].efficiency == 1.0 and points[2].efficiency is not None


def test_families_and_batches():
    assert family_name("spatial x DP") == "dp x spatial" and family_name("pp x tp x dp") == "dp x tp x pp"
    assert family_name("one device") == "one device"
    for bad in ("data", "dp x dp", "dp + tp"):
        with pytest.raises(HybridparError, match="name the kinds of parallelism"):
            family_name(bad)
    assert global_batches((8, 16, 64), 4, "weak") == {8: 4, 16: 8, 64: 32}
    assert global_batches((8, 16), 4, "strong") == {8: 4, 16: 4}
    with pytest.raises(HybridparError, match=r"from batch 3 at 8 devices gives 3 x 12 / 8 = 4\.5 samples at 12"):
        global_batches((8, 12), 3, "weak")
    with pytest.raises(HybridparError, match="mode 'linear'"):
        global_batches((8,), 1, "linear")


def test_default_families_and_argument_errors(graph):
    tokens = graph_of(*build_for_planning("gpt2-small", (1, 64)))
    assert default_families(graph) == ("dp", "dp x spatial")
    assert default_families(tokens) == ("dp", "dp x tp", "dp x tp x pp")
    with pytest.raises(ClusterError, match="12 devices: not a whole number of 8-device"):
        scaling(graph, "a100-80", (8, 12), mode="strong", batch=8)
    with pytest.raises(HybridparError, match="unknown constraint 'dpp'"):
        scaling(graph, "a100-80", (8,), mode="strong", batch=8, dpp=2)
    with pytest.raises(HybridparError, match="takes no volume"):
        scaling(tokens, "a100-80", (8,), mode="strong", batch=8, families=("dp x spatial",))


def test_plot_writes_a_png(strong, tmp_path):
    path = plot(strong, tmp_path / "scaling.png", "cosmoflow 64^3, strong")
    assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 10_000


def test_device_counts():
    assert device_counts("8:64") == (8, 16, 32, 64)
    assert device_counts("64,8,16") == (8, 16, 64)
    assert device_counts("1,2,8:32") == (1, 2, 8, 16, 32)
    assert device_counts("12:48") == (12, 24, 48)
    for bad, message in (("8:100", "100 is not 8 doubled"), ("abc", "give device counts"), ("0,8", "give device"),
                         ("64:8", "give device counts"), ("", "give device counts")):
        with pytest.raises(HybridparError, match=message):
            device_counts(bad)


CLI = ["simulate", "--model", "cosmoflow", "--input", "1x4x32x32x32", "--cluster", "a100-80", "--devices", "8:32",
       "--mode", "weak", "--batch", "8"]


def test_cli_table_and_png(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "160")
    out = tmp_path / "s.png"
    assert main(CLI + ["--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "weak scaling, batch 8 at 8 devices" in text and "dp x spatial" in text and "100%" in text
    assert out.read_bytes()[:8] == PNG_MAGIC and f"wrote {out}" in text


def test_cli_json(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # json writes no PNG unless --out is given
    assert main(CLI + ["--format", "json", "--families", "dp"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["mode"] == "weak" and [p["devices"] for p in data["points"]] == [8, 16, 32]
    assert [p["global_batch"] for p in data["points"]] == [8, 16, 32] and data["points"][0]["efficiency"] == 1.0
    assert data["points"][0]["plan"]["dp"] == 8 and not list(tmp_path.iterdir())


@pytest.mark.parametrize("change, message", [
    ({"--devices": "8:100"}, "--devices '8:100': 100 is not 8 doubled"),
    ({"--devices": "eight"}, "--devices 'eight': give device counts"),
    ({"--devices": "8,12"}, "12 devices: not a whole number of 8-device a100-80 nodes"),
    ({"--model": "resnet"}, "model 'resnet': use one of cosmoflow, unet3d, gpt2-small"),
    ({"--model": "nosuchpkg.mod:f"}, "cannot import 'nosuchpkg.mod'"),
    ({"--families": "dp,data"}, "family 'data': name the kinds of parallelism"),
    ({"--batch": "1", "--devices": "2,3"}, "gives 1 x 3 / 2 = 1.5 samples at 3 devices"),
    ({"--batch": "0"}, "batch = 0: give a whole number"),
])
def test_cli_errors_are_one_line(capsys, tmp_path, change, message):
    assert main(with_options(CLI + ["--out", str(tmp_path / "s.png")], change)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1, err
    assert not (tmp_path / "s.png").exists()


def test_cli_refuses_to_overwrite(capsys, tmp_path):
    out = tmp_path / "s.png"
    out.write_bytes(b"mine")
    assert main(CLI + ["--out", str(out), "--families", "dp"]) == 2
    err = capsys.readouterr().err
    assert f"{out} exists; pass --overwrite" in err and err.count("\n") == 1 and out.read_bytes() == b"mine"
    assert main(CLI + ["--out", str(tmp_path / "missing" / "s.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(CLI + ["--out", str(out), "--families", "dp", "--overwrite", "--devices", "8"]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("name", known_names())
def test_build_for_planning_each_known_name(name):
    shape = {"cosmoflow": (2, 4, 32, 32, 32), "unet3d": (2, 1, 32, 32, 32)}.get(name, (2, 64))
    model, example = build_for_planning(name, shape)
    assert all(p.is_meta for p in model.parameters()) and example.is_meta and tuple(example.shape) == shape
    assert example.dtype.is_floating_point == (name in ("cosmoflow", "unet3d"))


def test_build_for_planning_errors():
    with pytest.raises(HybridparError, match=r"model 'resnet': use one of cosmoflow, unet3d, gpt2-small.*gpt3-175b"):
        build_for_planning("resnet", (1, 4, 32, 32, 32))
    with pytest.raises(HybridparError, match="cubic volume"):
        build_for_planning("cosmoflow", (1, 4, 32, 32))
    with pytest.raises(HybridparError, match="has no function 'nothing'"):
        build_for_planning("hybridpar.models:nothing", (1, 4, 8, 8, 8))
    model, _ = build_for_planning("support.models:TinyCosmoFlow", (1, 2, 16, 16, 16))  # tests/support/models.py
    assert all(p.is_meta for p in model.parameters())

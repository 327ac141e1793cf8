"""``hybridpar plan``: the table, JSON for scripts, the plan file, and one-line errors."""

import json

import pytest

from hybridpar.cli import main
from hybridpar.models.registry import build_for_planning
from hybridpar.plan import Plan
from support.argv import with_options

SMALL = ["plan", "--model", "cosmoflow", "--input", "1x4x64x64x64", "--cluster", "a100-80", "--devices", "16",
         "--batch", "8"]


def test_table_of_plans_and_of_the_strategies_that_lose(capsys):
    assert main(SMALL + ["--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "cosmoflow: " in out and "16 x a100-80" in out and "candidates searched" in out
    assert "best plans" in out and "the other strategies" in out
    assert out.count("\n│ ") >= 3
    # not on a terminal (a log file, a pipe): the headers are whole, not cut at 80 columns
    assert "samples/s" in out and "exposed comm. (ms)" in out and "best of them, or why they lose" in out


def test_json_and_the_plan_file(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(SMALL + ["--format", "json", "--out", str(out)]) == 0
    data = json.loads(capsys.readouterr().out)
    best = Plan.from_json(out.read_text())
    assert Plan.from_dict(data["plans"][0]) == best
    assert best.world_size == 16 and best.global_batch == 8 and best.prediction.step_time > 0
    assert isinstance(data["rejected"], dict)
    assert main(SMALL + ["--out", str(out)]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err


def test_constraints_are_applied(capsys):
    assert main(SMALL + ["--format", "json", "--dp", "8", "--spatial", "2,1,1", "--sharding", "0"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert all(p["dp"] == 8 and p["spatial"] == [2, 1, 1] and p["sharding"] == 0 for p in plans)


@pytest.mark.parametrize("argv, message", [
    (["--model", "resnet"], "model 'resnet': use one of cosmoflow, unet3d, gpt2-small"),
    (["--model", "nosuchpkg.mod:f"], "cannot import 'nosuchpkg.mod'"),
    (["--model", "gpt2-small", "--input", "1x4x64x64x64"], "takes token ids of shape BxT"),
    (["--spatial", "2,2"], "--spatial '2,2': give 3 part counts"),
    (["--cluster", "tpu-v9"], "tpu-v9"),
    (["--devices", "12"], "12 devices: not a whole number of 8-device a100-80 nodes"),
    (["--batch", "1", "--devices", "4096", "--input", "1x4x32x32x32"], "no plan fits 4096 a100-80 devices"),
])
def test_errors_are_one_line(capsys, argv, message):
    assert main(with_options(SMALL, dict(zip(argv[::2], argv[1::2])))) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("flag, value", [("--top", "-1"), ("--dp", "-1"), ("--tp", "-1"), ("--pp", "-1"),
                                         ("--dp", "0"), ("--devices", "0"), ("--batch", "-8"), ("--verify", "-1")])
def test_bad_counts_are_argument_errors_naming_the_flag(capsys, flag, value):
    with pytest.raises(SystemExit) as exit_:
        main(with_options(SMALL, {flag: value}))
    assert exit_.value.code == 2
    least = 0 if flag == "--verify" else 1
    assert f"argument {flag}: '{value}': give a whole number of at least {least}" in capsys.readouterr().err


@pytest.fixture
def no_analysis(monkeypatch):
    def graph_of(*args):
        raise AssertionError("the model was analysed before the input was refused")

    monkeypatch.setattr("hybridpar.plan.graph_of", graph_of)


def test_an_out_that_is_a_folder_is_refused_before_the_analysis(tmp_path, capsys, no_analysis):
    for options in (["--overwrite"], []):
        assert main(SMALL + ["--out", str(tmp_path)] + options) == 2
        err = capsys.readouterr().err
        assert f"--out {tmp_path}: a folder, not a file; give the file to write, e.g. --out {tmp_path / 'plan.json'}" \
            in err and "Traceback" not in err
    assert main(SMALL + ["--out", str(tmp_path / "none" / "plan.json")]) == 2
    assert f"folder {tmp_path / 'none'} does not exist" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_cluster_file_that_cannot_price_the_dtype_is_refused_before_the_analysis(tmp_path, capsys, no_analysis):
    from hybridpar.plan import preset
    from hybridpar.plan.io import write_cluster

    cluster = tmp_path / "v100.toml"
    write_cluster(preset("v100"), cluster)
    argv = with_options(SMALL, {"--cluster": str(cluster), "--dtype": "bfloat16", "--devices": "8"})
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cluster 'v100' has no peak FLOP/s for dtype 'bfloat16'" in err and "Traceback" not in err
    assert main(with_options(argv, {"--devices": str(2**21)})) == 2
    assert "2,097,152 devices: more than 1,048,576" in capsys.readouterr().err


def test_bad_input_shape_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model", "cosmoflow", "--input", "1x4xfoo", "--cluster", "a100-80"])
    assert exit_.value.code == 2
    assert "give the input shape as sizes joined by x" in capsys.readouterr().err


def test_an_importable_factory_is_planned(capsys):
    assert main(["plan", "--model", "support.models:TinyCosmoFlow", "--input", "1x2x16x16x16", "--cluster", "a100-80",
                 "--devices", "2", "--batch", "2", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["plans"]


def test_models_are_built_on_the_meta_device():
    for name, shape in (("cosmoflow", (1, 4, 32, 32, 32)), ("unet3d", (1, 1, 32, 32, 32)), ("gpt2-small", (1, 64))):
        model, example = build_for_planning(name, shape)
        assert all(p.is_meta for p in model.parameters()) and example.is_meta and tuple(example.shape) == shape


def test_a_token_model_from_a_factory_is_planned(capsys):
    """A language model gets token ids (its first module is an embedding) without being told; given floats,
    the error says which dtype it got and how to choose another."""
    argv = ["plan", "--model", "support.models:tiny_token_model", "--input", "8x16", "--cluster", "a100-80",
            "--devices", "4", "--format", "json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["plans"]
    assert main(argv + ["--input-dtype", "int64"]) == 0
    capsys.readouterr()
    assert main(argv + ["--input-dtype", "float32"]) == 2
    err = capsys.readouterr().err
    assert "dtype float32" in err and "--input-dtype" in err and "Traceback" not in err

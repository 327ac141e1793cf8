"""What a newcomer meets at the command line before any worker starts: the version, too many local workers,
a missing TensorBoard, no data files (with the generator for the data's format), and bad input that the config,
the flags and the files tell refused in one line before any model analysis, leaving nothing behind."""

import hashlib
import json
from types import SimpleNamespace

import pytest

import hybridpar
from hybridpar.cli import main
from hybridpar.cli.train import OVERSUBSCRIBE, _check_cores
from hybridpar.data import synth
from hybridpar.data.hdf5 import list_files
from hybridpar.errors import ConfigError, DataError
from hybridpar.plan import Plan, preset
from hybridpar.plan.io import write_cluster
from hybridpar.train import metrics
from hybridpar.train.trainer import finished_at


def test_version(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0 and capsys.readouterr().out.strip() == f"hybridpar {hybridpar.__version__}"


def test_far_more_local_workers_than_cores_are_refused_unless_asked(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    _check_cores(OVERSUBSCRIBE * 2, oversubscribe=False)  # at the limit: started
    with pytest.raises(ConfigError, match=r"64 local workers on 2 CPU cores .* pass --oversubscribe"):
        _check_cores(64, oversubscribe=False)
    _check_cores(64, oversubscribe=True)


def test_a_missing_tensorboard_is_a_config_error_up_front(monkeypatch):
    config = SimpleNamespace(metrics=SimpleNamespace(tensorboard=True))
    monkeypatch.setattr(metrics.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="metrics.tensorboard = true, but the tensorboard package is not installed"):
        metrics.check_tensorboard(config)
    metrics.check_tensorboard(SimpleNamespace(metrics=SimpleNamespace(tensorboard=False)))


def test_no_data_files_suggests_the_generator_of_the_format(tmp_path):
    with pytest.raises(DataError, match="hybridpar data synth-segmentation --out DIR"):
        list_files(tmp_path, "data.train", "synth-segmentation")
    with pytest.raises(DataError, match="hybridpar data synth-cosmoflow --out DIR"):
        list_files(tmp_path, "data.train")


# --- bad input refused before the model's analysis (a big model's takes minutes) -----------------------------

GPT = """
run_dir = "{run}"
{top}
[model]
name = "gpt"
vocab_size = 16
seq_len = 8
num_layers = 1
num_heads = 2
d_model = 8
[data]
format = "tokens"
{mesh}
[train]
steps = 2
batch_size = {batch}
dtype = "{dtype}"
"""

COSMO = """
run_dir = "{run}"
[data]
train = "{data}"
[train]
steps = 2
batch_size = {batch}
"""


@pytest.fixture
def no_analysis(monkeypatch):
    """The model's analysis fails the test: what it checks must be refused before it."""
    def analysed(*args):
        raise AssertionError("the model was analysed before the input was refused")

    monkeypatch.setattr("hybridpar.train.planning.analysed", analysed)


def gpt_config(tmp_path, top="", mesh="", batch=4, dtype="float32"):
    path = tmp_path / "gpt.toml"
    path.write_text(GPT.format(run=tmp_path / "run", top=top, mesh=mesh, batch=batch, dtype=dtype))
    return path


def refused(capsys, argv: list, message: str) -> str:
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_a_mesh_far_beyond_the_local_cores_is_refused_before_the_analysis(tmp_path, capsys, no_analysis):
    config = gpt_config(tmp_path, mesh="[mesh]\ndp = 1000000", batch=1000000)
    refused(capsys, ["train", config], "1000000 local workers on")
    assert not (tmp_path / "run").exists()


def test_nproc_against_the_plan_file_is_refused_before_the_analysis(tmp_path, capsys, no_analysis):
    plan = tmp_path / "plan.json"
    plan.write_text(Plan(dp=4, global_batch=4, model="gpt").to_json())
    config = gpt_config(tmp_path, top=f'plan = "{plan}"')
    refused(capsys, ["train", config, "--nproc", 2], "the plan (dp=4) needs 4 processes, but the world size is 2")


def test_nproc_a_resumed_mesh_cannot_be_replanned_for_is_refused_before_the_analysis(tmp_path, capsys,
                                                                                     no_analysis):
    config = gpt_config(tmp_path, mesh="[mesh]\ndp = 4")
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000001"
    checkpoint.mkdir(parents=True)
    (checkpoint / ".metadata").write_bytes(b"")
    refused(capsys, ["train", config, "--nproc", 3, "--resume"], "[mesh]: cannot re-plan dp=4 for 3 processes")


def test_a_batch_larger_than_the_training_set_is_refused_before_the_analysis(tmp_path, capsys, no_analysis):
    synth.synth_cosmoflow(tmp_path / "data", 2, 8)
    config = tmp_path / "cosmo.toml"
    config.write_text(COSMO.format(run=tmp_path / "run", data=tmp_path / "data", batch=1_000_000_000))
    refused(capsys, ["train", config], "train.batch_size = 1000000000: the training set has only 2 samples")


def test_a_batch_of_tokens_beyond_the_memory_is_refused_before_the_analysis(tmp_path, capsys, no_analysis,
                                                                            monkeypatch):
    monkeypatch.setattr("hybridpar.train.tasks.tokens.available_memory", lambda: 2**30)
    config = gpt_config(tmp_path, batch=1_000_000_000)
    refused(capsys, ["train", config], "train.batch_size = 1000000000: one global batch of token ids takes 127 GiB "
                                       "(every rank draws it whole, 136 bytes per sample at model.seq_len = 8), more "
                                       "than the 1 GiB this machine has available; use a batch of at most 7895160")


def test_the_configs_cluster_is_checked_before_the_analysis(tmp_path, capsys, no_analysis):
    cluster = tmp_path / "cluster.toml"
    write_cluster(preset("v100"), cluster)  # no bfloat16
    config = gpt_config(tmp_path, top=f'plan = "auto"\ncluster = "{cluster}"', dtype="bfloat16")
    refused(capsys, ["train", config, "--nproc", 1], "cluster: cluster 'v100' has no peak FLOP/s for dtype 'bfloat16'")
    (tmp_path / "mixed.toml").write_text('name = "m"\n[[group]]\ncluster = 5\nnodes = 1\n')
    config = gpt_config(tmp_path, top=f'plan = "auto"\ncluster = "{tmp_path / "mixed.toml"}"')
    refused(capsys, ["train", config, "--nproc", 1], "group[0].cluster = 5: give a preset name")


def test_calibrate_refuses_an_out_that_is_a_folder_before_measuring(tmp_path, capsys, monkeypatch):
    def measured(*args):
        raise AssertionError("measured before --out was checked")

    monkeypatch.setattr("hybridpar.calibrate.calibrate", measured)
    refused(capsys, ["calibrate", "--out", tmp_path, "--overwrite"],
            f"--out {tmp_path}: a folder, not a file; give the file to write, e.g. --out {tmp_path / 'cluster.toml'}")


@pytest.mark.parametrize("flag", ["--steps", "--dp", "--size", "--batch"])
def test_demo_counts_are_refused_by_the_argument_parser(capsys, flag):
    with pytest.raises(SystemExit) as stop:
        main(["demo", flag, "-1"])
    assert stop.value.code == 2
    assert f"argument {flag}: '-1': give a whole number of at least 1" in capsys.readouterr().err


def test_a_sample_beyond_the_memory_is_refused_and_leaves_no_folder(tmp_path, capsys):
    out = tmp_path / "new" / "universes"
    refused(capsys, ["data", "synth-cosmoflow", "--out", out, "--num-samples", 1, "--size", 100000],
            "size = 100000 (CLI: --size): one sample of 100000^3 voxels takes about 35.5 PiB to generate")
    assert not (tmp_path / "new").exists()


def _checkpoint(directory, step: int, manifest: bool = True):
    """A checkpoint folder of ``step`` (its files made up), with the manifest a finished save writes last."""
    path = directory / f"step_{step:08d}"
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"metadata")
    (path / "__0_0.distcp").write_bytes(b"tensors")
    if manifest:
        files = {p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                 for p in sorted(path.iterdir())}
        (path / "manifest.json").write_text(json.dumps({"files": files}))
    return path


def test_only_an_intact_checkpoint_finishes_a_run(tmp_path):
    """A resumed run is finished only where an intact checkpoint (its files those of its manifest) reached its
    steps; a folder without a manifest, or with a changed file, does not count."""
    bare = _checkpoint(tmp_path, 9, manifest=False)
    assert finished_at(4, bare) is None
    intact = _checkpoint(tmp_path, 5)
    assert finished_at(4, bare) == 5 and finished_at(6, bare) is None
    (intact / "__0_0.distcp").write_bytes(b"changed")
    assert finished_at(4, bare) is None


"""The training config: every bad key or value is refused with the key's name."""

import re

import pytest

from hybridpar.errors import ConfigError
from hybridpar.train import config as cfg

BASE = {"data": {"train": "data/train"}, "train": {"steps": 2}}


def table(**sections):
    out = {k: dict(v) for k, v in BASE.items()}
    for key, value in sections.items():
        if isinstance(value, dict):
            out.setdefault(key, {}).update(value)
        else:
            out[key] = value
    return out


def test_defaults_and_values():
    c = cfg.parse(table(mesh={"dp": 2, "spatial": [2, 1, 1]}, optimizer={"lr": 1}, model={"dropout": 0.5}))
    assert c.mesh.spatial == (2, 1, 1) and c.optimizer.lr == 1.0 and isinstance(c.optimizer.lr, float)
    assert c.model.name == "cosmoflow" and c.model.options == {"dropout": 0.5}
    assert c.train.batch_size == 8 and c.checkpoint.keep == 2


@pytest.mark.parametrize("sections, message", [
    ({"bogus": 1}, "unknown key bogus"),
    ({"train": {"stpes": 3}}, "unknown key train.stpes"),
    ({"optimizer": {"lr": "fast"}}, "optimizer.lr = 'fast': expected float"),
    ({"train": {"batch_size": 2.5}}, "train.batch_size = 2.5: expected int"),
    ({"train": {"batch_size": True}}, "train.batch_size = True: expected int"),
    ({"mesh": {"spatial": [2, "x", 1]}}, r"mesh.spatial\[1\]"),
    ({"mesh": {"spatial": 2}}, "mesh.spatial = 2: expected a list"),
    ({"mesh": {"spatial": [2, 1]}}, "give 3 part counts"),
    ({"optimizer": {"name": "lion"}}, "optimizer.name = 'lion': use one of 'adam', 'adamw', 'sgd'"),
    ({"data": {"crop": -1}}, "data.crop = -1: must not be negative"),
    ({"mesh": {"dp": 0}}, "mesh.dp = 0: must be at least 1"),
    ({"train": {"epochs": 1}}, "exactly one of train.steps and train.epochs"),
    ({"mesh": {"dp": 3}}, "train.batch_size = 8 is not divisible by mesh.dp = 3"),
    ({"data": "x"}, "data = 'x': expected a table"),
    ({"model": {"name": "resnet"}}, "model.name = 'resnet': use one of 'cosmoflow', 'unet3d'"),
    ({"model": {"widht": 3}}, "unknown key model.widht for model 'cosmoflow'"),
    ({"model": {"size": 64}}, "model.size is set from the data"),
    ({"model": {"dropout": "high"}}, "model.dropout = 'high': expected float"),
    ({"model": {"name": "unet3d", "depth": 2.0}}, "model.depth = 2.0: expected int"),
    ({"optimizer": {"lr": -0.1}}, r"optimizer.lr = -0.1: must be greater than 0"),
    ({"optimizer": {"lr": 0}}, r"optimizer.lr = 0.0: must be greater than 0"),
    ({"optimizer": {"momentum": 1.5}}, r"optimizer.momentum = 1.5: must be in \[0, 1\)"),
    ({"optimizer": {"betas": [0.9, -0.1]}}, r"optimizer.betas\[1\] = -0.1: must be in \[0, 1\)"),
    ({"optimizer": {"betas": [0.9]}}, r"optimizer.betas = \[0.9\]: give two numbers"),
    ({"schedule": {"factor": -2}}, r"schedule.factor = -2.0: must be greater than 0"),
    ({"schedule": {"decay_steps": [200, 100]}}, r"schedule.decay_steps = \[200, 100\]: give increasing"),
    ({"schedule": {"decay_steps": [-1]}}, r"schedule.decay_steps = \[-1\]: give increasing"),
    ({"optimizer": {"lr": float("inf")}}, "optimizer.lr = inf: must be a finite number"),
    ({"optimizer": {"weight_decay": float("nan")}}, "optimizer.weight_decay = nan: must be a finite number"),
    ({"model": {"dropout": float("nan")}}, "model.dropout = nan: must be a finite number"),
    ({"train": {"steps": 10**23}}, "train.steps = 100000000000000000000000: far too large"),
    ({"mesh": {"dp": 2**20, "spatial": [2, 1, 1]}, "train": {"batch_size": 2**20}}, "more than 1,048,576 ranks"),
    ({"run_dir": ""}, "run_dir = '': give the folder"),
    ({"optimizer": {"lr": 1e300}}, r"optimizer.lr = 1e\+300 does not fit train.dtype = 'float32' \(at most 3.4e\+38\)"),
    ({"train": {"non_finite": "ignore"}}, "train.non_finite = 'ignore': use one of 'stop', 'skip'"),
    ({"train": {"slow_factor": 1.0}}, r"train.slow_factor = 1.0: must be greater than 1 \(a rank that many times"),
    ({"train": {"slow_window": 0}}, "train.slow_window = 0: must be at least 1"),
    ({"train": {"rebalance": "yes"}}, "train.rebalance"),
])
def test_bad_keys_and_values(sections, message):
    with pytest.raises(ConfigError, match=message):
        cfg.parse(table(**sections))


@pytest.mark.parametrize("sections, message", [
    ({"plan": "auto"}, r'plan = "auto" needs cluster: a preset \(v100, a100-40, a100-80'),
    ({"cluster": "a100-80"}, r"cluster = 'a100-80' is used only with plan; set plan"),
    ({"plan": 1}, "plan = 1: expected str"),
    ({"plan": "auto", "cluster": ["a100-80"]}, r"cluster = \['a100-80'\]: expected str"),
    ({"plan": "auto", "cluster": 5}, r"cluster = 5: expected str: a preset name \(v100, a100-40, .*\) or the path of "
                                     "a cluster TOML file"),
    ({"plan": "auto", "cluster": "a100-80", "mesh": {"dp": 2}},
     r"mesh.dp and plan = 'auto' both set the mesh .*; remove one of the two"),
    ({"plan": "plan.json", "mesh": {"spatial": [2, 1, 1]}}, "mesh.spatial and plan = 'plan.json' both set the mesh"),
    ({"plan": "plan.json", "mesh": {"data_parallel": "ddp"}}, "mesh.data_parallel and plan = 'plan.json' both"),
])
def test_plan_and_cluster(sections, message):
    with pytest.raises(ConfigError, match=message):
        cfg.parse(table(**sections))


def test_plan_leaves_the_other_mesh_keys_to_the_config():
    c = cfg.parse(table(plan="auto", cluster="cluster.toml", mesh={"batch_norm": "spatial"}))
    assert (c.plan, c.cluster, c.mesh.batch_norm, c.mesh.dp) == ("auto", "cluster.toml", "spatial", 1)
    c = cfg.parse(table(plan="runs/a/plan.json"))  # a plan file needs no cluster
    assert (c.plan, c.cluster) == ("runs/a/plan.json", "")
    assert cfg.parse(table()).plan == ""


def test_missing_train_data():
    with pytest.raises(ConfigError, match="data.train is missing"):
        cfg.parse({"train": {"steps": 1}})


def test_load_names_the_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the config"):
        cfg.load(tmp_path / "none.toml")
    (tmp_path / "bad.toml").write_text("[train\nsteps = 1")
    with pytest.raises(ConfigError, match="bad.toml: not valid TOML"):
        cfg.load(tmp_path / "bad.toml")
    (tmp_path / "typo.toml").write_text('[data]\ntrain = "x"\n[train]\nsteps = 1\nbatch = 4\n')
    with pytest.raises(ConfigError, match="typo.toml: unknown key train.batch"):
        cfg.load(tmp_path / "typo.toml")


def test_shipped_configs_parse():
    from pathlib import Path

    configs = sorted((Path(__file__).parents[2] / "configs").glob("*.toml"))
    assert configs
    for path in configs:
        cfg.load(path)


@pytest.mark.parametrize("content, message", [
    (b'run_dir = "caf\xe9"\n', "not UTF-8 text (byte 14)"),
    (b"x = " + b"[" * 100_000 + b"]" * 100_000 + b"\n", "arrays or tables nested too deeply"),
    (b"x = 1\nx = 2\n", "not valid TOML"),  # a duplicate key
])
def test_unreadable_configs_are_named(tmp_path, content, message):
    path = tmp_path / "c.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=re.escape(f"{path}: {message}")):
        cfg.load(path)


def test_a_run_dir_that_cannot_be_written_is_refused_before_any_worker(tmp_path):
    from hybridpar.train.trainer import prepare_run_dir

    (tmp_path / "file").write_text("")
    for run_dir, message in ((tmp_path / "file", "is a file, not a folder"),
                             (tmp_path / "file" / "run", "is a file, not a folder")):
        config = cfg.parse(table(run_dir=str(run_dir)))
        with pytest.raises(ConfigError, match=f"run_dir = '{run_dir}': {tmp_path / 'file'} {message}"):
            prepare_run_dir(config, resume=False)
    assert prepare_run_dir(cfg.parse(table(run_dir=str(tmp_path / "new" / "run"))), resume=False) is None

"""What a newcomer meets at the command line before any worker starts: the version, too many local workers,
a missing TensorBoard, no data files (with the generator for the data's format)."""

from types import SimpleNamespace

import pytest

import hybridpar
from hybridpar.cli import main
from hybridpar.cli.train import OVERSUBSCRIBE, _check_cores
from hybridpar.data.hdf5 import list_files
from hybridpar.errors import ConfigError, DataError
from hybridpar.train import metrics


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

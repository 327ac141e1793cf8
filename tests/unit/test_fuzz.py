"""A seeded fuzzer over what users hand hybridpar: training configs, plan files and HDF5 data files, each mutated
at random (values, types, keys, nesting, encodings, bytes). Every case ends in a clean pass of the checks
``hybridpar train`` runs before starting workers, or in one of hybridpar's errors (a ``HybridparError``, which the
command prints in one line): never another exception, a hang, or non-finite data let through."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from hybridpar.data import COSMOFLOW, SlabDataset
from hybridpar.data.synth import synth_cosmoflow
from hybridpar.errors import HybridparError
from hybridpar.geometry import Grid
from hybridpar.plan import Plan
from hybridpar.train.config import load
from hybridpar.train.trainer import check

CASES = 60
VALUES = [-1, 0, 1, 3, 2**31, 2**70, -(2**63), 0.5, 1e308, -1e-308, float("nan"), float("inf"), float("-inf"), True,
          "", "x" * 5000, "caf\u00e9", "../../etc", "auto", "/dev/null", [], [1, 2, 3], [[1]], ["a"], {"a": 1}, {}]
SECTIONS = {
    "": ["run_dir", "seed", "plan", "cluster", "bogus"],
    "model": ["name", "base_channels", "fc_sizes", "dropout", "batch_norm", "depth", "widht"],
    "data": ["train", "val", "format", "input", "target", "layout", "transform", "crop", "crops_per_file",
             "skip_bad", "prefetch"],
    "mesh": ["dp", "spatial", "data_parallel", "batch_norm"],
    "optimizer": ["name", "lr", "weight_decay", "momentum", "betas"],
    "schedule": ["name", "warmup_steps", "min_lr", "decay_steps", "factor"],
    "train": ["steps", "epochs", "batch_size", "dtype", "loss", "log_every", "non_finite"],
    "validation": ["every", "batch_size", "max_samples"],
    "checkpoint": ["every", "keep"],
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    synth_cosmoflow(root / "train", 4, 32, seed=1)
    synth_cosmoflow(root / "val", 2, 32, seed=2)
    return root


def base_config(data: Path, run: Path) -> dict:
    return {"run_dir": str(run), "seed": 0,
            "model": {"name": "cosmoflow", "base_channels": 2, "fc_sizes": [8], "dropout": 0.0},
            "data": {"format": "cosmoflow", "train": str(data / "train"), "val": str(data / "val")},
            "mesh": {"dp": 2, "spatial": [2, 1, 1]}, "optimizer": {"name": "adam", "lr": 0.01},
            "train": {"steps": 2, "batch_size": 4}, "checkpoint": {"every": 1}}


def toml(table: dict) -> str:
    """``table`` as TOML (the subset the fuzzer makes: scalars, arrays, inline tables, one level of sections)."""
    lines = [f"{key} = {_value(v)}" for key, v in table.items() if not isinstance(v, dict)]
    for key, section in table.items():
        if isinstance(section, dict):
            lines += [f"[{key}]"] + [f"{k} = {_value(v)}" for k, v in section.items()]
    return "\n".join(lines) + "\n"


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    """Flip, insert or delete a few bytes, or cut the text short."""
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind, at = rng.randrange(4), rng.randrange(max(1, len(data)))
        if kind == 0:
            data[at] ^= 1 << rng.randrange(8)
        elif kind == 1:
            data.insert(at, rng.randrange(256))
        elif kind == 2 and data:
            del data[at]
        else:
            del data[at:]
    return bytes(data)


def mutate_config(rng: random.Random, table: dict) -> bytes:
    for _ in range(rng.randint(1, 3)):
        section = rng.choice(list(SECTIONS))
        target = table if section == "" else table.setdefault(section, {})
        if not isinstance(target, dict):
            continue
        key = rng.choice(SECTIONS[section])
        roll = rng.random()
        if roll < 0.15:
            target.pop(key, None)
        elif roll < 0.2 and section:
            table[section] = rng.choice(VALUES)
        else:
            target[key] = rng.choice(VALUES)
    text = toml(table).encode()
    return mutate_bytes(rng, text) if rng.random() < 0.2 else text


def checked(path: Path, world_size: int | None = None) -> str:
    """``ok``, or the name of the hybridpar error the config at ``path`` ends in; any other exception fails."""
    try:
        config = load(path)
        check(config, world_size or config.mesh.dp * math.prod(config.mesh.spatial))
    except HybridparError as err:
        return type(err).__name__
    return "ok"


@pytest.mark.parametrize("seed", range(CASES))
def test_fuzzed_configs_end_clean(tmp_path, data, seed):
    rng = random.Random(seed)
    path = tmp_path / "c.toml"
    path.write_bytes(mutate_config(rng, base_config(data, tmp_path / "run")))
    checked(path)


PLAN_FIELDS = ["dp", "spatial", "tp", "pp", "global_batch", "micro_batches", "sharding", "checkpointing", "stages",
               "schedule", "layers", "sequence_parallel", "optimizer", "dtype", "model", "cluster", "prediction",
               "schema_version", "bogus"]


def mutate_plan(rng: random.Random, plan: dict) -> bytes:
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(PLAN_FIELDS)
        roll = rng.random()
        if roll < 0.15:
            plan.pop(key, None)
        elif roll < 0.3:
            plan["prediction"] = {"step_time": rng.choice(VALUES), "compute_time": 1.0, rng.choice(["memory", "x"]):
                                  rng.choice(VALUES)}
        else:
            plan[key] = rng.choice(VALUES + [{"features.0": "column"}, ["features.3"], 2, 4])
    text = json.dumps(plan, allow_nan=True)
    if rng.random() < 0.1:  # a key twice
        text = text[:-1] + ', "dp": 2}'
    return mutate_bytes(rng, text.encode()) if rng.random() < 0.2 else text.encode()


@pytest.mark.parametrize("seed", range(CASES))
def test_fuzzed_plan_files_end_clean(tmp_path, data, seed):
    rng = random.Random(seed)
    good = Plan(dp=2, spatial=(2, 1, 1), global_batch=4, input_shape=(4, 4, 32, 32, 32), dtype="float32")
    plan = tmp_path / "plan.json"
    plan.write_bytes(mutate_plan(rng, json.loads(good.to_json())))
    table = base_config(data, tmp_path / "run")
    table.pop("mesh")
    table["plan"] = str(plan)
    config = tmp_path / "c.toml"
    config.write_text(toml(table))
    checked(config, world_size=4)


def write_sample(path: Path, rng: random.Random) -> None:
    """A CosmoFlow-like file (32^3, 4 channels, DHWC) with one to three random defects."""
    volume = rng.random() * np.ones((32, 32, 32, 4), np.float32)
    target = np.zeros(4, np.float32)
    defects = rng.sample(range(12), rng.randint(1, 3))
    if 0 in defects:
        volume[rng.randrange(32), 0, 0, 0] = rng.choice([np.nan, np.inf, -np.inf, -2.0])
    if 1 in defects:
        target[rng.randrange(4)] = np.nan
    if 2 in defects:
        volume = volume.astype(rng.choice([np.float16, np.int8, np.complex64, np.bool_, "S1"]))
    if 3 in defects:
        volume = volume[..., rng.randrange(4)] if rng.random() < 0.5 else volume[None]
    if 4 in defects:
        target = target.reshape(rng.choice([(2, 2), (1, 4), (4, 1)])) if rng.random() < 0.7 else np.float32(1)
    if 5 in defects:
        volume = volume[: rng.randrange(0, 32)]
    with h5py.File(path, "w") as f:
        names = ["full", "unitPar"] if 6 not in defects else rng.choice([["image", "unitPar"], ["full", "label"]])
        if 7 in defects:
            f.create_group(names[0])
        elif 8 in defects:
            f[names[0]] = h5py.ExternalLink(str(path.with_name("elsewhere.h5")), "/full")
        elif 9 in defects:
            f[names[0]] = h5py.SoftLink("/nowhere")
        else:
            f.create_dataset(names[0], data=volume, chunks=True if 10 in defects else None,
                             compression="gzip" if 10 in defects else None)
        f[names[1]] = target
    if 11 in defects:
        path.write_bytes(mutate_bytes(rng, path.read_bytes()))


@pytest.mark.parametrize("seed", range(CASES))
def test_fuzzed_hdf5_files_end_clean(tmp_path, data, seed):
    """A good file and a damaged one, read slab by slab as two spatial ranks would: every slab read is finite,
    or the reading ends in a ``DataError`` naming the file."""
    rng = random.Random(seed)
    bad = tmp_path / "bad.h5"
    write_sample(bad, rng)
    files = [sorted((data / "train").iterdir())[0], bad]
    try:
        dataset = SlabDataset(files, COSMOFLOW, skip_bad=rng.random() < 0.3)
        for index in range(len(dataset)):
            for rank in range(2):
                x, y = dataset.read(index, Grid((2, 1, 1)), rank)
                assert torch.isfinite(x).all() and torch.isfinite(y).all(), f"non-finite data read from {bad}"
    except HybridparError as err:
        assert str(bad) in str(err) or "none of the" in str(err), err

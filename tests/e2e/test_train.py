"""``hybridpar train`` end to end, through the command line and PyTorch's elastic agent: dp=2 x spatial=2
equals one process (losses and weights, float64), a resumed run equals the uninterrupted one, the
planner's mesh (``plan = "auto"`` or a plan file) is the one trained on, and user mistakes end in a
one-line error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridpar.parallel.checkpoint_files import read_tensors
from hybridpar.plan import Plan, preset
from hybridpar.plan.io import write_cluster
from hybridpar.train import checkpoint_dir, metrics
from hybridpar.train.config import load
from hybridpar.train.trainer import check
from support.harness import limit

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]  # each test trains through the CLI in fresh workers

COSMO = """
run_dir = "{run}"
seed = 3
[model]
name = "cosmoflow"
base_channels = 2
fc_sizes = [8]
batch_norm = {batch_norm}
dropout = {dropout}
[data]
format = "cosmoflow"
train = "{data}/train"
val = "{data}/val"
skip_bad = {skip_bad}
[mesh]
dp = {dp}
spatial = {spatial}
data_parallel = "{data_parallel}"
[optimizer]
name = "adam"
lr = 0.01
[train]
steps = {steps}
batch_size = 4
dtype = "float64"
[validation]
every = 2
[checkpoint]
every = 2
"""

UNET = """
run_dir = "{run}"
[model]
name = "unet3d"
num_classes = {num_classes}
base_channels = 2
depth = 2
norm = "batch"
[data]
format = "segmentation"
train = "{data}/train"
val = "{data}/val"
[mesh]
dp = {dp}
spatial = {spatial}
[optimizer]
name = "sgd"
lr = 0.1
[train]
steps = 2
batch_size = 2
dtype = "float64"
"""


def hybridpar(*args, check=True, env: dict | None = None, timeout: float = 200) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    proc = subprocess.run([sys.executable, "-m", "hybridpar", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=limit(timeout))
    if check and proc.returncode != 0:
        raise AssertionError(f"hybridpar {' '.join(map(str, args))} failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def synth(root: Path, kind: str, size: int, num_train: int, num_val: int) -> Path:
    for split, count, seed in (("train", num_train, 1), ("val", num_val, 2)):
        hybridpar("data", kind, "--out", root / split, "--num-samples", count, "--size", size, "--seed", seed)
    return root


@pytest.fixture(scope="module")
def cosmo_data(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("cosmo"), "synth-cosmoflow", 32, 8, 3)


@pytest.fixture(scope="module")
def seg_data(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("seg"), "synth-segmentation", 16, 4, 2)


def write_config(path: Path, template: str, **values) -> Path:
    defaults = dict(batch_norm="false", dropout=0.0, dp=1, spatial=[1, 1, 1], steps=2, data_parallel="ddp",
                    skip_bad="false", num_classes=3)
    path.write_text(template.format(**{**defaults, **values}))
    return path


def final_weights(config_path: Path) -> dict[str, torch.Tensor]:
    """The model's tensors (weights and buffers) in the run's last checkpoint, read without a process group."""
    path = checkpoint_dir.checkpoints(Path(load(config_path).run_dir) / "checkpoints")[-1][1]
    return {key.removeprefix("model."): t for key, t in read_tensors(path).items() if key.startswith("model.")}


def run_pair(tmp_path, template, data, grid, data_parallel="ddp", **values):
    one = write_config(tmp_path / "one.toml", template, run=tmp_path / "one", data=data, **values)
    par = write_config(tmp_path / "par.toml", template, run=tmp_path / "par", data=data, dp=2, spatial=grid,
                       data_parallel=data_parallel, **values)
    hybridpar("train", one, "--nproc", 1)
    hybridpar("train", par, "--nproc", 4)
    return one, par


def assert_same_run(one: Path, par: Path, tmp_path) -> None:
    a, b = metrics.read(tmp_path / "one" / "metrics.jsonl"), metrics.read(tmp_path / "par" / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] and len(a) >= 2
    for ra, rb in zip(a, b):
        for key, value in ra.items():
            if key not in ("bytes_read", "split", "step", "samples"):
                assert value == pytest.approx(rb[key], rel=1e-10, abs=1e-12), f"{key} at step {ra['step']}"
    wa, wb = final_weights(one), final_weights(par)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_cosmoflow_dp2_spatial2_equals_one_process(tmp_path, cosmo_data):
    one, par = run_pair(tmp_path, COSMO, cosmo_data, [2, 1, 1], batch_norm="true")
    assert_same_run(one, par, tmp_path)


def test_cosmoflow_fsdp_dp2_spatial2_equals_one_process(tmp_path, cosmo_data):
    one, par = run_pair(tmp_path, COSMO, cosmo_data, [1, 2, 1], data_parallel="fsdp")
    assert_same_run(one, par, tmp_path)


def test_unet_dp2_spatial2_equals_one_process(tmp_path, seg_data):
    one, par = run_pair(tmp_path, UNET, seg_data, [1, 2, 1])
    assert_same_run(one, par, tmp_path)


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_resume_equals_uninterrupted(tmp_path, cosmo_data, data_parallel):
    """4 ranks (dp=2 x spatial 2), DDP or FSDP: the weights are bitwise equal. A DDP built after a resume sums
    the gradients of every step in the order the uninterrupted run's did (at 3 or more ranks DDP's own
    regrouped buckets would not)."""
    values = dict(data=cosmo_data, dp=2, spatial=[1, 1, 2], steps=4, dropout=0.25, data_parallel=data_parallel)
    full = write_config(tmp_path / "full.toml", COSMO, run=tmp_path / "full", **values)
    part = write_config(tmp_path / "part.toml", COSMO, run=tmp_path / "part", **values)
    hybridpar("train", full, "--nproc", 4)
    stopped = hybridpar("train", part, "--nproc", 4, "--stop-after", 2)
    assert "continue with --resume" in stopped.stdout
    # a crash in the middle of saving step 3 leaves a .partial directory, and one while logging a torn line:
    # resume ignores the first (and removes it with its next checkpoint) and drops the second
    (tmp_path / "part" / "checkpoints" / "step_00000003.partial").mkdir()
    with (tmp_path / "part" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 3, "split": "tr')
    resumed = hybridpar("train", part, "--nproc", 4, "--resume")
    assert "dropped 1 line(s) cut short" in resumed.stderr, resumed.stderr
    assert not list((tmp_path / "part" / "checkpoints").glob("*.partial"))
    finished = hybridpar("train", part, "--nproc", 4, "--resume")  # at once: no worker starts
    assert "finished its 4 steps already (nothing to train)" in finished.stdout
    assert not (tmp_path / "part" / "plan.json").exists(), "the [mesh] section is the plan: no plan.json"
    a, b = metrics.read(tmp_path / "full" / "metrics.jsonl"), metrics.read(tmp_path / "part" / "metrics.jsonl")
    assert [(r["step"], r["split"]) for r in a] == [(r["step"], r["split"]) for r in b]
    for ra, rb in zip(a, b):
        assert ra.get("loss") == rb.get("loss") and ra.get("mae") == rb.get("mae"), f"step {ra['step']}"
    for name, w in final_weights(full).items():
        torch.testing.assert_close(final_weights(part)[name], w, rtol=0, atol=0)
    assert [s for s, _ in checkpoint_dir.checkpoints(tmp_path / "part" / "checkpoints")] == [2, 4]


def test_epochs_are_passes_of_the_plans_replicas(tmp_path, cosmo_data):
    """``train.epochs``: 8 samples, batches of 4 over dp=2 replicas of 4 samples each: 2 steps per epoch, counted
    before any worker starts; the finished run resumed trains nothing and starts no worker."""
    cfg = write_config(tmp_path / "e.toml", COSMO, run=tmp_path / "run", data=cosmo_data, dp=2)
    cfg.write_text(cfg.read_text().replace("steps = 2", "epochs = 2"))
    assert check(load(cfg), 2) == 4
    trained = hybridpar("train", cfg, "--nproc", 2)
    assert "trained steps 0..4" in trained.stdout, trained.stdout
    finished = hybridpar("train", cfg, "--nproc", 2, "--resume")
    assert "finished its 4 steps already (nothing to train)" in finished.stdout, finished.stdout


def test_checkpoint_listing_ignores_unfinished(tmp_path):
    for name in ("step_00000002", "step_00000004.partial", "step_00000006", "other"):
        (tmp_path / name).mkdir()
    (tmp_path / "step_00000002" / ".metadata").write_bytes(b"")
    assert checkpoint_dir.checkpoints(tmp_path) == [(2, tmp_path / "step_00000002")]


def expect_error(*args, match: str, env: dict | None = None, code: int = 2) -> str:
    proc = hybridpar(*args, check=False, env=env)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert match in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) <= 3, proc.stderr
    return proc.stderr


def test_user_errors_are_one_line(tmp_path, cosmo_data):
    cfg = write_config(tmp_path / "c.toml", COSMO, run=tmp_path / "run", data=cosmo_data)
    expect_error("train", tmp_path / "none.toml", match="cannot read the config")
    expect_error("train", cfg, "--nproc", 2, match="--nproc 2 does not match")
    expect_error("train", cfg, "--resume", match="no finished checkpoint")
    bad_grid = write_config(tmp_path / "g.toml", COSMO, run=tmp_path / "g", data=cosmo_data, spatial=[1, 1, 64])
    expect_error("train", bad_grid, "--oversubscribe", match="mesh.spatial")  # 64 workers on a few cores
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "bad.h5").write_bytes(b"junk" * 10)
    junk = write_config(tmp_path / "j.toml", COSMO, run=tmp_path / "j", data=tmp_path / "x")
    junk.write_text(junk.read_text().replace(f'"{tmp_path / "x"}/train"', f'"{tmp_path / "junk"}"'))
    expect_error("train", junk, match=f"{tmp_path / 'junk' / 'bad.h5'} (sample file 0)")
    hybridpar("train", cfg)
    expect_error("train", cfg, match="holds an earlier run; pass --resume")


def test_run_dir_of_a_run_without_checkpoint(tmp_path, cosmo_data):
    cfg = write_config(tmp_path / "c.toml", COSMO, run=tmp_path / "run", data=cosmo_data)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "split": "train", "loss": 1.0}\n')
    expect_error("train", cfg, match="saved no checkpoint (nothing to resume); move")
    expect_error("train", cfg, "--resume", match="no finished checkpoint")
    expect_error("train", cfg, "--stop-after", 0, match="--stop-after: '0': give a whole number of at least 1")
    assert (tmp_path / "run" / "metrics.jsonl").read_text().startswith('{"step": 1'), "the old metrics are kept"


def _labelled(root: Path, num_files: int) -> Path:
    """Volumes of 16^3 labelled 0 and 1, but for one voxel labelled 2 in the upper half of each H dim."""
    import h5py
    import numpy as np

    for split in ("train", "val"):
        (root / split).mkdir(parents=True)
        for i in range(num_files):
            label = np.zeros((16, 16, 16), np.uint8)
            label[:, 8:] = 1
            label[3, 12, 5] = 2
            with h5py.File(root / split / f"seg_{i}.h5", "w") as f:
                f["image"] = np.random.default_rng(i).normal(size=(1, 16, 16, 16)).astype(np.float32)
                f["label"] = label
                f.attrs["layout"] = "CDHW"
    return root


def test_labels_beyond_the_classes_stop_every_rank_with_one_error(tmp_path):
    # spatial = [1, 2, 1]: only rank 1 reads the slab with the 2 and fails; rank 0 is told at the same
    # step and stops with rank 1's message instead of waiting for it in the halo exchange
    cfg = write_config(tmp_path / "u.toml", UNET, run=tmp_path / "run", data=_labelled(tmp_path / "d", 2),
                       spatial=[1, 2, 1], num_classes=2)
    expect_error("train", cfg, "--nproc", 2, match="num_classes = 2, so labels must lie in 0..1")
    assert not (tmp_path / "run" / "metrics.jsonl").exists(), "a run that failed before any step leaves no metrics"


def test_skip_bad_reports_the_skipped_files(tmp_path, cosmo_data):
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for path in (cosmo_data / "train").iterdir():
        (mixed / path.name).symlink_to(path)
    (mixed / "zz_bad.h5").write_bytes(b"junk" * 10)
    cfg = write_config(tmp_path / "c.toml", COSMO, run=tmp_path / "run", data=cosmo_data, skip_bad="true")
    cfg.write_text(cfg.read_text().replace(f'"{cosmo_data}/train"', f'"{mixed}"'))
    proc = hybridpar("train", cfg, "--nproc", 1)
    assert "data.train: skipped 1 of 9 files (data.skip_bad = true); first:" in proc.stderr
    assert "zz_bad.h5 (sample file 8): not a readable HDF5 file" in proc.stderr


# --- the planner's mesh: plan = "auto" or a plan file --------------------------------------------------

@pytest.fixture(scope="module")
def cluster_toml(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cluster") / "cluster.toml"
    write_cluster(preset("a100-80").with_devices(2), path)
    return path


def planned_config(path: Path, *, run: Path, data: Path, plan, cluster=None, **values) -> Path:
    """The COSMO config with its [mesh] degrees left to ``plan`` (and ``cluster``)."""
    write_config(path, COSMO, run=run, data=data, **values)
    lines = [line for line in path.read_text().splitlines()
             if not line.startswith(("dp =", "spatial =", "data_parallel ="))]
    top = f'plan = "{plan}"' + (f'\ncluster = "{cluster}"' if cluster else "")
    path.write_text("\n".join(lines).replace("seed = 3", f"seed = 3\n{top}", 1) + "\n")
    return path


def test_plan_auto_on_two_workers_then_its_plan_json_again(tmp_path, cosmo_data, cluster_toml):
    auto = planned_config(tmp_path / "auto.toml", run=tmp_path / "auto", data=cosmo_data, plan="auto",
                          cluster=cluster_toml)
    proc = hybridpar("train", auto, "--nproc", 2)
    plan = Plan.from_json((tmp_path / "auto" / "plan.json").read_text())
    assert plan.world_size == 2
    assert (plan.global_batch, plan.dtype, plan.input_shape) == (4, "float64", (4, 4, 32, 32, 32))
    assert f"plan {plan.describe()} (searched for 2 x a100-80): predicted " in proc.stdout
    assert f"trained steps 0..2 on {plan.describe()} in " in proc.stdout, proc.stdout  # the mesh the workers built
    # the run's plan.json reruns exactly that plan, on the workers it names (no --nproc, no cluster)
    again = planned_config(tmp_path / "again.toml", run=tmp_path / "again", data=cosmo_data,
                           plan=tmp_path / "auto" / "plan.json")
    proc = hybridpar("train", again)
    assert f"trained steps 0..2 on {plan.describe()} in " in proc.stdout, proc.stdout
    assert Plan.from_json((tmp_path / "again" / "plan.json").read_text()) == plan
    records = [metrics.read(tmp_path / run / "metrics.jsonl") for run in ("auto", "again")]
    a, b = ([(r["step"], r.get("loss"), r.get("mae")) for r in rs] for rs in records)
    assert a == b and len(a) >= 2  # the same mesh, the same run


def test_cosmoflow_pp2_tp2_plan_then_resumed_at_dp2_equals_one_process(tmp_path, cosmo_data):
    """A plan file with a pipeline (1F1B, two micro-batches) and filter / channel-split convolutions trains
    the volume model through ``hybridpar.parallelize``, validating through the pipeline; its checkpoint
    resumes under the ``[mesh]`` plan dp=2 on another world size; every loss, MAE and weight is one
    process's."""
    plan = Plan(dp=1, spatial=(1, 1, 1), tp=2, pp=2, micro_batches=2, schedule="1f1b", stages=("features.6",),
                layers=(("features.0", "column"), ("features.1", "shard"), ("features.2", "shard"),
                        ("features.3", "row")), global_batch=4, dtype="float64", input_shape=(4, 4, 32, 32, 32))
    (tmp_path / "plan.json").write_text(plan.to_json())
    par = planned_config(tmp_path / "par.toml", run=tmp_path / "par", data=cosmo_data, plan=tmp_path / "plan.json",
                         steps=4)
    proc = hybridpar("train", par, "--stop-after", 2)
    assert f"trained steps 0..2 on {plan.describe()} in " in proc.stdout, proc.stdout
    resumed = write_config(tmp_path / "dp2.toml", COSMO, run=tmp_path / "par", data=cosmo_data, steps=4, dp=2)
    proc = hybridpar("train", resumed, "--resume")
    assert "trained steps 2..4 on dp=2 in " in proc.stdout, proc.stdout
    one = write_config(tmp_path / "one.toml", COSMO, run=tmp_path / "one", data=cosmo_data, steps=4)
    hybridpar("train", one, "--nproc", 1)
    assert_same_run(one, par, tmp_path)


def test_plans_that_do_not_fit_the_model_are_refused_before_any_worker(tmp_path, cosmo_data, cluster_toml):
    def refused(plan: Plan, *args, match: str) -> None:
        (tmp_path / "plan.json").write_text(plan.to_json())
        config = planned_config(tmp_path / "c.toml", run=tmp_path / "run", data=cosmo_data, plan=tmp_path / "plan.json")
        expect_error("train", config, *args, match=match)

    fits = dict(global_batch=4, dtype="float64", input_shape=(4, 4, 32, 32, 32))
    refused(Plan(dp=1, spatial=(1, 1, 1), tp=2, layers=(("features.9", "column"),), **fits),
            match="plan.json: layer 'features.9'")
    refused(Plan(dp=2, spatial=(1, 1, 1), tp=2, sharding=3, layers=(("features.0", "column"),), **fits),
            match="layer 'features.0' (Conv3d) cannot run 'column': "
                  "FSDP / ZeRO (sharding > 0) does not run channel-split")
    refused(Plan(dp=1, spatial=(1, 1, 1), pp=2, micro_batches=2, stages=("head.9",), **fits),
            match="stage boundary 'head.9' is not a layer of the model (CosmoFlow)")
    refused(Plan(dp=2, spatial=(1, 1, 1), model="unet3d", **fits),
            match="plan.json is a plan for model 'unet3d', but the config trains 'cosmoflow'; make a plan for this")
    refused(Plan(dp=4, spatial=(1, 1, 1), **fits), "--nproc", 2,
            match="plan.json: the plan (dp=4) needs 4 processes, but the world size is 2")
    refused(Plan(dp=2, spatial=(1, 1, 1), **{**fits, "global_batch": 8}),
            match="plan.json: global_batch = 8, but train.batch_size = 4; plan again with hybridpar plan --batch 4")
    auto = planned_config(tmp_path / "a.toml", run=tmp_path / "run", data=cosmo_data, plan="auto", cluster=cluster_toml)
    expect_error("train", auto, match='plan = "auto" in')  # how many workers?
    assert not (tmp_path / "run").exists()


def test_no_plan_fits_is_one_line_with_what_training_could_use(tmp_path, cosmo_data):
    from dataclasses import replace

    write_cluster(replace(preset("a100-80").with_devices(2), device_memory=2**20, reserved_memory=0),
                  tmp_path / "tiny.toml")
    config = planned_config(tmp_path / "c.toml", run=tmp_path / "run", data=cosmo_data, plan="auto",
                            cluster=tmp_path / "tiny.toml")
    stderr = expect_error("train", config, "--nproc", 2, match="no plan fits 2 a100-80 devices")
    assert "checkpointing" not in stderr  # the no-fit hints of training: more devices or another batch

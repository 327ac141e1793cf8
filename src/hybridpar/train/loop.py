"""The training loop of ``hybridpar train``: one call per rank, inside an initialised process group.

Order of work: check the config, the data files, the plan (searched, read, or ``[mesh]``'s:
``train/planning.py``) and the geometry on every rank (identically, before any communication); build the
model from the seed (the same weights on every rank) and apply the plan with ``hybridpar.parallelize``;
then train. Step ``s`` (0-based) reseeds the random generators from ``(seed, s, dp x spatial rank)`` and
reads batch ``s`` of the deterministic sampler, so a run resumed from a checkpoint, under this plan or
another, repeats the uninterrupted run exactly.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridpar import spatial
from hybridpar.parallel.apply import ParallelModel, parallelize
from hybridpar.data import COSMOFLOW, SEGMENTATION, SampleFormat, SlabDataset, SlabLoader, eval_batches, list_files
from hybridpar.errors import ConfigError, DataError
from hybridpar.mesh import build_mesh
from hybridpar.parallel.data import flat_group
from hybridpar.plan import Plan
from hybridpar.spatial.geometry import Grid
from hybridpar.train import checkpoint, planning
from hybridpar.train.config import Config, model_factory, model_options
from hybridpar.train.metrics import MetricsLog
from hybridpar.train.optim import build_optimizer, learning_rate, set_learning_rate
from hybridpar.train.progress import Progress

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
DEFAULT_LOSS = {"cosmoflow": "mse", "unet3d": "cross_entropy+dice"}
LOSSES = {"cosmoflow": ("mse",), "unet3d": ("cross_entropy", "dice", "cross_entropy+dice")}


def sample_format(cfg) -> SampleFormat:
    base = COSMOFLOW if cfg.format == "cosmoflow" else SEGMENTATION
    return SampleFormat(cfg.input or base.input, cfg.target or base.target, base.target_kind,
                        cfg.layout or base.layout, cfg.transform or base.transform)


def num_classes(config: Config) -> int | None:
    """The segmentation model's class count (``None`` for regression models)."""
    if config.model.name != "unet3d":
        return None
    default = inspect.signature(model_factory("unet3d")).parameters["num_classes"].default
    return config.model.options.get("num_classes", default)


def datasets(config: Config, dtype) -> tuple[SlabDataset, SlabDataset | None]:
    data, fmt = config.data, sample_format(config.data)
    kwargs = dict(crop=data.crop or None, crops_per_file=data.crops_per_file or None, skip_bad=data.skip_bad,
                  dtype=dtype, num_classes=num_classes(config))
    train = SlabDataset(list_files(data.train, "data.train"), fmt, **kwargs)
    val = SlabDataset(list_files(data.val, "data.val"), fmt, **kwargs) if data.val else None
    if val is not None and val.sample_shape != train.sample_shape:
        raise ConfigError(f"data.val samples are {val.sample_shape} but data.train samples are "
                          f"{train.sample_shape}; use volumes (or crops) of one shape")
    return train, val


def build_model(config: Config, train: SlabDataset) -> torch.nn.Module:
    """The model for ``train``'s samples, initialised from ``config.seed``."""
    channels, *volume = train.sample_shape
    options = model_options(config.model)
    if config.model.name == "cosmoflow":
        if len(set(volume)) != 1:
            raise ConfigError(f"cosmoflow needs cubic samples; the data has {tuple(volume)} (set data.crop)")
        options.update(size=volume[0], in_channels=channels, num_outputs=train.infos[0].target_shape[0])
    else:
        options.update(in_channels=channels)
    torch.manual_seed(config.seed)
    model = model_factory(config.model.name)(**options)
    if hasattr(model, "check_input_size"):
        for edge in volume:
            model.check_input_size(edge)
    return model


def _check_loss(config: Config, loss: str) -> None:
    if loss not in LOSSES[config.model.name]:
        raise ConfigError(f"train.loss = {loss!r} does not suit model {config.model.name!r}; "
                          f"use one of {', '.join(LOSSES[config.model.name])}")
    if (config.model.name == "cosmoflow") != (config.data.format == "cosmoflow"):
        raise ConfigError(f"model.name = {config.model.name!r} with data.format = {config.data.format!r}: "
                          f"use cosmoflow data for cosmoflow and segmentation data for unet3d")


@dataclass
class Run:
    """Everything one rank needs to train: the parallel model and where its data and outputs go."""

    config: Config
    plan: Plan
    parallel: ParallelModel
    optimizer: torch.optim.Optimizer
    train_set: SlabDataset
    val_set: SlabDataset | None
    loader: SlabLoader
    total_steps: int
    loss_name: str

    @property
    def mesh(self):
        return self.parallel.mesh

    @property
    def device(self) -> torch.device:
        return self.parallel.device

    @property
    def spatial_mesh(self):
        return self.mesh["spatial"]

    @property
    def dp(self) -> tuple[int, int]:
        return self.plan.dp, self.mesh["dp"].get_local_rank()

    @property
    def grid(self) -> Grid:
        return Grid(self.plan.spatial)


class Checked(NamedTuple):
    train_set: SlabDataset | None  # None: a GPT's synthetic token task
    val_set: SlabDataset | None
    loss_name: str
    plan: Plan


def check(config: Config, world_size: int) -> Checked:
    """The checks that need no process group: data files, the loss, the model (built on the meta
    device), the plan (searched, read or from ``[mesh]``, for ``world_size`` processes, checked against
    the model as ``hybridpar.parallelize`` will apply it), the split of the samples. ``hybridpar train``
    runs them before starting workers, and every worker runs them again before any communication."""
    if config.model.name == "gpt":
        from hybridpar.train import lm

        return Checked(None, None, "cross_entropy", lm.check(config, world_size))
    train_set, val_set = datasets(config, DTYPES[config.train.dtype])
    loss_name = config.train.loss or DEFAULT_LOSS[config.model.name]
    _check_loss(config, loss_name)
    with torch.device("meta"):
        model = build_model(config, train_set).to(DTYPES[config.train.dtype])
    example = torch.empty(config.train.batch_size, *train_set.sample_shape, device="meta")
    plan = planning.plan_for(config, model, example, world_size)
    Grid(plan.spatial).check_shape(train_set.sample_shape[1:], "mesh.spatial")
    return Checked(train_set, val_set, loss_name, plan)


def setup(config: Config) -> Run:
    """Check everything, then build the mesh, the parallel model, its optimizer and the data loader."""
    train_set, val_set, loss_name, plan = check(config, dist.get_world_size())
    mesh = agreed_mesh(config, plan)
    model = build_model(config, train_set).to(DTYPES[config.train.dtype])
    parallel = parallelize(model, plan, mesh, loss_fn=partial(loss_fn, loss_name, mesh["spatial"]),
                           example_input=torch.empty(plan.input_shape, device="meta"),
                           batch_norm=config.mesh.batch_norm)
    optimizer = build_optimizer(parallel.parameters(), config.optimizer)
    loader = SlabLoader(train_set, batch_size=config.train.batch_size, dp=(plan.dp, mesh["dp"].get_local_rank()),
                        grid=Grid(plan.spatial), spatial_rank=mesh["spatial"].get_local_rank(), seed=config.seed,
                        prefetch=config.data.prefetch)
    total = config.train.steps or config.train.epochs * loader.steps_per_epoch
    return Run(config, plan, parallel, optimizer, train_set, val_set, loader, total, loss_name)


def loss_fn(name: str, spatial_mesh, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss ``name`` of a replica's batch (or micro-batch), the same value on every rank of its
    spatial group."""
    if name == "mse":
        return F.mse_loss(output, target)  # the head's output is replicated on the spatial group
    loss = 0
    if "cross_entropy" in name:
        loss = loss + spatial.cross_entropy(output, target, spatial_mesh)
    if "dice" in name:
        loss = loss + spatial.dice_loss(output, target, spatial_mesh)
    return loss


def mean_over_dp(mesh, value: torch.Tensor) -> float:
    """The mean of a scalar over the data-parallel replicas of ``mesh`` (every replica's loss: the global
    batch's, for equal replica batches)."""
    value = value.detach().clone().double()
    dist.all_reduce(value, group=mesh["dp"].get_group())
    return float(value) / mesh["dp"].size()


def train_step(run: Run, step: int, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """One optimizer step; returns the global batch's loss and the learning rate."""
    cfg = run.config
    lr = learning_rate(step, run.total_steps, cfg.optimizer.lr, cfg.schedule)
    set_learning_rate(run.optimizer, lr)
    # dropout masks of this step: per dp x spatial rank (the spatial runtime shares what must be shared),
    # alike on the tensor-parallel ranks, which hold the same activations
    replica, part = run.mesh["dp"].get_local_rank(), run.mesh["spatial"].get_local_rank()
    torch.manual_seed(cfg.seed + 1_000_003 * (step + 1) + replica * run.mesh["spatial"].size() + part)
    run.optimizer.zero_grad(set_to_none=True)
    loss = run.parallel.train_step(x, y)
    run.optimizer.step()
    return mean_over_dp(run.mesh, loss), lr


@torch.no_grad()
def validate(run: Run) -> dict:
    """Validation metrics over the whole validation set: MAE (and MSE) of the regressed parameters for
    CosmoFlow; the Dice score of each foreground class (and their mean) for the U-Net."""
    batch = run.config.validation.batch_size or run.config.train.batch_size
    limit = run.config.validation.max_samples
    sums = 0
    for x, y, num_valid in agreed(run, eval_batches(run.val_set, batch_size=batch, dp=run.dp, grid=run.grid,
                                                    spatial_rank=run.spatial_mesh.get_local_rank(), limit=limit)):
        out, y = run.parallel.predict(x)[:num_valid].double(), y[:num_valid].to(run.device)
        sums = sums + (_regression_sums(out, y) if run.loss_name == "mse" else _dice_sums(out, y))
    if run.loss_name == "mse":
        dist.all_reduce(sums, group=run.mesh["dp"].get_group())
        per_output = (sums[4:] / sums[3]).tolist()
        return {"mae": float(sums[0] / sums[2]), "mse": float(sums[1] / sums[2]), "samples": int(sums[3]),
                **{f"mae_{i}": v for i, v in enumerate(per_output)}}
    dist.all_reduce(sums, group=flat_group(run.mesh, ("dp", "spatial")))
    inter, pred, true = sums.view(3, -1)[:, 1:]  # foreground classes only
    dice = (2 * inter / (pred + true).clamp_min(1)).tolist()
    return {"dice": sum(dice) / len(dice), **{f"dice_{c + 1}": d for c, d in enumerate(dice)}}


def _regression_sums(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """|error|, error^2, entries, samples, then |error| per output, summed over the batch."""
    err = out - y.double()
    totals = torch.stack([err.abs().sum(), (err ** 2).sum(), err.new_tensor(err.numel()), err.new_tensor(len(err))])
    return torch.cat([totals, err.abs().sum(0)])


def _dice_sums(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per class: voxels in both prediction and truth, predicted voxels, true voxels (of this slab)."""
    classes = logits.shape[1]
    pred = F.one_hot(logits.argmax(1), classes).flatten(0, -2).double()
    true = F.one_hot(y, classes).flatten(0, -2).double()
    return torch.cat([(pred * true).sum(0), pred.sum(0), true.sum(0)])


def prepare_run_dir(config: Config, resume: bool) -> Path | None:
    """The checkpoint to resume from (``None`` for a fresh run); refuses to overwrite a previous run."""
    run_dir = Path(config.run_dir)
    found = checkpoint.checkpoints(run_dir / "checkpoints")
    if resume:
        if not found:
            raise ConfigError(f"--resume: no finished checkpoint in {run_dir / 'checkpoints'}; "
                              f"start without --resume")
        return found[-1][1]
    if found:
        raise ConfigError(f"run_dir = {str(run_dir)!r} holds an earlier run; pass --resume to continue it, "
                          f"or set another run_dir (nothing was overwritten)")
    if (run_dir / "metrics.jsonl").exists():
        raise ConfigError(f"run_dir = {str(run_dir)!r} holds the metrics of an earlier run that saved no "
                          f"checkpoint (nothing to resume); move {run_dir / 'metrics.jsonl'} away to start again "
                          f"there, or set another run_dir (nothing was overwritten)")
    return None


def train(config: Config, *, resume: bool = False, stop_after: int | None = None, show: bool = True) -> dict:
    """Train on this rank; returns the run's summary (on every rank)."""
    resume_from = prepare_run_dir(config, resume)
    dist.barrier()  # every rank has looked at run_dir before rank 0 writes to it
    if config.model.name == "gpt":
        from hybridpar.train import lm

        return lm.train(config, resume_from, stop_after=stop_after, show=show)
    run = setup(config)
    _check_same_data(run)
    start = checkpoint.load(resume_from, run.parallel, run.optimizer) if resume_from else 0
    stop = min(run.total_steps, stop_after or run.total_steps)
    is_root = dist.get_rank() == 0
    run_dir = Path(config.run_dir)
    if is_root:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "plan.json").write_text(run.plan.to_json() + "\n")
        if config.plan:
            print(planning.describe(config, run.plan, str(run_dir / "plan.json")), flush=True)
    log = MetricsLog(run_dir, jsonl=config.metrics.jsonl and is_root,
                     tensorboard=config.metrics.tensorboard and is_root, resume_step=start if resume_from else None)
    if is_root:
        _report_skipped(run)
    progress = Progress(run, start, stop, show=show and is_root)
    summary = {"start_step": start, "steps": stop, "total_steps": run.total_steps, "val": None,
               "mesh": run.plan.describe()}
    begin = time.perf_counter()
    with progress:
        for step, x, y in agreed(run, run.loader.batches(start, stop)):
            loss, lr = train_step(run, step, x, y)
            done = step + 1
            record = {"step": done, "split": "train", "loss": loss, "lr": lr,
                      "bytes_read": run.train_set.bytes_read}
            log.log(record)
            progress.advance(record)
            summary["loss"] = loss
            # the checkpoint first: a validation file that fails to read then loses no training
            if checkpoint.due(done, config.checkpoint.every, stop, run.total_steps):
                summary["checkpoint"] = str(checkpoint.save(run_dir / "checkpoints", done, run.parallel,
                                                            run.optimizer, keep=config.checkpoint.keep))
            if run.val_set is not None and checkpoint.due(done, config.validation.every, stop, run.total_steps):
                summary["val"] = validate(run)
                log.log({"step": done, "split": "val", **summary["val"]})
                progress.validated(done, summary["val"])
    summary["time_s"] = time.perf_counter() - begin
    summary["bytes_read_per_rank"] = _gather(run.train_set.bytes_read)
    log.close()
    run.train_set.close()
    if run.val_set is not None:
        run.val_set.close()
    return summary


def _report_skipped(run: Run) -> None:
    """With ``data.skip_bad``, say how many files were left out and why (the first one)."""
    for key, dataset in (("data.train", run.train_set), ("data.val", run.val_set)):
        if dataset is not None and dataset.skipped:
            path, why = dataset.skipped[0]
            total = len(dataset.skipped) + len(dataset.infos)
            print(f"warning: {key}: skipped {len(dataset.skipped)} of {total} files (data.skip_bad = true); "
                  f"first: {why}", file=sys.stderr, flush=True)


ITEM, EXHAUSTED, ERROR = 0, 1, 2


def agreed(run: Run, batches):
    """``batches``, with a data error on any rank (a file that changed or broke since the checks, a label
    out of range) raised on every rank at the same step, so no rank waits forever in a collective for
    one that stopped. Ranks that run out of batches at different steps (their data differ) are an error
    on every rank too."""
    batches = iter(batches)
    while True:
        try:
            item, state, error = next(batches), ITEM, None
        except StopIteration:
            item, state, error = None, EXHAUSTED, None
        except DataError as err:
            item, state, error = None, ERROR, str(err)
        seen = torch.zeros(3, dtype=torch.int32, device=run.device)
        seen[state] = 1
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)  # which states any rank is in
        if seen[ERROR]:
            errors = [None] * dist.get_world_size()
            dist.all_gather_object(errors, error)
            raise DataError(next(e for e in errors if e is not None))
        if seen[ITEM] and seen[EXHAUSTED]:
            raise DataError("the ranks ran out of batches at different steps: their data sets differ (files that "
                            "changed while the run started?); put the data where every rank sees the same files")
        if state == EXHAUSTED:
            return
        yield item


def _check_same_data(run: Run) -> None:
    """Every rank must have built the same data sets (the same usable files): with ``data.skip_bad`` on a
    filesystem that changes under the run, they could differ, and would then read different samples."""
    sets = [d for d in (run.train_set, run.val_set) if d is not None]
    paths = "\n".join(str(info.path) for d in sets for info in d.infos)
    mine = (tuple(len(d.infos) for d in sets), hashlib.sha256(paths.encode()).hexdigest())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            counts = [" / ".join(map(str, counts)) for counts, _ in (theirs, everyone[0])]
            raise DataError(f"rank {rank} sees other data files than rank 0 (usable training / validation files: "
                            f"{counts[0]} vs {counts[1]}); put the data where every rank sees the same files")


def agreed_mesh(config: Config, plan: Plan):
    """The mesh of ``plan``, built once every rank has shown that it took the same plan (ranks with other
    plans would wait for each other in building it)."""
    check_same_plan(config, plan)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return build_mesh(plan.dims, dist.get_world_size(), device)


def check_same_plan(config: Config, plan: Plan) -> None:
    """Every rank must have taken the same plan: the planner is deterministic, but the ranks could read
    different cluster or plan files (not on a shared filesystem)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, plan.to_json())
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            source = f"plan = {config.plan!r}" if config.plan else "[mesh]"
            raise ConfigError(f"rank {rank} took another plan from {source} than rank 0 "
                              f"({Plan.from_json(theirs).describe()} vs {Plan.from_json(everyone[0]).describe()}); "
                              "put the config, plan and cluster files where every rank reads the same ones")


def _gather(value: int) -> list[int]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def worker(config: Config, resume: bool, stop_after: int | None) -> dict:
    """One worker started by ``torchrun`` or the elastic agent: join the group, train, leave. A user
    error is returned (raised identically on every rank before any communication), not thrown, so
    the command can print it in one line."""
    from hybridpar.errors import HybridparError
    from hybridpar.launch import init_distributed, shutdown_distributed

    init_distributed()
    try:
        result = train(config, resume=resume, stop_after=stop_after)
    except HybridparError as err:
        result = {"error": str(err)}
    shutdown_distributed()
    return result

"""Volumes: CosmoFlow's regression of cosmological parameters and the 3D U-Net's segmentation, read from HDF5
files in slabs (``hybridpar.data``), with spatial parallelism's distributed losses and metrics.

Step ``s`` (0-based) reads batch ``s`` of the deterministic sampler, so a run resumed from a checkpoint, under
this plan or another, repeats the uninterrupted run exactly.
"""

from __future__ import annotations

import inspect
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridpar import spatial
from hybridpar.data import COSMOFLOW, SEGMENTATION, SampleFormat, SlabDataset, SlabLoader, eval_batches, list_files
from hybridpar.data.loader import check_batch_size, steps_per_epoch
from hybridpar.errors import ConfigError
from hybridpar.geometry import Grid
from hybridpar.ir.analysis import DTYPES
from hybridpar.mesh import flat_group
from hybridpar.parallel.apply import parallelize
from hybridpar.plan import Plan
from hybridpar.train import planning
from hybridpar.train.agree import agreed, check_same_data, gather
from hybridpar.train.config import Config, model_factory, model_options

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
    generate = "synth-cosmoflow" if data.format == "cosmoflow" else "synth-segmentation"
    train = SlabDataset(list_files(data.train, "data.train", generate), fmt, **kwargs)
    val = SlabDataset(list_files(data.val, "data.val", generate), fmt, **kwargs) if data.val else None
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


class Volumes:
    reads_files = True

    def __init__(self, config: Config):
        self.config = config
        self.train_set: SlabDataset | None = None
        self.val_set: SlabDataset | None = None

    @property
    def has_validation(self) -> bool:
        return self.val_set is not None

    def check(self, world_size: int, rescale: bool = False) -> Plan:
        config, dtype = self.config, DTYPES[self.config.train.dtype]
        planning.check_world_size(config, world_size, rescale)  # what the files tell, before the model's analysis
        self.train_set, self.val_set = datasets(config, dtype)
        check_batch_size(len(self.train_set), config.train.batch_size)
        self.loss_name = config.train.loss or DEFAULT_LOSS[config.model.name]
        _check_loss(config, self.loss_name)
        with torch.device("meta"):
            model = build_model(config, self.train_set).to(dtype)
        example = torch.empty(config.train.batch_size, *self.train_set.sample_shape, device="meta")
        self.analysed = planning.analysed(self.config, model, example)  # once: the plan, the run and a
        # rebalanced plan read it
        plan = planning.plan_for(config, model, example, world_size, rescale, self.analysed[2])
        plan.grid.check_shape(self.train_set.sample_shape[1:], "mesh.spatial")
        self.total_steps = config.train.steps or config.train.epochs * steps_per_epoch(
            len(self.train_set), config.train.batch_size, plan.dp)
        return plan

    def verification(self, plan: Plan) -> tuple:
        whole = Grid((1,) * (len(self.train_set.sample_shape) - 1))
        samples = [self.train_set.read(i % len(self.train_set), whole, 0) for i in range(plan.global_batch)]
        batch = tuple(torch.stack(parts) for parts in zip(*samples))
        return build_model(self.config, self.train_set), batch, partial(loss_fn, self.loss_name, None)

    def setup(self, plan: Plan, mesh):
        config = self.config
        self.plan, self.mesh = plan, mesh
        model = build_model(config, self.train_set).to(DTYPES[config.train.dtype])
        self.parallel = parallelize(model, plan, mesh, loss_fn=partial(loss_fn, self.loss_name, mesh["spatial"]),
                                    example_input=torch.empty(plan.input_shape, device="meta"),
                                    batch_norm=config.mesh.batch_norm, graph=self.analysed[2])
        self.loader = SlabLoader(self.train_set, batch_size=config.train.batch_size, dp=plan.dp,
                                 rows=plan.batch_rows(mesh["dp"].get_local_rank()), grid=plan.grid,
                                 spatial_rank=mesh["spatial"].get_local_rank(), seed=config.seed,
                                 prefetch=config.data.prefetch)
        check_same_data([d for d in (self.train_set, self.val_set) if d is not None])
        return self.parallel

    @property
    def _dp(self) -> tuple[int, int]:
        return self.plan.dp, self.mesh["dp"].get_local_rank()

    def warnings(self) -> list[str]:
        """With ``data.skip_bad``, how many files were left out and why (the first one)."""
        out = []
        for key, dataset in (("data.train", self.train_set), ("data.val", self.val_set)):
            if dataset is not None and dataset.skipped:
                path, why = dataset.skipped[0]
                total = len(dataset.skipped) + len(dataset.infos)
                out.append(f"{key}: skipped {len(dataset.skipped)} of {total} files (data.skip_bad = true); "
                           f"first: {why}")
        return out

    def batches(self, start: int, stop: int):
        return self.loader.batches(start, stop)

    def seed_offset(self) -> int:
        """Dropout masks per dp x spatial rank (the spatial runtime shares what must be shared), alike on the
        tensor-parallel ranks, which hold the same activations."""
        replica, part = self.mesh["dp"].get_local_rank(), self.mesh["spatial"].get_local_rank()
        return replica * self.mesh["spatial"].size() + part

    def record(self) -> dict:
        return {"bytes_read": self.train_set.bytes_read}

    @torch.no_grad()
    def validate(self) -> dict:
        """Validation metrics over the whole validation set: MAE (and MSE) of the regressed parameters for
        CosmoFlow; the Dice score of each foreground class (and their mean) for the U-Net."""
        batch = self.config.validation.batch_size or self.config.train.batch_size
        limit = self.config.validation.max_samples
        sums = 0
        spatial_rank = self.mesh["spatial"].get_local_rank()
        batches = eval_batches(self.val_set, batch_size=batch, dp=self._dp, grid=self.plan.grid,
                               spatial_rank=spatial_rank, limit=limit)
        for x, y, num_valid in agreed(batches, self.parallel.device):
            out, y = self.parallel.predict(x)[:num_valid].double(), y[:num_valid].to(self.parallel.device)
            sums = sums + (_regression_sums(out, y) if self.loss_name == "mse" else _dice_sums(out, y))
        if self.loss_name == "mse":
            dist.all_reduce(sums, group=self.mesh["dp"].get_group())
            per_output = (sums[4:] / sums[3]).tolist()
            return {"mae": float(sums[0] / sums[2]), "mse": float(sums[1] / sums[2]), "samples": int(sums[3]),
                    **{f"mae_{i}": v for i, v in enumerate(per_output)}}
        dist.all_reduce(sums, group=flat_group(self.mesh, ("dp", "spatial")))
        inter, pred, true = sums.view(3, -1)[:, 1:]  # foreground classes only
        dice = (2 * inter / (pred + true).clamp_min(1)).tolist()
        return {"dice": sum(dice) / len(dice), **{f"dice_{c + 1}": d for c, d in enumerate(dice)}}

    def finish(self) -> dict:
        summary = {"bytes_read_per_rank": gather(self.train_set.bytes_read)}
        self.close()
        return summary

    def close(self) -> None:
        for dataset in (self.train_set, self.val_set):
            if dataset is not None:
                dataset.close()


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

"""The training config: a TOML file read into frozen dataclasses. Unknown keys and values of the wrong
type or out of range are refused with the key's full name (``optimizer.lr``) and what is allowed.
Every key is documented in ``docs/config.md``."""

from __future__ import annotations

import dataclasses
import inspect
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from hybridpar.errors import ConfigError

MODEL_NAMES = ("cosmoflow", "unet3d", "gpt")
DATA_FORMATS = ("cosmoflow", "segmentation", "tokens")


@dataclass(frozen=True)
class ModelConfig:
    name: str = "cosmoflow"
    options: dict = field(default_factory=dict)  # the other keys of [model]: the factory's arguments


@dataclass(frozen=True)
class DataConfig:
    train: str = ""
    val: str = ""
    format: str = "cosmoflow"
    input: str = ""  # dataset names; "" takes the format's default (full / unitPar, image / label)
    target: str = ""
    layout: str = ""  # channels_last, channels_first or auto; "" takes the format's default
    transform: str = ""  # log1p or none; "" takes the format's default
    crop: int = 0  # 0: whole volumes
    crops_per_file: int = 0  # 0: every crop
    skip_bad: bool = False
    prefetch: int = 2


@dataclass(frozen=True)
class MeshConfig:
    dp: int = 1
    spatial: tuple[int, ...] = (1, 1, 1)
    data_parallel: str = "ddp"
    batch_norm: str = "global"  # statistics over dp x spatial ("global") or over each spatial group


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adam"
    lr: float = 1e-3
    weight_decay: float = 0.0
    momentum: float = 0.9  # sgd only
    betas: tuple[float, ...] = (0.9, 0.999)  # adam / adamw only


@dataclass(frozen=True)
class ScheduleConfig:
    name: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0  # cosine: the rate at the last step
    decay_steps: tuple[int, ...] = ()  # step: multiply the rate by `factor` at each of these steps
    factor: float = 0.1


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 0
    epochs: int = 0
    batch_size: int = 8
    dtype: str = "float32"
    loss: str = ""  # "" takes the model's default: mse (cosmoflow), cross_entropy+dice (unet3d)
    log_every: int = 10
    non_finite: str = "stop"  # a NaN or infinite loss: stop the run, or skip that step's update
    # fail-slow detection (hybridpar.train.pace): a rank whose compute per unit of work is slow_factor times its
    # peers' median in two windows of slow_window steps in a row is reported; with rebalance, given less work
    slow_factor: float = 1.5
    slow_window: int = 5
    rebalance: bool = False
    # hang detection (hybridpar.train.watchdog): a phase of the loop (a step, a checkpoint, ...) that takes this many
    # times its slowest recent run (and 10 s at least) is a hang: the attempt ends, to be restarted; 0: off
    hang_factor: float = 10.0


@dataclass(frozen=True)
class ValidationConfig:
    every: int = 0  # steps; 0: only at the end
    batch_size: int = 0  # 0: the training batch size
    max_samples: int = 0  # 0: the whole validation set


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 0  # steps; 0: automatic, every Young/Daly interval (from the measured save and mtbf_hours)
    keep: int = 2
    mtbf_hours: float = 50_000.0  # mean time between failures of one device (Llama 3's 16k-GPU run: about 50,000)


@dataclass(frozen=True)
class MetricsConfig:
    jsonl: bool = True
    tensorboard: bool = False


@dataclass(frozen=True)
class Config:
    run_dir: str = "runs/default"
    seed: int = 0
    plan: str = ""  # "": [mesh] as written; "auto": searched for the world size; else a plan JSON file
    cluster: str = ""  # a preset name or a cluster TOML file: what plan = "auto" searches for
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


CHOICES = {
    "data.format": DATA_FORMATS, "data.layout": ("", "channels_last", "channels_first", "auto"),
    "data.transform": ("", "log1p", "none"), "mesh.data_parallel": ("ddp", "fsdp"),
    "mesh.batch_norm": ("global", "spatial"), "optimizer.name": ("adam", "adamw", "sgd"),
    "schedule.name": ("constant", "cosine", "step"), "train.dtype": ("float32", "float64", "bfloat16"),
    "train.non_finite": ("stop", "skip"),
    "train.loss": ("", "mse", "cross_entropy", "dice", "cross_entropy+dice"), "model.name": MODEL_NAMES,
}
POSITIVE = {"mesh.dp", "train.batch_size", "checkpoint.keep", "train.log_every", "train.slow_window"}
NON_NEGATIVE = {"data.crop", "data.crops_per_file", "data.prefetch", "train.steps", "train.epochs",
                "schedule.warmup_steps", "validation.every", "validation.batch_size", "validation.max_samples",
                "checkpoint.every", "optimizer.weight_decay", "schedule.min_lr"}
GREATER_THAN_ZERO = {"optimizer.lr", "schedule.factor", "checkpoint.mtbf_hours"}
MAX_INT = 2**53  # counts beyond are mistakes (and lose exactness in JSON and float)
DTYPE_MAX = {"float32": 3.4028234663852886e38, "bfloat16": 3.3895313892515355e38}
MAX_RANKS = 2**20  # mesh.dp x prod(mesh.spatial)
FRACTIONS = {"optimizer.momentum", "optimizer.betas[0]", "optimizer.betas[1]"}  # in [0, 1)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _convert(value, tp, key: str):
    """``value`` as type ``tp`` (bool, int, float, str, tuple[X, ...]), or a ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if origin is tuple:
        (item, _) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key} = {value!r}: expected a list of {_type_name(item)}, e.g. [2, 1, 1]")
        return tuple(_convert(v, item, f"{key}[{i}]") for i, v in enumerate(value))
    ok = isinstance(value, tp) and not (tp is int and isinstance(value, bool))
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ConfigError(f"{key} = {value!r}: expected {_type_name(tp)}")
    if tp is float and not math.isfinite(value):
        raise ConfigError(f"{key} = {value!r}: must be a finite number")
    if tp is int and abs(value) > MAX_INT:
        raise ConfigError(f"{key} = {value}: far too large (at most {MAX_INT:,})")
    return value


def _check_value(key: str, value) -> None:
    if key in CHOICES and value not in CHOICES[key]:
        allowed = ", ".join(repr(c) for c in CHOICES[key] if c != "")
        raise ConfigError(f"{key} = {value!r}: use one of {allowed}")
    if key in POSITIVE and value < 1:
        raise ConfigError(f"{key} = {value!r}: must be at least 1")
    if key in NON_NEGATIVE and value < 0:
        raise ConfigError(f"{key} = {value!r}: must not be negative")
    if key in GREATER_THAN_ZERO and not value > 0:
        raise ConfigError(f"{key} = {value!r}: must be greater than 0")
    if key == "train.hang_factor" and value != 0 and not value >= 2:
        raise ConfigError(f"{key} = {value!r}: give 0 (no hang detection) or a factor of at least 2 (a phase of the "
                          "loop that many times slower than its slowest recent run is a hang), e.g. 10")
    if key == "train.slow_factor" and not value > 1:
        raise ConfigError(f"{key} = {value!r}: must be greater than 1 (a rank that many times slower than its "
                          "peers is reported), e.g. 1.5")
    if key in FRACTIONS and not 0 <= value < 1:
        raise ConfigError(f"{key} = {value!r}: must be in [0, 1), e.g. 0.9")
    if key == "optimizer.betas":
        if len(value) != 2:
            raise ConfigError(f"{key} = {list(value)}: give two numbers, e.g. [0.9, 0.999]")
        for i, beta in enumerate(value):
            _check_value(f"{key}[{i}]", beta)
    if key == "schedule.decay_steps" and (min(value, default=0) < 0 or list(value) != sorted(set(value))):
        raise ConfigError(f"{key} = {list(value)}: give increasing step numbers >= 0, e.g. [100, 200]")


def _section(cls, table: dict, prefix: str):
    if not isinstance(table, dict):
        raise ConfigError(f"{prefix} = {table!r}: expected a table [{prefix}]")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    if cls is ModelConfig:
        return ModelConfig(name=_section_value(table.get("name", "cosmoflow"), str, "model.name"),
                           options={k: v for k, v in table.items() if k != "name"})
    unknown = sorted(set(table) - names)
    if unknown:
        raise ConfigError(f"unknown key {prefix + '.' if prefix else ''}{unknown[0]}; "
                          f"{'[' + prefix + ']' if prefix else 'the top level'} takes {', '.join(sorted(names))}")
    values = {}
    for name, raw in table.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            values[name] = _section(tp, raw, key)
        else:
            values[name] = _section_value(raw, tp, key)
    return cls(**values)


def _section_value(raw, tp, key: str):
    if key == "cluster" and not isinstance(raw, str):
        from hybridpar.plan.cluster import PRESETS

        raise ConfigError(f"cluster = {raw!r}: expected str: a preset name ({', '.join(PRESETS)}) or the path of a "
                          'cluster TOML file, e.g. cluster = "a100-80"')
    value = _convert(raw, tp, key)
    _check_value(key, value)
    return value


def parse(table: dict) -> Config:
    """A :class:`Config` from a parsed TOML table; raises :class:`ConfigError` naming the bad key."""
    config = _section(Config, table, "")
    _check_consistency(config)
    _check_plan(config, table.get("mesh", {}))
    return config


def load(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"{path}: cannot read the config ({err.strerror})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); save the config as UTF-8") from None
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML ({err})") from None
    except RecursionError:
        raise ConfigError(f"{path}: arrays or tables nested too deeply to be a training config") from None
    try:
        return parse(table)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def _check_consistency(config: Config) -> None:
    train = config.train
    if (train.steps > 0) == (train.epochs > 0):
        raise ConfigError("give exactly one of train.steps and train.epochs (a positive number)")
    if train.batch_size % config.mesh.dp:
        raise ConfigError(f"train.batch_size = {train.batch_size} is not divisible by mesh.dp = {config.mesh.dp}; "
                          f"use a multiple of {config.mesh.dp}")
    if len(config.mesh.spatial) != 3 or min(config.mesh.spatial) < 1:
        raise ConfigError(f"mesh.spatial = {list(config.mesh.spatial)}: give 3 part counts >= 1 (D, H, W), "
                          f"e.g. [2, 1, 1]")
    if config.mesh.dp * math.prod(config.mesh.spatial) > MAX_RANKS:
        raise ConfigError(f"mesh.dp = {config.mesh.dp} x mesh.spatial = {list(config.mesh.spatial)} asks for more "
                          f"than {MAX_RANKS:,} ranks; give the degrees of the run you mean")
    largest = DTYPE_MAX.get(train.dtype, math.inf)
    if config.optimizer.lr > largest:
        raise ConfigError(f"optimizer.lr = {config.optimizer.lr:g} does not fit train.dtype = {train.dtype!r} (at most "
                          f"{largest:.3g}); give a learning rate that does")
    if not config.run_dir.strip():
        raise ConfigError("run_dir = '': give the folder the run writes to, e.g. \"runs/cosmoflow\"")
    if config.model.name == "gpt":
        _check_language_model(config)
    elif config.data.format == "tokens":
        raise ConfigError(f"data.format = 'tokens' is the token task of model 'gpt', not of {config.model.name!r}; "
                          "use cosmoflow or segmentation data")
    elif not config.data.train:
        raise ConfigError("data.train is missing: a directory of HDF5 files or a glob")
    _check_model_options(config.model)


def _check_language_model(config: Config) -> None:
    """A GPT trains on the synthetic token task (``hybridpar.data.tokens``) for a number of steps."""
    if config.data.format != "tokens":
        raise ConfigError(f"model.name = 'gpt' with data.format = {config.data.format!r}: set data.format = "
                          "\"tokens\" (the synthetic token task)")
    if config.data.train or config.data.val:
        raise ConfigError("data.train / data.val: the token task is synthetic (drawn from the seed); remove them")
    if config.train.epochs:
        raise ConfigError("train.epochs: the token task is an endless stream; give train.steps instead")
    if tuple(config.mesh.spatial) != (1, 1, 1):
        raise ConfigError(f"mesh.spatial = {list(config.mesh.spatial)}: a GPT has no volume to split; remove it")
    if config.validation.batch_size:
        raise ConfigError("validation.batch_size: a GPT validates on batches of train.batch_size; remove it")
    if config.train.loss not in ("", "cross_entropy"):
        raise ConfigError(f"train.loss = {config.train.loss!r} does not suit model 'gpt'; use 'cross_entropy'")


PLAN_MESH_KEYS = ("dp", "spatial", "data_parallel")  # set by the plan when there is one


def _check_plan(config: Config, mesh: dict) -> None:
    """``plan`` and ``cluster`` against each other and against the ``[mesh]`` keys written in the file."""
    if not config.plan:
        if config.cluster:
            raise ConfigError(f"cluster = {config.cluster!r} is used only with plan; set plan = \"auto\" (or a plan "
                              f"file), or remove cluster")
        return
    for key in PLAN_MESH_KEYS:
        if key in mesh:
            raise ConfigError(f"mesh.{key} and plan = {config.plan!r} both set the mesh (the plan gives mesh.dp, "
                              f"mesh.spatial and mesh.data_parallel); remove one of the two")
    if config.plan == "auto" and not config.cluster:
        from hybridpar.plan.cluster import PRESETS

        raise ConfigError(f"plan = \"auto\" needs cluster: a preset ({', '.join(PRESETS)}) or a cluster TOML file "
                          f"(hybridpar calibrate writes one)")


def model_factory(name: str):
    from hybridpar.models import MODELS

    return MODELS[name]


DERIVED = {"size", "in_channels", "num_outputs"}  # set by the trainer from the data


def _check_model_options(model: ModelConfig) -> None:
    params = dict(inspect.signature(model_factory(model.name)).parameters)
    if model.name == "gpt":  # gpt(preset="", **fields): the fields are GPTConfig's
        from hybridpar.models.gpt import GPT_PRESETS, GPTConfig

        params = {name: inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
                  for name, f in GPTConfig.__dataclass_fields__.items()} | {"preset": params["preset"]}
        if model.options.get("preset", "") not in ("", *GPT_PRESETS):
            raise ConfigError(f"model.preset = {model.options['preset']!r}: use one of {', '.join(GPT_PRESETS)}")
    for key, value in model.options.items():
        if key in DERIVED:
            raise ConfigError(f"model.{key} is set from the data (the sample's shape and target); remove it")
        if key not in params:
            allowed = ", ".join(sorted(set(params) - DERIVED))
            raise ConfigError(f"unknown key model.{key} for model {model.name!r}; it takes {allowed}")
        default = params[key].default
        tp = type(default) if default is not inspect.Parameter.empty and default is not None else None
        if tp is tuple:
            _convert(value, tuple[int, ...], f"model.{key}")
        elif tp is not None:
            _convert(value, tp, f"model.{key}")


def model_options(model: ModelConfig) -> dict:
    """The factory's keyword arguments, lists of the config turned into tuples."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in model.options.items()}

"""The plan of a training run: chosen by the planner (``plan = "auto"``), read from a plan file, or ``[mesh]``.

The planner is pure and deterministic, so every rank runs it itself, identically, before any
communication: under ``torchrun`` there is no process of ours above the ranks to run it once, and
broadcasting rank 0's plan would put a collective before the checks (a mistake on one rank would
then be a hang, not an error). ``hybridpar train`` on local workers runs it once more in the command,
before starting them, so that a mistake (or no plan that fits) costs no worker start.

Without ``plan``, the ``[mesh]`` section is the plan: ``dp x spatial`` with DDP or FSDP. Every plan runs
through ``hybridpar.parallelize``: data, sharded data (ZeRO 1-3), spatial, tensor (filter / channel splits
of convolutions), pipeline parallelism and activation checkpointing, so the search covers all of them.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import torch.nn as nn

from hybridpar.errors import ClusterError, ConfigError, MeshError, PlanError
from hybridpar.ir.analysis import graph_of
from hybridpar.ir.graph import ModelGraph
from hybridpar.plan import Plan, check_grid, cluster_of, sizing
from hybridpar.plan import plan as search_best
from hybridpar.plan.cluster import GiB
from hybridpar.train.config import Config


def analysed(config: Config, model: nn.Module, example_input) -> tuple:
    """``(model, example_input, graph)``: the model (on the meta device) analysed once for one step's example input,
    what the plan is chosen and checked on, the run parallelized with and re-planned on (a rebalanced plan)."""
    return model, example_input, graph_of(model, example_input, config.train.dtype)


PLAN_FILE_HELP = 'plan takes "auto", the path of a plan JSON file (hybridpar plan --out plan.json), or ""'


def plan_for(config: Config, model: nn.Module, example_input, world_size: int, rescale: bool = False,
             graph: ModelGraph | None = None) -> Plan:
    """The run's plan for ``world_size`` processes: searched (``plan = "auto"``), read from the plan file and
    checked, or the ``[mesh]`` section's. ``model`` may live on the meta device; ``example_input`` is one
    step's global batch (a tensor: of token ids for a GPT, else on the meta device). The plan is checked
    against the model as ``hybridpar.parallelize`` will apply it. With ``rescale`` (a run resumed or restarted
    on another number of processes), a plan file's or ``[mesh]``'s plan made for another world size is
    re-planned for this one: ``rescaled``. ``graph``: the model's analysis, where the caller has it (``analysed``)."""
    from hybridpar.parallel.plan_check import check_plan

    graph = graph or graph_of(model, example_input, config.train.dtype)
    if config.plan:
        plan = (_search(config, graph, world_size) if config.plan == "auto"
                else _from_file(config, graph, world_size, rescale))
        plan = replace(plan, model=config.model.name)
    else:
        plan = mesh_plan(config, tuple(example_input.shape), world_size, rescale)
        try:
            check_grid(graph, plan.spatial if graph.spatial_ndim else ())
        except PlanError as err:
            raise PlanError(f"mesh.spatial = {list(config.mesh.spatial)}: {err}") from None
    try:
        check_plan(model, plan, example_input, graph)
    except PlanError as err:
        raise PlanError(f"{config.plan or '[mesh]'}: {err}") from None
    return plan


HEADROOM = 0.9  # of a device's memory, what a rebalanced rank's predicted peak may take


def sized_for(model: nn.Module, example_input, graph: ModelGraph, plan: Plan, speeds: tuple[float, ...],
              allowed=lambda p: True, memory: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())) -> Plan:
    """``plan`` with its work sized to the ranks' measured ``speeds`` (``plan.sizing.sized``: uneven shares and
    slabs, a pipeline's stages moved), among the plans ``allowed`` that ``hybridpar.parallelize`` runs on
    ``model`` (on the meta device) and in which no rank's measured peak of memory (``memory``: peaks and device
    bytes per rank, 0 where not known), grown with its work, passes ``HEADROOM`` of its device."""
    from hybridpar.parallel.plan_check import check_plan

    layers = sizing.Layers.of(graph) if plan.pp > 1 else None
    peaks, capacities = memory

    def fits(candidate: Plan) -> bool:
        return all(sizing.rank_work(candidate, r, layers) / sizing.rank_work(plan, r, layers) * peak
                   <= HEADROOM * capacity for r, (peak, capacity) in enumerate(zip(peaks, capacities)) if capacity)

    def runs(candidate: Plan) -> bool:
        if not allowed(candidate) or not fits(candidate):
            return False
        try:
            check_plan(model, candidate, example_input, graph)
        except PlanError:
            return False
        return True

    return sizing.sized(plan, speeds, runs, layers)


def cluster_speeds(config: Config, graph: ModelGraph, plan: Plan) -> tuple[float, ...] | None:
    """Each rank's speed on a mixed cluster (``config.cluster``: the cost model's, ``plan.mixed``), which its plan
    was sized for; ``None`` on one kind of device."""
    if not config.cluster:
        return None
    from hybridpar.plan.mixed import MixedCluster, group_speeds

    spec = _cluster(config, plan.world_size)
    if not isinstance(spec, MixedCluster):
        return None
    per_group = group_speeds(spec, replace(plan, shares=(), slabs=()), graph)
    return tuple(per_group[spec.group_of_rank(r)] for r in range(plan.world_size))


def layers_for(graph: ModelGraph, plan: Plan) -> sizing.Layers | None:
    """What sizes a pipeline's stages (``plan.sizing.Layers``) for a plan with pp > 1; ``None`` without stages."""
    return sizing.Layers.of(graph) if plan.pp > 1 else None


def mesh_plan(config: Config, input_shape: tuple[int, ...], world_size: int, rescale: bool = False) -> Plan:
    """The plan of the ``[mesh]`` section: ``dp x spatial`` (a GPT: ``dp``), DDP or FSDP."""
    mesh = config.mesh
    plan = Plan(dp=mesh.dp, spatial=mesh_spatial(config), sharding=3 if mesh.data_parallel == "fsdp" else 0,
                global_batch=config.train.batch_size, input_shape=input_shape, dtype=config.train.dtype,
                optimizer=config.optimizer.name, model=config.model.name)
    if plan.world_size != world_size:
        if rescale:
            return rescaled(plan, world_size, "[mesh]")
        degrees = "mesh.dp" if config.model.name == "gpt" else "mesh.dp x prod(mesh.spatial)"
        raise ConfigError(f"{degrees} = {plan.world_size}, but the world size is {world_size}; change [mesh] so "
                          f"that it makes {world_size}, or set plan = \"auto\" (with cluster) to let the planner "
                          "choose")
    return plan


def mesh_spatial(config: Config) -> tuple[int, ...]:
    """``[mesh]``'s spatial grid: ``mesh.spatial``, or ``(1,)`` for a GPT (no volume to split)."""
    return (1,) if config.model.name == "gpt" else tuple(config.mesh.spatial)


def rescaled(plan: Plan, world_size: int, where: str) -> Plan:
    """``plan`` re-planned for ``world_size`` processes (a run resumed or restarted on fewer or more): every degree
    kept but ``dp``, which takes the processes there are. The global batch stays, so the steps compute what they
    computed before: only how the batch is shared changes."""
    per_replica = plan.world_size // plan.dp
    dp = world_size // per_replica
    if world_size % per_replica or plan.global_batch % dp:
        raise PlanError(f"{where}: cannot re-plan {plan.describe()} for {world_size} processes keeping its degrees "
                        f"other than dp ({per_replica} processes per replica, batch {plan.global_batch}); run on a "
                        f"multiple of {per_replica} that splits the batch, or plan for {world_size} (plan = \"auto\" "
                        "with cluster, or a plan file)")
    return replace(plan, dp=dp, shares=())  # shares sized for the replicas of before


def _cluster(config: Config, world_size: int):
    """The config's cluster spec scaled to ``world_size`` devices, checked to price ``train.dtype``."""
    try:
        spec = cluster_of(config.cluster).with_devices(world_size)
        spec.check_dtype(config.train.dtype)
    except ClusterError as err:
        raise ClusterError(f"cluster: {err}") from None
    return spec


def check_world_size(config: Config, world_size: int, rescale: bool = False) -> None:
    """What the config, its plan file and its cluster tell of a run on ``world_size`` processes, checked before
    the model is analysed: ``[mesh]``'s degrees or the plan file's make ``world_size`` (with ``rescale``: can be
    re-planned for it, ``rescaled``), and the cluster has ``world_size`` devices that price ``train.dtype``."""
    if config.cluster:
        _cluster(config, world_size)
    if config.plan == "auto":
        return
    if config.plan:
        _plan_file(config, world_size, rescale)
    else:
        mesh_plan(config, (), world_size, rescale)


def _search(config: Config, graph: ModelGraph, world_size: int) -> Plan:
    spec = _cluster(config, world_size)
    return search_best(graph, None, spec, global_batch=config.train.batch_size, dtype=config.train.dtype,
                       optimizer=config.optimizer.name, hints=("devices", "batch"))


def read_plan_file(path: str) -> tuple[Plan, set[str]]:
    """The plan in ``path`` and the keys the file states (the others take the Plan's defaults)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        raise ConfigError(f"plan = {path!r}: cannot read the plan file ({err.strerror}); {PLAN_FILE_HELP}") from None
    except UnicodeDecodeError as err:
        raise PlanError(f"{path}: not UTF-8 text (byte {err.start}); write the plan again with hybridpar plan "
                        "--out FILE") from None
    plan = Plan.from_json(text, where=path)
    return plan, set(json.loads(text))


def _from_file(config: Config, graph: ModelGraph, world_size: int, rescale: bool = False) -> Plan:
    """The plan file checked against the world size, the config and the model; priced on
    ``config.cluster`` if given (else it keeps the prediction it was written with)."""
    where = config.plan
    plan, stated = _plan_file(config, world_size, rescale)
    plan = _for_config(plan, stated, config, graph, where)
    if not config.cluster:
        try:
            check_grid(graph, plan.grid)
        except PlanError as err:
            raise PlanError(f"{where}: spatial = {list(plan.spatial)}: {err}") from None
        return plan
    from hybridpar.plan import validate

    spec = _cluster(config, world_size)
    try:
        return replace(validate(plan, graph, spec), cluster=spec.name)
    except PlanError as err:
        raise PlanError(f"{where} on {world_size} x {spec.name} (cluster = {config.cluster!r}): {err}") from None


def _plan_file(config: Config, world_size: int, rescale: bool = False) -> tuple[Plan, set[str]]:
    """The plan file and the keys it states, checked against what needs no model: its degrees, the model it was
    made for and the world size (``rescale``: re-planned for ``world_size``)."""
    where = config.plan
    plan, stated = read_plan_file(where)
    try:
        _ = plan.dims  # each degree a whole number >= 1
    except MeshError as err:
        raise PlanError(f"{where}: {err}") from None
    made_for = _model_family(plan.model)
    if made_for and made_for != config.model.name:
        raise PlanError(f"{where} is a plan for model {plan.model!r}, but the config trains {config.model.name!r}; "
                        f"make a plan for this model (hybridpar plan --model {config.model.name} ... --out FILE, "
                        'or plan = "auto")')
    if plan.world_size != world_size and rescale:
        plan = rescaled(plan, world_size, where)
    if plan.world_size != world_size:
        raise PlanError(f"{where}: the plan ({plan.describe()}) needs {plan.world_size} processes, but the world "
                        f"size is {world_size}; run it on {plan.world_size} (--nproc {plan.world_size}, or torchrun "
                        f"with that many), or plan again for {world_size} devices")
    return plan, stated


def _model_family(name: str) -> str:
    """The config's ``model.name`` of a plan's ``model`` (a GPT preset is a ``gpt``); ``""`` where unknown (a
    plan written by hand, a ``pkg.module:factory`` model)."""
    from hybridpar.models.gpt import GPT_PRESETS
    from hybridpar.models.registry import VOLUME_MODELS

    if name in GPT_PRESETS or name == "gpt":
        return "gpt"
    return name if name in VOLUME_MODELS else ""


def _for_config(plan: Plan, stated: set[str], config: Config, graph: ModelGraph, where: str) -> Plan:
    """``plan`` with the run's batch, dtype, optimizer and input shape: a value the file states must be
    the config's (the plan was priced for it); one it leaves out is taken from the config."""
    batch = config.train.batch_size
    shape = "x".join(map(str, graph.input_shape))
    run = {"global_batch": (batch, f"train.batch_size = {batch}", f"--batch {batch}"),
           "dtype": (config.train.dtype, f"train.dtype = {config.train.dtype!r}", f"--dtype {config.train.dtype}"),
           "optimizer": (config.optimizer.name, f"optimizer.name = {config.optimizer.name!r}",
                         f"--optimizer {config.optimizer.name}"),
           "input_shape": (graph.input_shape, f"the data and train.batch_size give {shape}", f"--input {shape}")}
    for field, (value, given, option) in run.items():
        if field in stated and getattr(plan, field) != value:
            mine = getattr(plan, field)
            mine = "x".join(map(str, mine)) if field == "input_shape" else repr(mine)
            raise PlanError(f"{where}: {field} = {mine}, but {given}; plan again with hybridpar plan {option}, "
                            f"or remove {field} from the plan file")
    if batch % plan.dp:
        raise PlanError(f"{where}: dp = {plan.dp} does not divide train.batch_size = {batch}; use a batch size "
                        f"divisible by {plan.dp}, or another plan")
    ndim = len(graph.input_shape) - 2
    spatial = plan.spatial
    if all(p == 1 for p in spatial):
        spatial = (1,) * max(ndim, 1)
    elif len(spatial) != ndim:
        raise PlanError(f"{where}: spatial = {list(spatial)}: give {ndim} part counts, one per spatial dim of the "
                        f"samples {tuple(graph.input_shape[1:])} (channels first)")
    return replace(plan, spatial=spatial, global_batch=batch, dtype=config.train.dtype,
                   optimizer=config.optimizer.name, input_shape=graph.input_shape)


def local_world_size(config: Config, nproc: int | None, where: str, resume: bool = False) -> int:
    """The number of local workers for ``hybridpar train`` (not under torchrun): ``--nproc`` with
    ``plan = "auto"`` (required), the plan's world size with a plan file (or ``--nproc``: checked later
    against the plan), else ``mesh.dp x prod(mesh.spatial)`` (``--nproc`` must agree, unless the run resumes:
    then it is re-planned for ``--nproc``)."""
    if config.plan == "auto":
        if nproc is None:
            raise ConfigError(f'plan = "auto" in {where} needs the number of workers: pass --nproc N (under '
                              f"torchrun the world size is used)")
        return nproc
    if config.plan:
        return nproc or read_plan_file(config.plan)[0].world_size
    world = config.mesh.dp * math.prod(config.mesh.spatial)
    if resume and nproc:
        return nproc
    if (nproc or world) != world:
        raise ConfigError(f"--nproc {nproc} does not match mesh.dp x prod(mesh.spatial) = {world} in {where}; "
                          f"use --nproc {world} or change [mesh]")
    return world


def planned_world_size(config: Config, run_dir) -> int | None:
    """The number of processes the run was planned for before this invocation: ``[mesh]``'s, the plan file's,
    or (``plan = "auto"``) that of the plan kept in ``run_dir``; ``None`` where unknown."""
    if not config.plan:
        return config.mesh.dp * math.prod(mesh_spatial(config))
    path = config.plan if config.plan != "auto" else run_dir / "plan.json"
    try:
        return read_plan_file(str(path))[0].world_size
    except (ConfigError, PlanError):
        return None


def describe(config: Config, plan: Plan, saved_as: str) -> str:
    """The line rank 0 prints before training: the plan, where it came from, its prediction."""
    n = plan.world_size
    if config.plan == "auto":
        source = f"searched for {n} x {plan.cluster}"
    elif config.cluster:
        source = f"from {config.plan}, priced for {n} x {plan.cluster}"
    else:
        source = f"from {config.plan}" + (f", as predicted for {plan.cluster}" if plan.prediction else "")
    if plan.prediction is None:
        cost = "no prediction (set cluster to price it)"
    else:
        pred = plan.prediction
        cost = (f"predicted {pred.step_time * 1e3:.4g} ms per step, {pred.memory.get('total', 0) / GiB:.3g} GiB "
                f"per device")
    return f"plan {plan.describe()} ({source}): {cost}; written to {saved_as}"

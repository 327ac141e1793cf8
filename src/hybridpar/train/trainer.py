"""The training loop of ``hybridpar train``: one call per rank, inside an initialised process group, the same
skeleton for every task (``hybridpar.train.tasks``: volumes, tokens).

Order of work: check the config, the task's data and model, the plan (searched, read, or ``[mesh]``'s:
``train/planning.py``) on every rank (identically, before any communication); build the model from the seed
(the same weights on every rank) and apply the plan with ``hybridpar.parallelize``; then train. Step ``s``
(0-based) reseeds the random generators from ``(seed, s)`` and the task's rank offset and trains on the task's
batch ``s``, so a run resumed from a checkpoint, under this plan or another, repeats the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from hybridpar.errors import ConfigError, HybridparError, TrainingError
from hybridpar.plan import Plan
from hybridpar.plan.cost import optimizer_state_bytes
from hybridpar.train import balance, checkpoint_dir, faults, finite, links, pace, planning, recovery, watchdog
from hybridpar.train.agree import agreed, agreed_mesh, mean_over_dp
from hybridpar.train.config import Config
from hybridpar.train.metrics import MetricsLog, check_tensorboard
from hybridpar.train.optim import build_optimizer, learning_rate, set_learning_rate
from hybridpar.train.tasks import Task, task_for

logger = logging.getLogger(__name__)


class _Quiet:
    """The progress of a rank that shows none."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def advance(self, record: dict) -> None:
        pass

    def validated(self, step: int, metrics: dict) -> None:
        pass


@dataclass
class Run:
    """Everything one rank needs to train: the task, the parallel model and its optimizer."""

    config: Config
    plan: Plan
    task: Task
    parallel: object  # hybridpar.ParallelModel
    optimizer: torch.optim.Optimizer
    cadence: checkpoint_dir.Cadence
    pace: pace.Pace
    links: links.Links
    faults: faults.Armed | None = None

    @property
    def total_steps(self) -> int:
        return self.task.total_steps


def check(config: Config, world_size: int, rescale: bool = False) -> int:
    """The checks that need no process group: the task's data and model (built on the meta device) and the plan
    (searched, read or from ``[mesh]``, for ``world_size`` processes, checked against the model as
    ``hybridpar.parallelize`` will apply it; ``rescale``: re-planned for a resumed run's ``world_size``).
    ``hybridpar train`` runs them before starting workers, and every worker runs them again before any
    communication. Returns the run's step count."""
    task = task_for(config)
    try:
        task.check(world_size, rescale)
        return task.total_steps
    finally:
        task.close()


def setup(config: Config, task: Task, plan: Plan, speeds: tuple[float, ...] | None = None, mesh=None) -> Run:
    """The mesh (``mesh``: of a plan of the same degrees), the parallel model, its optimizer and the task's data,
    for a checked task and its plan (sized for the ranks' ``speeds``, or a mixed cluster's: ``pace.Pace``)."""
    parallel = task.setup(plan, mesh if mesh is not None else agreed_mesh(config, plan))
    local = sum(p.numel() * p.element_size() for p in (q.to_local() if isinstance(q, DTensor) else q
                                                         for q in parallel.parameters()))
    cadence = checkpoint_dir.Cadence(config, dist.get_world_size(),
                                     local + optimizer_state_bytes(local, config.optimizer.name))
    exchanges = links.Links(config, *pace.exchange_counters(parallel))
    # before the timing's hooks: a slowed rank's forward is timed slow
    armed = faults.arm(parallel, exchanges.counters)
    return Run(config, plan, task, parallel, build_optimizer(parallel.parameters(), config.optimizer), cadence,
               pace.Pace(config, plan, parallel, speeds or planning.cluster_speeds(config, task.analysed[2], plan),
                         planning.layers_for(task.analysed[2], plan)), exchanges, armed)


def train_step(run: Run, step: int, x: torch.Tensor, y: torch.Tensor, signal: int = 0,
               saver: checkpoint_dir.Saver | None = None) -> tuple[float, float, bool, int, bool]:
    """One optimizer step; returns the global batch's loss, the learning rate, whether the weights were
    updated (not with a NaN or infinite loss: ``train.finite``), the stop signal any rank received (0: none;
    this rank's is ``signal``) and whether the automatic checkpoint interval has passed. A checkpoint's copy
    in flight (``saver``) is waited for before the update: what it held the step up goes to Young/Daly."""
    cfg = run.config
    lr = learning_rate(step, run.total_steps, cfg.optimizer.lr, cfg.schedule)
    set_learning_rate(run.optimizer, lr)
    torch.manual_seed(cfg.seed + 1_000_003 * (step + 1) + run.task.seed_offset())  # this step's dropout masks
    if run.faults is not None:
        run.faults.at(step + 1)
    run.optimizer.zero_grad(set_to_none=True)
    loss = faults.after_backward(step + 1, run.parallel.train_step(x, y))
    updated, signal, timed = finite.update_allowed(cfg, step + 1, loss, signal, run.cadence.timed(),
                                                   saver.wait if saver is not None else None)
    blocked = saver.staged() if saver is not None else None
    if blocked is not None:
        run.cadence.saved(blocked, run.parallel.device)
    if updated:
        run.optimizer.step()
        faults.after_update(step + 1, run.parallel.parameters())
    return mean_over_dp(run.parallel.mesh, loss, run.parallel.loss_weight), lr, updated, signal, timed


def _announce(run: Run, log: MetricsLog, start: int, restarted: bool, planned: int | None) -> None:
    """Rank 0's warnings of the task; a restart and a re-plan (a run resumed on another number of processes than
    it was planned for), logged and recorded in the metrics."""
    is_root = dist.get_rank() == 0
    if is_root:
        for warning in run.task.warnings():
            logger.warning(warning)
        logger.info(run.cadence.describe())
    if restarted:
        if is_root:
            logger.info(f"restart {recovery.attempt()} of {recovery.max_restarts()}: training from step {start}")
        log.log({"step": start, "split": "restart", "attempt": recovery.attempt(), "of": recovery.max_restarts()})
    if planned is not None and planned != run.plan.world_size:
        reason = f"{planned} processes planned, {run.plan.world_size} present"
        if is_root:
            logger.warning(f"re-planned at step {start}: {run.plan.describe()} ({reason})")
        log.log({"step": start, "split": "replan", "plan": run.plan.describe(), "reason": reason})


@dataclass
class _Loop:
    """What the training loop carries from plan to plan: where rank 0 writes the records (``metrics.jsonl``; the
    timing in ``pace.jsonl``) and shows its progress, the summary the run returns, the rebalancing."""

    log: MetricsLog
    pace: MetricsLog
    shown: object
    summary: dict
    balancer: balance.Balancer
    saver: checkpoint_dir.Saver
    watchdog: watchdog.Watchdog | None = None

    def phase(self, kind: str, step: int | None, expected: float | None = None) -> None:
        """A phase of the loop begins (``watchdog.Watchdog``: past its deadline it is a hang)."""
        if self.watchdog is not None:
            self.watchdog.phase(kind, step, expected)


def _step(run: Run, step: int, x, y, signal: int, out: _Loop) -> tuple[int, object]:
    """Step ``step`` with its record, checkpoint and validation where due; returns the agreed stop signal (a
    checkpoint is then due, and no validation) and, at the end of a window of steps, what the timing found
    (``pace.Window``)."""
    config, log, shown, summary = run.config, out.log, out.shown, out.summary
    stop = summary["steps"]
    out.phase("step", step + 1)
    run.pace.begin()
    run.links.begin()
    loss, lr, updated, signal, timed = train_step(run, step, x, y, signal, out.saver)
    done = step + 1
    window = run.pace.end(done)
    if window is not None:
        _report(window, out)
    exchanges = run.links.end(done)
    if exchanges is not None:
        _report_links(exchanges, out)
    record = {"step": done, "split": "train", "loss": loss, "lr": lr, **run.task.record()}
    if not updated:
        record["skipped"] = True
    log.log(record)
    shown.advance(record)
    summary["loss"] = loss
    # the checkpoint first: a validation file that fails to read then loses no training
    if run.cadence.due(done, stop, run.total_steps, timed) or signal:
        _save(run, done, out)
    if run.task.has_validation and checkpoint_dir.due(done, config.validation.every, stop, run.total_steps) \
            and not signal:
        out.phase("validation", done)
        summary["val"] = run.task.validate()
        log.log({"step": done, "split": "val", **summary["val"]})
        shown.validated(done, summary["val"])
    out.phase("batch", done)  # the next batch's reading (an agreement over every rank where it comes from files)
    return signal, window


def _save(run: Run, done: int, out: _Loop) -> None:
    """The checkpoint of step ``done`` (never of weights that are not finite) started, written in the background
    (``checkpoint_dir.Saver``) once the one before is finished; the time it held the step up kept for
    Young/Daly."""
    config = run.config
    _saved(out, done)  # first: a refusal below names the last checkpoint
    finite.check_weights(config, done, list(run.parallel.parameters()), run.parallel.device)
    out.phase("checkpoint", done, run.cadence.save_time)
    out.saver.save(Path(config.run_dir) / "checkpoints", done,
                   checkpoint_dir.state_of(run.parallel, run.optimizer, buffers_copied=True),
                   keep=config.checkpoint.keep)


def _saved(out: _Loop, step: int) -> None:
    """The checkpoint in flight, if any, finished (``summary["checkpoint"]``; collective where there is one)."""
    if out.saver.pending:
        out.phase("checkpoint write", step, out.saver.write_s)
        out.summary["checkpoint"] = str(out.saver.wait())


def _report(window: pace.Window, out: _Loop) -> None:
    """A window's timing in ``pace.jsonl``; a rank found slow in the metrics and on screen (rank 0)."""
    out.pace.log(window.record())
    hint = "" if out.balancer.enabled else ("; train.rebalance = true (hybridpar train --rebalance) gives it less "
                                            "work")
    for rank, factor in window.slow.items():
        if dist.get_rank() == 0:
            logger.warning(f"rank {rank} is slow: its forward takes {factor:.2f}x its peers' per unit of work "
                           f"(steps to {window.step}){hint}")
        out.log.log({"step": window.step, "split": "slow", "rank": rank, "factor": factor})


def _report_links(window: links.LinkWindow, out: _Loop) -> None:
    """A window's exchange timing in ``pace.jsonl``; a link found slow in the metrics and on screen (rank 0)."""
    out.pace.log(window.record())
    for link, factor in window.slow.items():
        if dist.get_rank() == 0:
            logger.warning(f"{link.describe()} is slow: {factor:.2f}x its peers' time per byte, "
                           f"{window.seconds[link]:.3g} s of a {window.step_s:.3g} s step (steps to {window.step})")
        out.log.log({"step": window.step, "split": "slow-link", "kind": link.kind, "ranks": list(link.ranks),
                     "factor": factor, "seconds": window.seconds[link], "step_s": window.step_s})


def _train_until(run: Run, start: int, stop: int, stopping, out: _Loop):
    """Steps from ``start``; returns ``(step reached, stop signal, re-plan)``: after a stop signal, at a window
    that asks for a new plan (``balance.Balancer``), or at ``stop``."""
    for step, x, y in _batches(run, start, stop):
        signal, window = _step(run, step, x, y, stopping.signal, out)
        if signal:
            return step + 1, signal, None
        if window is not None and step + 1 < stop and out.balancer.wants(window):
            decided = out.balancer.decide(run.plan, run.pace.speeds, window, run.task.analysed)
            if isinstance(decided, balance.Replan):
                out.phase("re-plan", step + 1)
                return step + 1, 0, decided
            if dist.get_rank() == 0:
                logger.warning(decided)
    return stop, 0, None


def _replanned(run: Run, done: int, replan: balance.Replan, out: _Loop) -> Run:
    """The run re-planned after step ``done`` (``replan``): its state saved (a checkpoint of step ``done``) and
    loaded into the new plan's model, in the same processes."""
    name = f"step_{done:08d}"
    _saved(out, done)
    if not out.summary.get("checkpoint", "").endswith(name):  # not saved at this step already (alike on every rank)
        _save(run, done, out)
        _saved(out, done)
    path, mesh = Path(out.summary["checkpoint"]), run.parallel.mesh
    run.pace.close()
    run.links.close()
    run.parallel = run.optimizer = run.task.parallel = None  # the old model's memory free before the new one's
    gc.collect()
    if mesh.device_type == "cuda":
        torch.cuda.empty_cache()
    new = setup(run.config, run.task, replan.plan, replan.speeds, mesh)  # the same degrees: the same groups
    loaded = checkpoint_dir.load(path, new.parallel, new.optimizer)
    if loaded != done:
        raise TrainingError(f"the checkpoint of step {done} read back as step {loaded} ({path})")
    out.summary["mesh"] = replan.plan.describe()
    if dist.get_rank() == 0:
        logger.warning(f"re-planned at step {done}: {replan.told} ({replan.reason})")
    out.log.log({"step": done, "split": "replan", "plan": replan.told, "reason": replan.reason})
    return new


@contextlib.contextmanager
def _watched(start: int, out: _Loop):
    """The loop, from its first batch's reading (after step ``start``) on, under this rank's watchdog if it has
    one (no phase of it after the loop); a checkpoint still in flight when the loop fails is let finish (its own
    failure then told in the log only)."""
    out.phase("batch", start)
    try:
        yield
    except BaseException:
        if out.saver.pending:
            try:
                out.saver.wait()
            except HybridparError as err:
                logger.warning(str(err))
        raise
    finally:
        if out.watchdog is not None:
            out.watchdog.idle()


def finished_at(total_steps: int, resume_from: Path | None) -> int | None:
    """The step count of a run that has nothing left to train: resumed where an intact checkpoint (its files match
    its manifest) is at ``total_steps`` or past it (``checkpoint_dir.finished_step``)."""
    if resume_from is None:
        return None
    return checkpoint_dir.finished_step(resume_from.parent, total_steps)


def _batches(run: Run, start: int, stop: int):
    """The task's batches, agreed on by every rank where they come from files (``agree.agreed``)."""
    batches = run.task.batches(start, stop)
    return agreed(batches, run.parallel.device) if run.task.reads_files else batches


def prepare_run_dir(config: Config, resume: bool, restarted: bool = False) -> Path | None:
    """The checkpoint to resume from (``None`` for a fresh run); refuses to overwrite a previous run. A run
    restarted by the elastic agent resumes from its newest checkpoint, or starts again without one."""
    run_dir = Path(config.run_dir)
    _check_writable(run_dir)
    found = checkpoint_dir.checkpoints(run_dir / "checkpoints")
    if restarted:
        return found[-1][1] if found else None
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


def _check_writable(run_dir: Path) -> None:
    """``run_dir``, or the nearest folder above it that exists, must be a folder this process may write in."""
    existing = next(p for p in (run_dir, *run_dir.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"run_dir = {str(run_dir)!r}: {existing} is a file, not a folder; set another run_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"run_dir = {str(run_dir)!r}: cannot write in {existing} (read-only, or not yours); set "
                          "another run_dir")


def train(config: Config, *, resume: bool = False, stop_after: int | None = None, progress=None) -> dict:
    """Train on this rank; returns the run's summary (on every rank). Rank 0 logs the plan and the data's
    warnings (``logging``) and shows ``progress(config, start, stop)``: a context manager with ``advance(record)``
    and ``validated(step, metrics)`` (the command's progress bar and lines; none by default)."""
    check_tensorboard(config)  # on every rank, before any collective
    faults.planned()
    restarted = recovery.attempt() > 0
    resume_from = prepare_run_dir(config, resume, restarted)
    resuming = resume_from is not None or restarted
    dog = watchdog.for_this_rank(config, carried=resuming)  # a restart's set-up is watched too
    try:
        return _train(config, resume_from, restarted, dog, stop_after, progress)
    finally:
        if dog is not None:
            dog.close()


def _train(config: Config, resume_from: Path | None, restarted: bool, dog: watchdog.Watchdog | None,
           stop_after: int | None, progress) -> dict:
    """``train``'s work, from the set-up on (under ``dog``, this rank's watchdog, if any)."""
    if dog is not None:
        dog.phase(watchdog.SET_UP, None)
    task = task_for(config)
    resuming = resume_from is not None or restarted
    plan = task.check(dist.get_world_size(), rescale=resuming)
    planned = planning.planned_world_size(config, Path(config.run_dir)) if resuming else None
    done = finished_at(task.total_steps, resume_from)
    if done is not None:  # the same answer on every rank, from the same files: nothing to build
        task.close()
        return {"start_step": done, "steps": done, "total_steps": task.total_steps, "finished": True}
    dist.barrier()  # every rank has looked at run_dir before rank 0 writes to it
    run = setup(config, task, plan)
    start = 0
    if resume_from:
        if dog is not None:  # read twice (its manifest's hashes, then its tensors), each first priced as a save
            dog.phase("checkpoint read", None, 2 * run.cadence.save_time)
        start = checkpoint_dir.resume(resume_from.parent, run.parallel, run.optimizer)
    stop = min(run.total_steps, stop_after or run.total_steps)
    is_root = dist.get_rank() == 0
    run_dir = Path(config.run_dir)
    if is_root:
        run_dir.mkdir(parents=True, exist_ok=True)
        if config.plan:  # a plan searched or read: kept beside the run ([mesh]'s is the config itself)
            (run_dir / "plan.json").write_text(run.plan.to_json() + "\n")
            logger.info(planning.describe(config, run.plan, str(run_dir / "plan.json")))
    resume_step = start if resume_from or restarted else None
    log = MetricsLog(run_dir, jsonl=config.metrics.jsonl and is_root, tensorboard=config.metrics.tensorboard and
                     is_root, resume_step=resume_step)
    _announce(run, log, start, restarted, planned)
    summary = {"start_step": start, "steps": stop, "total_steps": run.total_steps, "val": None,
               "mesh": run.plan.describe()}
    begin = time.perf_counter()
    shown = progress(config, start, stop) if progress is not None and is_root else _Quiet()
    out = _Loop(log, MetricsLog(run_dir, jsonl=config.metrics.jsonl and is_root, tensorboard=False,
                                resume_step=resume_step, name="pace.jsonl"), shown, summary,
                balance.Balancer(config.train.rebalance), checkpoint_dir.Saver(), dog)
    with shown, recovery.Stopping() as stopping, _watched(start, out):
        step = start
        while step < stop:
            step, signal, replan = _train_until(run, step, stop, stopping, out)
            if signal:  # SIGTERM or SIGINT on some rank: stopped after this step, with a checkpoint
                summary.update(steps=step, signal=signal)
                break
            if replan is not None:
                run = _replanned(run, step, replan, out)
        _saved(out, step)  # the last checkpoint finished before the run returns
    summary["time_s"] = time.perf_counter() - begin
    summary.update(run.task.finish())
    log.close()
    return summary


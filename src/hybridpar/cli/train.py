"""``hybridpar train CONFIG``: a model trained from a TOML config, under torchrun or on local workers."""

from __future__ import annotations

import contextlib

from rich.console import Console

from hybridpar.cli.args import non_negative, positive
from hybridpar.errors import ConfigError, HybridparError, RunStopped

LOST_PEER_WAIT_S = 5.0  # a rank whose peer died waits this long for the agent to stop it
OVERSUBSCRIBE = 4  # local workers per CPU core beyond which a run is refused unless --oversubscribe


def add_parser(sub) -> None:
    train = sub.add_parser("train", help="train a model from a TOML config (under torchrun, or on local workers)")
    train.add_argument("config", help="the TOML config (keys: docs/config.md)")
    train.add_argument("--nproc", type=positive, default=None,
                       help="local workers to start (default: mesh.dp x prod(mesh.spatial), or the plan file's; "
                            "required with plan = \"auto\"; with --resume, another number re-plans the run); "
                            "ignored under torchrun")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in run_dir")
    train.add_argument("--stop-after", type=positive, default=None, metavar="STEPS",
                       help="stop (with a checkpoint) once this many steps are done, e.g. before a job's time limit")
    train.add_argument("--max-restarts", type=non_negative, default=0, metavar="N",
                       help="after a worker dies, restart all of them from the newest intact checkpoint, up to N "
                            "times (under torchrun: torchrun's own --max-restarts)")
    train.add_argument("--rebalance", action="store_true",
                       help="give a rank found slow less work (train.rebalance = true): uneven slabs or batch shares "
                            "sized to the measured speeds, the run re-planned in place from a checkpoint")
    train.add_argument("--oversubscribe", action="store_true",
                       help=f"start local workers even when there are more than {OVERSUBSCRIBE} per CPU core")


def run(args, console: Console) -> int:
    import os

    from hybridpar.train.config import load
    from hybridpar.train.metrics import check_tensorboard

    config = load(args.config)  # no torch yet: a mistake in the config is reported at once
    if args.rebalance:
        from dataclasses import replace

        config = replace(config, train=replace(config.train, rebalance=True))
    check_tensorboard(config)
    from hybridpar.train.faults import planned

    planned()  # HYBRIDPAR_FAULTS, when a test or demonstration asks for faults
    from pathlib import Path

    from hybridpar.cli.progress import format_metrics
    from hybridpar.train.planning import local_world_size
    from hybridpar.train.recovery import stopped_message
    from hybridpar.train.run_lock import RunDirLock
    from hybridpar.train.trainer import check, finished_at, prepare_run_dir

    if "TORCHELASTIC_RUN_ID" in os.environ or "WORLD_SIZE" in os.environ:  # under torchrun
        result = worker(config, args.resume, args.stop_after)
        if int(os.environ.get("RANK", "0")) != 0:
            return 2 if "error" in result else 128 + result["signal"] if result.get("signal") else 0
    else:
        nproc = local_world_size(config, args.nproc, args.config, args.resume)
        _check_cores(nproc, args.oversubscribe)
        with RunDirLock(config.run_dir):  # one run at a time in run_dir; its workers end with this process
            resume_from = prepare_run_dir(config, args.resume)
            total = check(config, nproc, rescale=args.resume)  # the model, the data, the plan: before any worker
            done = finished_at(total, resume_from)
            if done is None:
                result = _launch(config, args, nproc, console)
            else:
                result = {"finished": True, "steps": done}
    if "error" in result:
        raise HybridparError(result["error"])
    if result.get("signal"):
        console.print(stopped_message(result["signal"], Path(config.run_dir)), highlight=False, soft_wrap=True)
        return 128 + result["signal"]
    if result.get("finished"):
        console.print(f"run_dir = {config.run_dir!r} finished its {result['steps']} steps already (nothing to "
                      "train); raise train.steps or train.epochs to train on", highlight=False, soft_wrap=True)
        return 0
    done = result["steps"]
    if done < result["total_steps"]:
        console.print(f"stopped after step {done} of {result['total_steps']}; continue with --resume")
    if result["val"]:
        console.print(f"final validation: {format_metrics(result['val'])}", highlight=False, soft_wrap=True)
    mib = [b / 2**20 for b in result["bytes_read_per_rank"]]
    read = f"read per rank {', '.join(f'{m:.1f}' for m in mib)} MiB; " if mib else ""
    console.print(f"trained steps {result['start_step']}..{done} on {result['mesh']} in {result['time_s']:.1f} s; "
                  f"{read}outputs in {config.run_dir}", highlight=False, soft_wrap=True)
    return 0


def _launch(config, args, nproc: int, console: Console) -> dict:
    """Rank 0's result of ``nproc`` local workers, restarted up to ``--max-restarts`` times after a failure, each
    failure and a stop signal told in one line."""
    import signal
    from pathlib import Path

    from hybridpar.launch import STOP_GRACE_S, Signalled, WorkersFailed, launch_local
    from hybridpar.train.recovery import describe, last_checkpoint

    run_dir = Path(config.run_dir)
    told: list[str] = []  # the last attempt's hang, as its watchdog told it

    def report(failures: dict, restarts_left: int, hang: str | None) -> None:
        told[:] = [hang] if hang else []
        if restarts_left > 0:
            attempt = args.max_restarts - restarts_left + 1
            console.print(f"{describe(failures, run_dir, hang=hang)}; restarting ({attempt} of {args.max_restarts})",
                          highlight=False, soft_wrap=True)

    def stopping(number: int) -> None:
        console.print(f"{signal.Signals(number).name}: the workers finish their step and write its checkpoint "
                      f"(waiting up to {STOP_GRACE_S} s; a second Ctrl-C or SIGKILL stops them at once)",
                      highlight=False, soft_wrap=True)

    try:
        return launch_local(worker, (config, args.resume, args.stop_after, True), nproc, max_restarts=args.max_restarts,
                            on_failure=report, on_stop=stopping,
                            preload=("hybridpar.train.trainer", "hybridpar.cli.progress"))[0]
    except Signalled as stop:  # the workers stopped after their step, with a checkpoint
        return {"signal": stop.signal}
    except KeyboardInterrupt:  # a second Ctrl-C while they did: they ended at once, with the launcher
        raise RunStopped(f"stopped at once by a second Ctrl-C; {last_checkpoint(run_dir)}; continue with --resume",
                         exit_code=130) from None
    except WorkersFailed as failed:
        tried = f" after {args.max_restarts} restart(s)" if args.max_restarts else ""
        hint = "" if args.max_restarts else " (or let --max-restarts N restart it)"
        raise RunStopped(f"{describe(failed.failures, run_dir, tried, *told)}; continue with --resume{hint}",
                         exit_code=1) from None


def _check_cores(nproc: int, oversubscribe: bool) -> None:
    """Refuse far more local workers than cores: they would crawl (and gloo's timeouts would end the run)."""
    import os

    cores = os.cpu_count() or 1
    if nproc > OVERSUBSCRIBE * cores and not oversubscribe:
        raise ConfigError(f"{nproc} local workers on {cores} CPU cores (more than {OVERSUBSCRIBE} per core): use fewer "
                          "ranks, run under torchrun on more nodes, or pass --oversubscribe to start them anyway")


def worker(config, resume: bool, stop_after: int | None, local: bool = False) -> dict:
    """One worker started by ``torchrun`` or (``local``) by the command's elastic agent: join the group, train
    (rank 0 printing the trainer's log and progress), leave. A user error is returned (raised identically on
    every rank before any communication), not thrown, so the command can print it in one line. A local worker
    stopped by a signal exits at once: the agent that passed the signal on no longer reads what workers return
    (and they would wait for it to)."""
    import os

    from hybridpar.cli.progress import Progress
    from hybridpar.launch import die_with, init_distributed, shutdown_distributed
    from hybridpar.train.recovery import lost_peer
    from hybridpar.train.trainer import train

    _log_to_console()
    if not local and "TORCHELASTIC_RUN_ID" in os.environ:
        die_with(os.getppid())  # torchrun's agent; a local worker watches its launcher already
    init_distributed()
    try:
        with contextlib.nullcontext() if local else _run_dir_lock(config.run_dir):
            result = train(config, resume=resume, stop_after=stop_after, progress=Progress)
    except HybridparError as err:
        result = {"error": str(err)}
    except RuntimeError as err:
        if not lost_peer(err):
            raise  # a bug of hybridpar: its traceback is wanted
        _leave_quietly()
    if local and result.get("signal"):
        _exit_stopped(128 + result["signal"])
    shutdown_distributed()
    return result


@contextlib.contextmanager
def _run_dir_lock(run_dir):
    """Under torchrun: run_dir locked by global rank 0 (``RunDirLock``) while it trains, its verdict broadcast, so
    that every rank of a second run on the folder refuses alike. The job's own restarts take the lock over: the
    rank 0 before them has ended, and the kernel has let go of its lock."""
    import torch.distributed as dist

    from hybridpar.train.run_lock import RunDirBusy, RunDirLock

    lock, verdict = RunDirLock(run_dir), [""]
    if dist.get_rank() == 0:
        try:
            lock.__enter__()
        except HybridparError as err:
            verdict = [str(err)]
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise RunDirBusy(verdict[0])
    try:
        yield
    finally:
        lock.__exit__(None, None, None)


def _exit_stopped(code: int) -> None:
    """End a local worker stopped by a signal once every rank has its checkpoint, at once: the agent that passed
    the signal on no longer reads what workers return, and waits for them (a process group's teardown can stall
    on a loaded machine)."""
    import os
    import sys

    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _leave_quietly() -> None:
    """End a rank that lost a peer: the launcher tells which rank died. It waits first, so that the agent sees
    the dead rank fail before this one (its stop signal ends the wait), then exits at once (gloo's threads would
    abort an orderly exit)."""
    import os
    import signal
    import sys
    import time

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.stdout.flush()
    time.sleep(LOST_PEER_WAIT_S)
    os._exit(1)


def _log_to_console() -> None:
    """hybridpar's log records of this process on its console: information on stdout, warnings on stderr."""
    import logging
    import sys

    logger = logging.getLogger("hybridpar")
    if logger.handlers:
        return
    out = logging.StreamHandler(sys.stdout)
    out.addFilter(lambda record: record.levelno < logging.WARNING)
    err = logging.StreamHandler(sys.stderr)
    err.setLevel(logging.WARNING)
    err.setFormatter(logging.Formatter("warning: %(message)s"))
    logger.addHandler(out)
    logger.addHandler(err)
    logger.setLevel(logging.INFO)
    logger.propagate = False

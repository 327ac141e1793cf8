"""``hybridpar verify CONFIG``: the run's plan proved on its model before a long run: one float64 training step on
local processes against one process, the worst difference per tensor and a verdict (``hybridpar.verify``)."""

from __future__ import annotations

from rich.console import Console
from rich.text import Text

from hybridpar.cli.args import positive


def add_parser(sub) -> None:
    verify = sub.add_parser("verify", help="run one float64 step of a config's plan against one process, on local "
                                           "processes, and compare every tensor")
    verify.add_argument("config", help="the TOML config (keys: docs/config.md)")
    verify.add_argument("--nproc", type=positive, default=None,
                        help="processes to verify on (default: the plan's; required with plan = \"auto\")")
    verify.add_argument("--top", type=positive, default=10, help="tensors to show, worst first (default 10)")


def run(args, console: Console) -> int:
    from hybridpar.train.config import load

    config = load(args.config)  # no torch yet: a mistake in the config is reported at once
    from hybridpar.train.planning import local_world_size
    from hybridpar.train.tasks import task_for

    task = task_for(config)
    try:
        plan = task.check(local_world_size(config, args.nproc, args.config))
        model, batch, loss_fn = task.verification(plan)
    finally:
        task.close()
    console.print(f"[bold]hybridpar verify[/]: {plan.describe()} on {plan.world_size} local processes against one "
                  f"process, one float64 step on a batch of {plan.global_batch}", highlight=False)
    return show(verify_locally(model, plan, batch, loss_fn), console, args.top)


def verify_locally(model, plan, batch, loss_fn):
    """``hybridpar.verify`` on local processes, PyTorch's own reports of a worker that failed silenced (the error
    says which rank died, in a line)."""
    import logging

    from hybridpar.errors import RunStopped
    from hybridpar.launch import WorkersFailed
    from hybridpar.verification import verify

    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        return verify(model, plan, batch, loss_fn=loss_fn)
    except WorkersFailed as failed:
        rank, failure = min(failed.failures.items())
        raise RunStopped(f"verify: rank {rank} failed ({failure.message or f'exit code {failure.exitcode}'})",
                         exit_code=1) from None


def show(report, console: Console, top: int | None = 10) -> int:
    """The report, worst tensor first; 0 where the plan is exact, 1 where it differs or was refused."""
    colour = {"exact": "green", "refused": "yellow"}.get(report.verdict, "red")
    head, *rows = report.lines(top)
    console.print(Text(head, style=colour), soft_wrap=True)
    for row in rows:
        console.print(row, highlight=False, markup=False)
    return 0 if report.verdict == "exact" else 1

"""What rank 0 of ``hybridpar train`` shows while training (the trainer's ``progress``): a progress bar on a
terminal, and a line every ``log_every`` steps (and after each validation) everywhere, so logs of batch jobs
tell the same story."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress


def format_metrics(metrics: dict) -> str:
    return "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())


class Progress:
    def __init__(self, config, start: int, stop: int, *, show: bool = True):
        self.show, self.every = show, config.train.log_every
        self.console = Console()
        self.samples_per_step = config.train.batch_size
        self.bar = RichProgress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"),
                                TimeElapsedColumn(), TimeRemainingColumn(), console=self.console,
                                disable=not (show and self.console.is_terminal), transient=True)
        self.task = self.bar.add_task("train", total=stop, completed=start, info="")
        self.stop, self._last = stop, (start, time.perf_counter())

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)

    def advance(self, record: dict) -> None:
        step = record["step"]
        self.bar.update(self.task, completed=step, info=f"loss {record['loss']:.4f}")
        if self.show and (step % self.every == 0 or step == self.stop):
            last_step, last_time = self._last
            now = time.perf_counter()
            rate = (step - last_step) * self.samples_per_step / max(now - last_time, 1e-9)
            self._last = (step, now)
            self.console.print(f"step {step:>6}/{self.stop}  loss {record['loss']:.5f}  lr {record['lr']:.2e}  "
                               f"{rate:.1f} samples/s", highlight=False, soft_wrap=True)

    def validated(self, step: int, metrics: dict) -> None:
        if self.show:
            self.console.print(f"step {step:>6}/{self.stop}  [bold]validation[/]  {format_metrics(metrics)}",
                               highlight=False, soft_wrap=True)  # one line per record, even in 80-column logs

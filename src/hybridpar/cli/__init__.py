"""The ``hybridpar`` command: one module per command (``add_parser`` and ``run``), the flags' parsers in
``cli.args``. Errors a user can fix print in a line or two, without a traceback."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from hybridpar import __version__
from hybridpar.cli import calibrate, data, demo, plan, simulate, train, verify
from hybridpar.errors import HybridparError, RunStopped

COMMANDS = {"demo": demo, "train": train, "verify": verify, "data": data, "calibrate": calibrate, "plan": plan,
            "simulate": simulate}
LOG_WIDTH = 160  # columns of tables written to a file or a pipe (rich would wrap them at 80)


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its errors in one line: what is wrong, and where the help is (not the usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parser() -> argparse.ArgumentParser:
    out = _Parser(prog="hybridpar", description="Hybrid-parallel training on PyTorch.")
    out.add_argument("--version", action="version", version=f"hybridpar {__version__}")
    sub = out.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return COMMANDS[args.command].run(args, _console())
    except HybridparError as err:
        _print_error(str(err))
        return 2
    except RunStopped as stop:
        _print_error(str(stop))
        return stop.exit_code
    except KeyboardInterrupt:  # Ctrl-C before any worker started (a run's workers stop after their step)
        _print_error("interrupted")
        return 130


def _print_error(message: str) -> None:
    console = _console(stderr=True)
    console.print("[red]error[/]: ", end="")
    console.print(message, markup=False, highlight=False, soft_wrap=True)


def _console(stderr: bool = False) -> Console:
    """A console as wide as the terminal, or ``LOG_WIDTH`` columns where the output goes to a file or a pipe."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else LOG_WIDTH)


if __name__ == "__main__":
    sys.exit(main())

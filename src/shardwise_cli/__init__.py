"""The `shardwise` command line: `shardwise <command> [options]` (the console script's entry point).

Why a top-level package: importing anything under `shardwise.` first runs `shardwise/__init__.py`, which imports
torch (seconds, up to ~20 on a loaded machine). This package uses only the standard library until a command has
been parsed and checked, so a usage error or `--help` answers at once; the library is imported by the command's
handler. `python -m shardwise` runs the same `main`.

Each command is one module (demo.py, run.py, plan.py, bench.py) whose `add_<command>(subparsers)` declares the
options and sets `handler`, a function taking the parsed namespace and returning the exit code; common.py holds what
they share. `main()` only parses and dispatches, so a new command joins by adding its function to `_COMMANDS`. Values are validated while
parsing (argparse `type=` and `choices=`), so a bad value is a usage error (exit 2) naming the option, its value
and what is allowed, before any rank starts (and before torch is imported). A path that cannot be used (an `--out`
that cannot be written, a `--data` that cannot be trained on) is one line on stderr and exit code 1.

The option vocabulary the parser offers (strategies, schedules, presets, defaults) is spelled in common.py, torch-free;
the library spells its own and never imports this package (tests/test_import_graph.py), and
tests/test_reliability_cli.py checks that the two agree (`hybrid.DP_STRATEGIES`, `demo.SCHEDULES`,
`models.gpt.PRESETS`, `demo.DemoOptions()`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from .bench import BENCH_ROWS, add_bench
from .check import add_check
from .common import (DEMO_DEFAULTS, GLOO_RANKS_PER_CPU, MAX_RANKS, PRESETS, SCHEDULES, STRATEGIES, STRATEGY_ALIASES,
                     Version, max_ranks)
from .demo import add_demo
from .plan import PLAN_ATTENTION, PLAN_DTYPES, PLAN_OPTIMIZERS, add_plan
from .run import add_run

__all__ = ["main", "build_parser", "max_ranks", "STRATEGIES", "SCHEDULES", "PRESETS", "DEMO_DEFAULTS",
           "MAX_RANKS", "GLOO_RANKS_PER_CPU", "BENCH_ROWS", "STRATEGY_ALIASES", "PLAN_ATTENTION", "PLAN_DTYPES",
           "PLAN_OPTIMIZERS"]

_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (add_demo, add_run, add_plan, add_bench,
                                                                        add_check)


def build_parser() -> argparse.ArgumentParser:
    """The `shardwise` parser with one subparser per command."""
    parser = argparse.ArgumentParser(
        prog="shardwise", description="Train PyTorch models across many processes with every major parallelism "
        "strategy, behind one small API."
    )
    parser.add_argument("--version", action=Version)
    subparsers = parser.add_subparsers(dest="command", title="commands", required=True)
    for add in _COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `shardwise` console script and of `python -m shardwise`; returns the exit code.

    Usage errors exit through argparse (SystemExit with code 2 and a message on stderr); a path that cannot be
    used, or a rank that failed, returns 1 with one line (the rank's traceback after it) on stderr.
    """
    args = build_parser().parse_args(argv)
    return args.handler(args)

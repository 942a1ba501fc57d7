"""The `shardwise` command line: `shardwise <command> [options]`.

Each command is one subparser, added by its own `_add_<command>(subparsers)` function that declares the options
and sets `handler`, a function taking the parsed namespace and returning the exit code. `main()` only parses and
dispatches, so `bench`, `plan` and `run` join by adding their function to `_COMMANDS`. Values are validated while
parsing (argparse `type=` and `choices=`), so a bad value is a usage error (exit 2) naming the option, its value
and what is allowed, before any rank starts.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["main", "build_parser"]


# ---- value checkers (argparse turns their ArgumentTypeError into "argument --x: <message>") --------------------------
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"{text} must be a positive number")
    return value


def _existing_path(text: str) -> str:
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist (give a text file or a folder of them)")
    return text


# ---- demo -----------------------------------------------------------------------------------------------------------
def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    from .demo import SCHEDULES, STRATEGIES, DemoOptions
    from .models.gpt import PRESETS

    defaults = DemoOptions()
    p = subparsers.add_parser(
        "demo",
        help="train a small GPT on local ranks with any strategy and mesh; report loss, throughput, traffic, memory",
        description="Train the byte-level GPT on local ranks (gloo processes on 127.0.0.1, or threads) with a "
        "data-parallel strategy over a dp x tp x pp mesh, print a summary (loss, step time, tokens/s, wire bytes "
        "per step: against the DDP formula for plain DDP, per mesh axis otherwise; memory per rank) and write "
        "metrics.jsonl, summary.json and loss.png under OUT/<timestamp>/.",
    )
    p.add_argument("--nproc", type=_positive_int, default=None,
                   help="number of ranks (default: dp x tp x pp; 2 for plain DDP)")
    p.add_argument("--strategy", choices=STRATEGIES, default=defaults.strategy,
                   help="data-parallel strategy over the dp axis (default: %(default)s)")
    p.add_argument("--dp", type=_positive_int, default=None,
                   help="data-parallel size (default: nproc // (tp x pp); without --nproc, 2 for plain DDP, else 1)")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size (default: %(default)s)")
    p.add_argument("--pp", type=_positive_int, default=1, help="pipeline-parallel size (default: %(default)s)")
    p.add_argument("--dp-shard", type=_positive_int, default=None,
                   help="shard-group size within dp, for --strategy fsdp:hybrid_shard (required there)")
    p.add_argument("--schedule", choices=SCHEDULES, default=defaults.schedule,
                   help="pipeline schedule (default: %(default)s)")
    p.add_argument("--virtual-stages", type=_positive_int, default=defaults.virtual_stages,
                   help="stages per pipeline rank, >= 2 for interleaved_1f1b (default: %(default)s)")
    p.add_argument("--microbatches", type=_positive_int, default=None,
                   help="microbatches per step, dividing --batch-size (default: 2 x pp)")
    p.add_argument("--sequence-parallel", action="store_true", help="shard LayerNorm/dropout regions too (tp > 1)")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute the blocks in backward")
    p.add_argument("--steps", type=_positive_int, default=defaults.steps, help="optimizer steps (default: %(default)s)")
    p.add_argument("--data", type=_existing_path, default=None,
                   help="text file or folder to train on (default: the Python standard library's sources)")
    p.add_argument("--preset", choices=sorted(PRESETS), default=defaults.preset, help="GPT size (default: %(default)s)")
    p.add_argument("--batch-size", type=_positive_int, default=defaults.batch_size,
                   help="sequences per dp rank per step (default: %(default)s)")
    p.add_argument("--lr", type=_positive_float, default=defaults.lr, help="peak learning rate of AdamW (default: %(default)s)")
    p.add_argument("--seed", type=int, default=defaults.seed, help="model init and data order (default: %(default)s)")
    p.add_argument("--out", default=defaults.out, help="parent folder of the run directory (default: %(default)s)")
    p.add_argument("--backend", choices=("gloo", "thread"), default=None,
                   help="gloo: one process per rank; thread: ranks as threads of this process (fast, for tests); "
                   "default: thread when tp or pp > 1, else gloo")
    p.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    p.set_defaults(handler=functools.partial(_run_demo, p))


def _run_demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from .demo import DemoOptions, run_demo
    from .launch import LaunchError

    try:
        options = DemoOptions(
            nproc=args.nproc, strategy=args.strategy, steps=args.steps, data=args.data, preset=args.preset,
            batch_size=args.batch_size, lr=args.lr, seed=args.seed, out=args.out, backend=args.backend,
            progress=not args.no_progress, dp=args.dp, tp=args.tp, pp=args.pp, dp_shard=args.dp_shard,
            schedule=args.schedule, microbatches=args.microbatches, virtual_stages=args.virtual_stages,
            sequence_parallel=args.sequence_parallel, activation_checkpointing=args.activation_checkpointing,
        )
    except ValueError as exc:  # a combination of valid values that does not fit: a usage error, before any rank
        parser.error(str(exc).removeprefix("demo: "))
    try:
        run_demo(options)
    except LaunchError as exc:
        print(f"shardwise demo: {exc}", file=sys.stderr)
        return 1
    return 0


# ---- the parser -----------------------------------------------------------------------------------------------------
_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_demo,)


def build_parser() -> argparse.ArgumentParser:
    """The `shardwise` parser with one subparser per command."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="shardwise", description="Train PyTorch models across many processes with every major parallelism "
        "strategy, behind one small API."
    )
    parser.add_argument("--version", action="version", version=f"shardwise {__version__}")
    subparsers = parser.add_subparsers(dest="command", title="commands", required=True)
    for add in _COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `shardwise` console script and of `python -m shardwise`; returns the exit code.

    Usage errors exit through argparse (SystemExit with code 2 and a message on stderr).
    """
    args = build_parser().parse_args(argv)
    return args.handler(args)

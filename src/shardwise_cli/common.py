"""What every `shardwise` command shares, torch-free: the option vocabulary (strategies, schedules, presets, the
demo's defaults), the rank limits, argparse value checkers (their ArgumentTypeError becomes "argument --x:
<message>", a usage error with exit code 2), and the one-line failure of a path that cannot be used (exit code 1).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

#: Data-parallel strategies `shardwise demo` offers: `sw.parallelize`'s dp_strategy values (hybrid.DP_STRATEGIES).
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp:full_shard", "fsdp:shard_grad_op", "fsdp:hybrid_shard")
#: Other names the demo accepts for a strategy (demo.STRATEGY_ALIASES): Lightning's "fsdp" is full sharding.
STRATEGY_ALIASES = {"fsdp": "fsdp:full_shard"}
#: Pipeline schedules the demo offers (demo.SCHEDULES; zb_h1 is left out: parallelize allows it with DDP only).
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
#: Context-parallel attention methods (context_parallel.METHODS; tests/test_cli.py checks they agree).
CP_METHODS = ("ring", "ulysses")
#: GPT presets (the keys of models.gpt.PRESETS), sorted.
PRESETS = ("bench", "gpt2", "small", "tiny")
#: The defaults of `demo.DemoOptions` that the parser shows in --help.
DEMO_DEFAULTS = {"strategy": "ddp", "steps": 200, "preset": "small", "batch_size": 8, "lr": 3e-3, "seed": 0,
                 "out": "runs", "schedule": "1f1b", "virtual_stages": 1}

#: Most ranks one local run may start: thread ranks share one process, and the demo is no cluster.
MAX_RANKS = 256
#: Most gloo processes per CPU core: each one imports torch (about 0.4 GiB of RSS) and competes for the cores.
GLOO_RANKS_PER_CPU = 8


def cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may use (containers, taskset)
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def max_ranks(backend: str) -> int:
    """The most ranks `shardwise demo` starts on `backend`: MAX_RANKS threads, or GLOO_RANKS_PER_CPU processes per
    usable CPU core (at most MAX_RANKS)."""
    return MAX_RANKS if backend == "thread" else min(MAX_RANKS, GLOO_RANKS_PER_CPU * cpus())


def int_at_least(low: int, high: int | None = None, what: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (high None: no upper bound); `what` names the range in the error
    ("a TCP port")."""
    def check(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            bound = f"in {low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{value} is not {what} ({bound})" if what else f"{value} must be {bound}")
        return value

    return check


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"{text} must be a positive number")
    return value


def existing_path(text: str) -> str:
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist (give a text file or a folder of them)")
    return text


def os_reason(exc: Exception) -> str:
    """An OSError as "<strerror> (<path>)", anything else as its message: one line, no traceback."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f" ({exc.filename})" if exc.filename else "")
    return str(exc)


def fail(command: str, message: str) -> int:
    print(f"shardwise {command}: {message}", file=sys.stderr)
    return 1


class Version(argparse.Action):
    """--version, read from the installed metadata so that it needs no torch (shardwise.__version__ if none)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        from importlib import metadata

        try:
            version = metadata.version("shardwise")
        except metadata.PackageNotFoundError:  # run from a source tree
            from shardwise import __version__ as version
        print(f"shardwise {version}")  # on stdout, as argparse's own version action does
        parser.exit()


def probe_out(out: str) -> str | None:
    """Why a run directory cannot be made under `out`, or None: creates `out` (as the run would) and a scratch
    folder in it, removed at once, so a bad --out is found before training rather than after it."""
    import tempfile

    path = Path(out)
    if path.exists() and not path.is_dir():
        return "it exists and is not a directory"
    try:
        path.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=".shardwise-probe-", dir=path))
    except OSError as exc:
        return os_reason(exc)
    return None



"""`shardwise bench`: shardwise's data-parallel strategies beside PyTorch DDP/FSDP2 and DeepSpeed."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from .common import GLOO_RANKS_PER_CPU, PRESETS, cpus, fail, max_ranks, positive_int, probe_out

#: The rows `shardwise bench` can run, in table order (shardwise.benchmarks.peers.ORDER).
BENCH_ROWS = ("local", "sw_ddp", "torch_ddp", "sw_zero1", "ds_zero1", "sw_zero2", "ds_zero2", "sw_zero3", "fsdp2",
              "ds_zero3")


def _bench_rows(text: str) -> tuple[str, ...]:
    rows = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [v for v in rows if v not in BENCH_ROWS]
    if unknown or not rows:
        raise argparse.ArgumentTypeError(f"{text!r} names {unknown or 'no rows'}; allowed (comma list): "
                                         f"{', '.join(BENCH_ROWS)}")
    if len(set(rows)) != len(rows):
        raise argparse.ArgumentTypeError(f"{text!r} names a row twice")
    return rows


def add_bench(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="shardwise DDP / ZeRO-1/2/3 beside PyTorch DDP, FSDP2 and DeepSpeed: step time, memory, bytes per step",
        description="Train the same GPT with shardwise's data-parallel strategies and their peers (PyTorch DDP and "
        "FSDP2, DeepSpeed ZeRO 1-3 where it imports; missing peers are listed with their install line) and the "
        "no-communication floor, alternating in the same gloo processes; then each row alone for its memory. "
        "Writes results.md (a markdown table: step time, tokens/s, wire bytes per rank against the formula, model "
        "states against the ZeRO estimate, peak RSS), results.jsonl and step_time.png / memory.png / bytes.png "
        "(matplotlib: pip install 'shardwise[bench]') into OUT.",
    )
    p.add_argument("--quick", action="store_true",
                   help="the 'small' preset, 4 sequences per rank, 2 + 3 x 3 steps per row (a few minutes on 2 cores)")
    p.add_argument("--out", default=None, help="run directory, new or empty (default: runs/bench-<YYYYmmdd-HHMMSS>)")
    p.add_argument("--impls", type=_bench_rows, default=None,
                   help=f"comma list of rows (default: all): {', '.join(BENCH_ROWS)}")
    p.add_argument("--nproc", type=positive_int, default=2, help="gloo processes (default: %(default)s)")
    p.add_argument("--preset", choices=PRESETS, default=None, help="GPT size (default: bench; small with --quick)")
    p.add_argument("--batch-size", type=positive_int, default=None,
                   help="sequences per rank per step (default: 8; 4 with --quick)")
    p.add_argument("--rounds", type=positive_int, default=None, help="alternating rounds (default: 5; 3 with --quick)")
    p.add_argument("--steps", type=positive_int, default=None,
                   help="measured steps per row per round (default: 4; 3 with --quick)")
    p.add_argument("--no-memory", action="store_true", help="skip the separate memory run of each row")
    p.set_defaults(handler=functools.partial(_run_bench, p))


def _run_bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.nproc > max_ranks("gloo"):
        parser.error(f"argument --nproc: {args.nproc} processes exceeds the limit of {max_ranks('gloo')} "
                     f"({GLOO_RANKS_PER_CPU} per CPU core x {cpus()} cores)")
    if args.out is not None:
        out = Path(args.out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            return fail("bench", f"cannot write the run directory {args.out}: it exists and is not an empty "
                         f"directory")
        reason = probe_out(str(out.parent))
        if reason:
            return fail("bench", f"cannot write the run directory {args.out}: {reason}")
    from shardwise.benchmarks import BenchConfig, run_bench  # torch: only now that the command line is good
    from shardwise.launch import LaunchError

    chosen = {"impls": args.impls, "nproc": args.nproc, "preset": args.preset, "batch_size": args.batch_size,
              "rounds": args.rounds, "steps": args.steps, "memory_steps": 0 if args.no_memory else None}
    overrides = {k: v for k, v in chosen.items() if v is not None}
    config = BenchConfig.quick(**overrides) if args.quick else BenchConfig(**overrides)
    try:
        run_bench(config, args.out)
    except LaunchError as exc:
        return fail("bench", str(exc))
    return 0

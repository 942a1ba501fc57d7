"""`shardwise demo`: train the byte-level GPT on local ranks with any strategy and mesh, and report."""

from __future__ import annotations

import argparse
import functools
from typing import TYPE_CHECKING

from .common import (CP_METHODS, DEMO_DEFAULTS, GLOO_RANKS_PER_CPU, MAX_RANKS, PRESETS, SCHEDULES, STRATEGIES,
                     STRATEGY_ALIASES, cpus, existing_path, fail, int_at_least, max_ranks, os_reason, positive_float,
                     positive_int, probe_out)

if TYPE_CHECKING:
    from shardwise.demo import DemoOptions

def _demo_strategies(text: str) -> tuple[str, ...]:
    allowed = STRATEGIES + tuple(STRATEGY_ALIASES)
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    unknown = [v for v in names if v not in allowed]
    if unknown or len(names) < 2:
        raise argparse.ArgumentTypeError(f"{text!r} must name at least two strategies"
                                         f"{f', not {unknown}' if unknown else ''}; allowed: {', '.join(allowed)}")
    resolved = [STRATEGY_ALIASES.get(v, v) for v in names]
    if len(set(resolved)) != len(resolved):
        raise argparse.ArgumentTypeError(f"{text!r} names a strategy twice (fsdp is fsdp:full_shard)")
    return names


def add_demo(subparsers: argparse._SubParsersAction) -> None:
    defaults = DEMO_DEFAULTS
    p = subparsers.add_parser(
        "demo",
        help="train a small GPT on local ranks with any strategy and mesh; report loss, throughput, traffic, memory",
        description="Train the byte-level GPT on local ranks (gloo processes on 127.0.0.1, or threads) with a "
        "data-parallel strategy over a dp x cp x tp x pp mesh (with ep borrowed from dp x cp for a mixture of "
        "experts), print a summary (loss, step time, tokens/s, wire bytes "
        "per step per mesh axis, against the strategy's formula over dp alone; memory per rank) and write "
        "metrics.jsonl, summary.json and loss.png under OUT/<timestamp>/.",
    )
    p.add_argument("--nproc", type=positive_int, default=None,
                   help=f"number of ranks (default: dp x cp x tp x pp; 2 for plain DDP); at most {MAX_RANKS} thread "
                   f"ranks, or {GLOO_RANKS_PER_CPU} gloo processes per CPU core ({max_ranks('gloo')} here)")
    p.add_argument("--strategy", choices=STRATEGIES + tuple(STRATEGY_ALIASES) + ("auto",),
                   default=defaults["strategy"],
                   help="data-parallel strategy over the dp axis; fsdp means fsdp:full_shard; auto lets the planner "
                   "choose the fastest that fits in --memory-gb per rank (default: this machine's RAM / ranks) and "
                   "prints why (default: %(default)s)")
    p.add_argument("--memory-gb", type=positive_float, default=None,
                   help="memory per rank the planner may use with --strategy auto (default: available RAM / ranks)")
    p.add_argument("--compare", type=_demo_strategies, default=None, metavar="S1,S2,...",
                   help="train once per strategy (comma list of --strategy values), alternating blocks of steps in "
                   "the same processes so that load hits them alike, each on the path it takes alone; then draw "
                   "their loss against time on one plot and their memory per rank on one bar chart")
    p.add_argument("--early-stop", type=positive_int, default=None, metavar="PATIENCE",
                   help="hold out the last 10%% of the corpus, evaluate every --eval-every steps, and stop every "
                   "rank together (sw.agree) after PATIENCE evaluations without improvement")
    p.add_argument("--eval-every", type=positive_int, default=10,
                   help="steps between validation evaluations with --early-stop (default: %(default)s)")
    p.add_argument("--dp", type=positive_int, default=None,
                   help="data-parallel size (default: nproc // (cp x tp x pp); without --nproc, 2 for plain DDP, "
                   "else 1)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (default: %(default)s)")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size (default: %(default)s)")
    p.add_argument("--cp", type=positive_int, default=1,
                   help="context-parallel size: ranks splitting each sequence (default: %(default)s)")
    p.add_argument("--cp-method", choices=CP_METHODS, default="ring",
                   help="context-parallel attention: ring (K/V blocks around a ring) or ulysses (all-to-all over "
                   "heads) (default: %(default)s)")
    p.add_argument("--ep", type=positive_int, default=1,
                   help="expert-parallel size, borrowed from dp x cp: ranks splitting the experts of the MoE GPT "
                   "(default: %(default)s)")
    p.add_argument("--experts", type=int_at_least(0), default=None,
                   help="experts per block of the MoE GPT, built with moe_aux_loss_coef=0 (a load-balancing loss "
                   "needs the whole batch in one microbatch); 0: the dense GPT (default: 0, or 2 x ep with --ep)")
    p.add_argument("--experts-per-token", type=positive_int, default=2,
                   help="experts each token is routed to (default: %(default)s)")
    p.add_argument("--dp-shard", type=positive_int, default=None,
                   help="shard-group size within dp, for --strategy fsdp:hybrid_shard (required there)")
    p.add_argument("--schedule", choices=SCHEDULES, default=defaults["schedule"],
                   help="pipeline schedule (default: %(default)s)")
    p.add_argument("--virtual-stages", type=positive_int, default=defaults["virtual_stages"],
                   help="stages per pipeline rank, >= 2 for interleaved_1f1b (default: %(default)s)")
    p.add_argument("--microbatches", type=positive_int, default=None,
                   help="microbatches per step, dividing --batch-size (default: 2 x pp)")
    p.add_argument("--sequence-parallel", action="store_true", help="shard LayerNorm/dropout regions too (tp > 1)")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute the blocks in backward")
    p.add_argument("--steps", type=positive_int, default=defaults["steps"],
                   help="optimizer steps (default: %(default)s)")
    p.add_argument("--data", type=existing_path, default=None,
                   help="text file or folder to train on (default: the Python standard library's sources)")
    p.add_argument("--preset", choices=PRESETS, default=defaults["preset"], help="GPT size (default: %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=defaults["batch_size"],
                   help="sequences per dp rank per step (default: %(default)s)")
    p.add_argument("--lr", type=positive_float, default=defaults["lr"],
                   help="peak learning rate of AdamW (default: %(default)s)")
    p.add_argument("--seed", type=int, default=defaults["seed"], help="model init and data order (default: %(default)s)")
    p.add_argument("--out", default=defaults["out"], help="parent folder of the run directory (default: %(default)s)")
    p.add_argument("--backend", choices=("gloo", "thread"), default=None,
                   help="gloo: one process per rank; thread: ranks as threads of this process (fast, for tests); "
                   "default: thread when tp, pp, cp or ep > 1, else gloo")
    p.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    p.set_defaults(handler=functools.partial(_run_demo, p))


def _check_world_size(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error, before torch is imported, when the run would start more ranks than `max_ranks` allows. The
    world is --nproc or dp x cp x tp x pp (whichever is larger: DemoOptions reports a mismatch between them)."""
    mesh = (args.dp or 1) * args.cp * args.tp * args.pp
    world = max(args.nproc or 0, mesh)
    backend = args.backend or ("thread" if args.tp * args.pp * args.cp * args.ep > 1 else "gloo")
    limit = max_ranks(backend)
    if world <= limit:
        return
    cp = (" x cp", f" x {args.cp}") if args.cp > 1 else ("", "")
    what = (f"argument --nproc: {args.nproc}" if args.nproc == world else
            f"dp{cp[0]} x tp x pp = {args.dp or 1}{cp[1]} x {args.tp} x {args.pp} = {mesh}")
    if backend == "thread":
        rule = f"{limit} thread ranks"
    else:
        capped = f", capped at {MAX_RANKS}" if limit == MAX_RANKS else ""
        rule = (f"{limit} gloo processes ({GLOO_RANKS_PER_CPU} per CPU core x {cpus()} cores{capped}; "
                f"--backend thread runs up to {MAX_RANKS} ranks)")
    parser.error(f"{what} ranks exceeds the limit of {rule}")


def _probe_data(options: DemoOptions) -> str | None:
    """Why rank 0 could not train on options.data (unreadable, no text files, shorter than one window), or None:
    the corpus and sampler the rank would build, built once here, before any rank starts."""
    from shardwise.data import ByteCorpus, ShardedSampler
    from shardwise.models.gpt import GPTConfig

    try:
        ShardedSampler(ByteCorpus(options.data), options.batch_size, GPTConfig.preset(options.preset).seq_len,
                       world_size=options.dp, seed=options.seed)
    except (OSError, ValueError) as exc:
        return os_reason(exc)
    return None


def _run_demo(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    _check_world_size(parser, args)
    from shardwise.demo import DemoOptions, run_demo  # torch: only now that the command line is known to be good
    from shardwise.launch import LaunchError

    try:
        options = DemoOptions(
            nproc=args.nproc, strategy=args.compare[0] if args.compare else args.strategy, steps=args.steps, data=args.data, preset=args.preset,
            batch_size=args.batch_size, lr=args.lr, seed=args.seed, out=args.out, backend=args.backend,
            progress=not args.no_progress, dp=args.dp, tp=args.tp, pp=args.pp, dp_shard=args.dp_shard,
            schedule=args.schedule, microbatches=args.microbatches, virtual_stages=args.virtual_stages,
            sequence_parallel=args.sequence_parallel, activation_checkpointing=args.activation_checkpointing,
            early_stop=args.early_stop, eval_every=args.eval_every, memory_gb=args.memory_gb, cp=args.cp,
            ep=args.ep, experts=args.experts, experts_per_token=args.experts_per_token, cp_method=args.cp_method,
        )
        if args.compare:  # every strategy's options, checked before any rank starts
            import dataclasses

            variants = [dataclasses.replace(options, strategy=name, nproc=args.nproc, dp=args.dp,
                                            microbatches=args.microbatches,
                                            dp_shard=args.dp_shard if name == "fsdp:hybrid_shard" else None)
                        for name in args.compare]
    except ValueError as exc:  # a combination of valid values that does not fit: a usage error, before any rank
        parser.error(str(exc).removeprefix("demo: "))
    reason = _probe_data(options) if options.data is not None else None
    if reason:
        return fail("demo", f"cannot train on --data {options.data}: {reason}")
    reason = probe_out(options.out)  # second: a bad --data creates no folder
    if reason:
        return fail("demo", f"cannot write the run directory under {options.out}: {reason}")
    try:
        if args.compare:
            from shardwise.demo import run_compare

            run_compare(variants)
        else:
            run_demo(options)
    except LaunchError as exc:
        return fail("demo", str(exc))
    except OSError as exc:  # writing the run directory after training (a disk that filled up, a folder removed)
        if exc.filename is None:
            raise
        return fail("demo", f"cannot write the run directory under {options.out}: {os_reason(exc)}")
    return 0

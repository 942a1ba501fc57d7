"""The `shardwise` command line: `shardwise <command> [options]` (the console script's entry point).

Why a top-level module: importing anything under `shardwise.` first runs `shardwise/__init__.py`, which imports
torch (seconds, up to ~20 on a loaded machine). This module uses only the standard library until a command has
been parsed and checked, so a usage error or `--help` answers at once; the library is imported by the command's
handler. `shardwise.cli` re-exports `main` and `build_parser`, and `python -m shardwise` runs the same `main`.

Each command is one subparser, added by its own `_add_<command>(subparsers)` function that declares the options
and sets `handler`, a function taking the parsed namespace and returning the exit code. `main()` only parses and
dispatches, so `bench`, `plan` and `run` join by adding their function to `_COMMANDS`. Values are validated while
parsing (argparse `type=` and `choices=`), so a bad value is a usage error (exit 2) naming the option, its value
and what is allowed, before any rank starts (and before torch is imported). A path that cannot be used (an `--out`
that cannot be written, a `--data` that cannot be trained on) is one line on stderr and exit code 1.

The option vocabulary the parser offers (strategies, schedules, presets, defaults) is spelled here, torch-free;
`shardwise.demo` imports `SCHEDULES` from here, and tests/test_reliability_cli.py checks that the rest equals the
library's (`hybrid.DP_STRATEGIES`, `models.gpt.PRESETS`, `demo.DemoOptions()`).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shardwise.demo import DemoOptions

__all__ = ["main", "build_parser", "max_ranks", "STRATEGIES", "SCHEDULES", "PRESETS", "DEMO_DEFAULTS",
           "MAX_RANKS", "GLOO_RANKS_PER_CPU", "BENCH_ROWS", "STRATEGY_ALIASES"]

#: Data-parallel strategies `shardwise demo` offers: `sw.parallelize`'s dp_strategy values (hybrid.DP_STRATEGIES).
STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "fsdp:full_shard", "fsdp:shard_grad_op", "fsdp:hybrid_shard")
#: Other names the demo accepts for a strategy (demo.STRATEGY_ALIASES): Lightning's "fsdp" is full sharding.
STRATEGY_ALIASES = {"fsdp": "fsdp:full_shard"}
#: Pipeline schedules the demo offers (zb_h1 is left out: parallelize allows it with DDP only).
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
#: GPT presets (the keys of models.gpt.PRESETS), sorted.
PRESETS = ("bench", "gpt2", "small", "tiny")
#: The defaults of `demo.DemoOptions` that the parser shows in --help.
DEMO_DEFAULTS = {"strategy": "ddp", "steps": 200, "preset": "small", "batch_size": 8, "lr": 3e-3, "seed": 0,
                 "out": "runs", "schedule": "1f1b", "virtual_stages": 1}

#: Most ranks one local run may start: thread ranks share one process, and the demo is no cluster.
MAX_RANKS = 256
#: Most gloo processes per CPU core: each one imports torch (about 0.4 GiB of RSS) and competes for the cores.
GLOO_RANKS_PER_CPU = 8


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))  # the cores this process may use (containers, taskset)
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def max_ranks(backend: str) -> int:
    """The most ranks `shardwise demo` starts on `backend`: MAX_RANKS threads, or GLOO_RANKS_PER_CPU processes per
    usable CPU core (at most MAX_RANKS)."""
    return MAX_RANKS if backend == "thread" else min(MAX_RANKS, GLOO_RANKS_PER_CPU * _cpus())


# ---- value checkers (argparse turns their ArgumentTypeError into "argument --x: <message>") --------------------------
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
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


def _os_reason(exc: Exception) -> str:
    """An OSError as "<strerror> (<path>)", anything else as its message: one line, no traceback."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f" ({exc.filename})" if exc.filename else "")
    return str(exc)


def _fail(command: str, message: str) -> int:
    print(f"shardwise {command}: {message}", file=sys.stderr)
    return 1


class _Version(argparse.Action):
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


# ---- demo -----------------------------------------------------------------------------------------------------------
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


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    defaults = DEMO_DEFAULTS
    p = subparsers.add_parser(
        "demo",
        help="train a small GPT on local ranks with any strategy and mesh; report loss, throughput, traffic, memory",
        description="Train the byte-level GPT on local ranks (gloo processes on 127.0.0.1, or threads) with a "
        "data-parallel strategy over a dp x tp x pp mesh, print a summary (loss, step time, tokens/s, wire bytes "
        "per step: against the DDP formula for plain DDP, per mesh axis otherwise; memory per rank) and write "
        "metrics.jsonl, summary.json and loss.png under OUT/<timestamp>/.",
    )
    p.add_argument("--nproc", type=_positive_int, default=None,
                   help=f"number of ranks (default: dp x tp x pp; 2 for plain DDP); at most {MAX_RANKS} thread "
                   f"ranks, or {GLOO_RANKS_PER_CPU} gloo processes per CPU core ({max_ranks('gloo')} here)")
    p.add_argument("--strategy", choices=STRATEGIES + tuple(STRATEGY_ALIASES) + ("auto",),
                   default=defaults["strategy"],
                   help="data-parallel strategy over the dp axis; fsdp means fsdp:full_shard; auto lets the planner "
                   "choose the fastest that fits in --memory-gb per rank (default: this machine's RAM / ranks) and "
                   "prints why (default: %(default)s)")
    p.add_argument("--memory-gb", type=_positive_float, default=None,
                   help="memory per rank the planner may use with --strategy auto (default: available RAM / ranks)")
    p.add_argument("--compare", type=_demo_strategies, default=None, metavar="S1,S2,...",
                   help="train once per strategy (comma list of --strategy values), then draw their loss against "
                   "time on one plot and their memory per rank on one bar chart")
    p.add_argument("--early-stop", type=_positive_int, default=None, metavar="PATIENCE",
                   help="hold out the last 10%% of the corpus, evaluate every --eval-every steps, and stop every "
                   "rank together (sw.agree) after PATIENCE evaluations without improvement")
    p.add_argument("--eval-every", type=_positive_int, default=10,
                   help="steps between validation evaluations with --early-stop (default: %(default)s)")
    p.add_argument("--dp", type=_positive_int, default=None,
                   help="data-parallel size (default: nproc // (tp x pp); without --nproc, 2 for plain DDP, else 1)")
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel size (default: %(default)s)")
    p.add_argument("--pp", type=_positive_int, default=1, help="pipeline-parallel size (default: %(default)s)")
    p.add_argument("--dp-shard", type=_positive_int, default=None,
                   help="shard-group size within dp, for --strategy fsdp:hybrid_shard (required there)")
    p.add_argument("--schedule", choices=SCHEDULES, default=defaults["schedule"],
                   help="pipeline schedule (default: %(default)s)")
    p.add_argument("--virtual-stages", type=_positive_int, default=defaults["virtual_stages"],
                   help="stages per pipeline rank, >= 2 for interleaved_1f1b (default: %(default)s)")
    p.add_argument("--microbatches", type=_positive_int, default=None,
                   help="microbatches per step, dividing --batch-size (default: 2 x pp)")
    p.add_argument("--sequence-parallel", action="store_true", help="shard LayerNorm/dropout regions too (tp > 1)")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute the blocks in backward")
    p.add_argument("--steps", type=_positive_int, default=defaults["steps"],
                   help="optimizer steps (default: %(default)s)")
    p.add_argument("--data", type=_existing_path, default=None,
                   help="text file or folder to train on (default: the Python standard library's sources)")
    p.add_argument("--preset", choices=PRESETS, default=defaults["preset"], help="GPT size (default: %(default)s)")
    p.add_argument("--batch-size", type=_positive_int, default=defaults["batch_size"],
                   help="sequences per dp rank per step (default: %(default)s)")
    p.add_argument("--lr", type=_positive_float, default=defaults["lr"],
                   help="peak learning rate of AdamW (default: %(default)s)")
    p.add_argument("--seed", type=int, default=defaults["seed"], help="model init and data order (default: %(default)s)")
    p.add_argument("--out", default=defaults["out"], help="parent folder of the run directory (default: %(default)s)")
    p.add_argument("--backend", choices=("gloo", "thread"), default=None,
                   help="gloo: one process per rank; thread: ranks as threads of this process (fast, for tests); "
                   "default: thread when tp or pp > 1, else gloo")
    p.add_argument("--no-progress", action="store_true", help="do not draw the progress bar")
    p.set_defaults(handler=functools.partial(_run_demo, p))


def _check_world_size(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error, before torch is imported, when the run would start more ranks than `max_ranks` allows. The
    world is --nproc or dp x tp x pp (whichever is larger: DemoOptions reports a mismatch between them)."""
    mesh = (args.dp or 1) * args.tp * args.pp
    world = max(args.nproc or 0, mesh)
    backend = args.backend or ("thread" if args.tp * args.pp > 1 else "gloo")
    limit = max_ranks(backend)
    if world <= limit:
        return
    what = (f"argument --nproc: {args.nproc}" if args.nproc == world else
            f"dp x tp x pp = {args.dp or 1} x {args.tp} x {args.pp} = {mesh}")
    if backend == "thread":
        rule = f"{limit} thread ranks"
    else:
        capped = f", capped at {MAX_RANKS}" if limit == MAX_RANKS else ""
        rule = (f"{limit} gloo processes ({GLOO_RANKS_PER_CPU} per CPU core x {_cpus()} cores{capped}; "
                f"--backend thread runs up to {MAX_RANKS} ranks)")
    parser.error(f"{what} ranks exceeds the limit of {rule}")


def _probe_out(out: str) -> str | None:
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
        return _os_reason(exc)
    return None


def _probe_data(options: DemoOptions) -> str | None:
    """Why rank 0 could not train on options.data (unreadable, no text files, shorter than one window), or None:
    the corpus and sampler the rank would build, built once here, before any rank starts."""
    from shardwise.data import ByteCorpus, ShardedSampler
    from shardwise.models.gpt import GPTConfig

    try:
        ShardedSampler(ByteCorpus(options.data), options.batch_size, GPTConfig.preset(options.preset).seq_len,
                       world_size=options.dp, seed=options.seed)
    except (OSError, ValueError) as exc:
        return _os_reason(exc)
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
            early_stop=args.early_stop, eval_every=args.eval_every, memory_gb=args.memory_gb,
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
        return _fail("demo", f"cannot train on --data {options.data}: {reason}")
    reason = _probe_out(options.out)  # second: a bad --data creates no folder
    if reason:
        return _fail("demo", f"cannot write the run directory under {options.out}: {reason}")
    try:
        if args.compare:
            from shardwise.demo_compare import run_compare

            run_compare(variants)
        else:
            run_demo(options)
    except LaunchError as exc:
        return _fail("demo", str(exc))
    except OSError as exc:  # writing the run directory after training (a disk that filled up, a folder removed)
        if exc.filename is None:
            raise
        return _fail("demo", f"cannot write the run directory under {options.out}: {_os_reason(exc)}")
    return 0


# ---- run ------------------------------------------------------------------------------------------------------------
def _script(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file (give the training script to run)")
    return text


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (1..65535)")
    return value


def _add_run(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="launch a training script on local processes, supervised by shardwise (torchrun's job, with blame)",
        description="Start SCRIPT on --nproc local processes with the environment sw.init() reads (RANK, "
        "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; mpirun's for --backend mpi) and supervise them: when a "
        "rank fails, the others are stopped, every failed rank's traceback is printed with the rank that failed "
        "first (the root cause) named, and the exit code is non-zero. Arguments after SCRIPT go to the script.",
    )
    p.add_argument("-n", "--nproc", "--nproc-per-node", dest="nproc", type=_positive_int, default=1,
                   help=f"processes on this node (default: %(default)s; at most {GLOO_RANKS_PER_CPU} per CPU core "
                   f"for gloo and mpi, {max_ranks('gloo')} here)")
    p.add_argument("--backend", choices=("gloo", "nccl", "mpi"), default=None,
                   help="what sw.init() joins with: gloo, nccl (one GPU per local rank) or mpi (ranks started by "
                   "mpirun); default: nccl when CUDA is available, else gloo")
    p.add_argument("--nnodes", type=_positive_int, default=1, help="nodes in the job (default: %(default)s)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1 (default: %(default)s)")
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="where node 0 hosts the rendezvous store (default: %(default)s)")
    p.add_argument("--master-port", type=_port, default=None,
                   help="its port (default: one the OS picks; required with --nnodes > 1)")
    p.add_argument("--timeout", type=_positive_float, default=60.0,
                   help="seconds to reach the store, and of heartbeat silence before a rank counts as frozen "
                   "(default: %(default)s)")
    p.add_argument("--grace", type=_positive_float, default=3.0,
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default: %(default)s)")
    p.add_argument("--min", dest="min_workers", type=_positive_int, default=None,
                   help="elastic job: the fewest workers it runs with (with --max; survivors of a failure keep "
                   "running and joiners are admitted; the script uses sw.elastic, see docs/elastic.md)")
    p.add_argument("--max", dest="max_workers", type=_positive_int, default=None,
                   help="elastic job: the most workers it runs with")
    p.add_argument("--join", action="store_true",
                   help="add these --nproc workers to a running elastic job at --master-addr/--master-port (its "
                   "SHARDWISE_JOB_TOKEN in the environment)")
    p.add_argument("--max-restarts", type=_non_negative_int, default=0,
                   help="worker crashes (non-zero exit, killed by a signal) answered by a restart, over the whole job: "
                   "with --min/--max the crashed worker is replaced and joins the running job; otherwise every "
                   "worker restarts and the script resumes from its checkpoint, as with torchrun (default: "
                   "%(default)s)")
    p.add_argument("script", type=_script, help="the training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    p.set_defaults(handler=functools.partial(_run_run, p))


def _run_run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.backend in (None, "gloo", "mpi") and args.nproc > max_ranks("gloo"):
        parser.error(f"argument --nproc: {args.nproc} processes exceeds the limit of {max_ranks('gloo')} "
                     f"({GLOO_RANKS_PER_CPU} per CPU core x {_cpus()} cores)")
    if not 0 <= args.node_rank < args.nnodes:
        parser.error(f"argument --node-rank: {args.node_rank} must be in 0..nnodes-1 = 0..{args.nnodes - 1}")
    if args.nnodes > 1 and args.master_port is None:
        parser.error(f"argument --master-port: required with --nnodes {args.nnodes} (every node must know where "
                     f"node 0 listens)")
    if args.nnodes > 1 and args.backend == "mpi":
        parser.error("argument --backend: mpi runs on one node here (mpirun places ranks on hosts itself: "
                     "mpirun -H ...); use gloo or nccl with one `shardwise run` per node")
    if (args.min_workers is None) != (args.max_workers is None):
        parser.error("arguments --min/--max: give both (an elastic job's bounds) or neither")
    if args.min_workers is not None and args.min_workers > args.max_workers:
        parser.error(f"argument --min: {args.min_workers} must be <= --max {args.max_workers}")
    if args.join and (args.min_workers is None or args.master_port is None):
        parser.error("argument --join: needs --min/--max and the running job's --master-port")
    import torch  # only now that the command line is known to be good

    from shardwise.launch.supervise import RunConfig, keep_survivors, run, tear_down

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    try:
        config = RunConfig(args.script, tuple(args.script_args), nproc=args.nproc, backend=backend,
                           nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                           master_port=args.master_port or 0, timeout=args.timeout, grace=args.grace,
                           elastic=None if args.min_workers is None else (args.min_workers, args.max_workers),
                           join=args.join, max_restarts=args.max_restarts)
        result = run(config, keep_survivors if config.elastic is not None else tear_down)
    except (ValueError, RuntimeError) as exc:  # a configuration that does not fit, no mpirun on PATH
        return _fail("run", str(exc).removeprefix("run: "))
    text = result.report()
    if text:
        print(text, file=sys.stderr)
    return result.exit_code


# ---- plan -----------------------------------------------------------------------------------------------------------
#: What `shardwise plan` offers, torch-free (tests/test_cli_plan.py checks them against shardwise.planner.costs).
PLAN_OPTIMIZERS = ("adam", "adamw", "none", "sgd", "sgd_momentum")
PLAN_DTYPES = ("bf16", "fp16", "fp32")
PLAN_ATTENTION = ("eager", "fused")
_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _param_count(text: str) -> float:
    """A parameter count: 7e9, 7000000000, 7B, 350M, 1.5T."""
    scale = _SUFFIXES.get(text[-1:].lower(), 1.0)
    number = text[:-1] if scale != 1.0 else text
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a parameter count (write 7e9, 7B or 350M)") from None
    if not value >= 1 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be at least one parameter")
    return value


def _factory(text: str) -> str:
    module, sep, name = text.partition(":")
    if not sep or not module or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not module:factory (e.g. mypkg.models:build)")
    return text


def _add_plan(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="memory per GPU and bytes per step of every strategy for a model size and GPU count; the recommendation",
        description="Estimate, without running anything, the memory per GPU (ZeRO model states; activations with "
        "--seq and --batch, after Korthikanti et al. 2022) and the bytes on the wire per step of every strategy "
        "that applies to --gpus GPUs, and recommend the fastest that fits in --gpu-mem (the planner of "
        "sw.distribute; docs/planning.md states its assumptions).",
    )
    p.add_argument("--params", type=_param_count, default=None,
                   help="parameter count: 7e9, 7B, 350M (or give --model)")
    p.add_argument("--model", type=_factory, default=None,
                   help="module:factory returning the torch.nn.Module to plan for (its parameters and config)")
    p.add_argument("--gpus", type=_positive_int, default=1, help="number of GPUs (ranks) (default: %(default)s)")
    p.add_argument("--gpus-per-node", type=_positive_int, default=None,
                   help="GPUs per node (default: min(--gpus, 8))")
    p.add_argument("--gpu-mem", type=_positive_float, default=80.0,
                   help="memory per GPU in GB of 10^9 bytes (default: %(default)s)")
    p.add_argument("--optimizer", choices=PLAN_OPTIMIZERS, default="adamw",
                   help="sizes the optimizer state; 'none' counts weights and gradients only (default: %(default)s)")
    p.add_argument("--dtype", choices=PLAN_DTYPES, default="bf16",
                   help="training dtype; bf16/fp16 mean mixed precision with fp32 master weights (default: "
                   "%(default)s)")
    p.add_argument("--seq", type=_positive_int, default=None, help="sequence length (with --batch: activations)")
    p.add_argument("--batch", type=_positive_int, default=None, help="sequences per GPU per step")
    p.add_argument("--hidden", type=_positive_int, default=None, help="hidden size (default: the model's, or "
                   "derived from --params assuming h = 128 x layers)")
    p.add_argument("--layers", type=_positive_int, default=None, help="transformer layers")
    p.add_argument("--heads", type=_positive_int, default=None, help="attention heads (default: hidden / 128)")
    p.add_argument("--vocab", type=_positive_int, default=None, help="vocabulary size (adds the logits)")
    p.add_argument("--activation-checkpointing", action="store_true", help="recompute each layer in backward")
    p.add_argument("--attention", choices=PLAN_ATTENTION, default="eager",
                   help="eager stores the attention scores (the paper's 5as/h term); fused (FlashAttention, SDPA) "
                   "does not (default: %(default)s)")
    p.add_argument("--sequence-parallel", action="store_true", help="tensor-parallel candidates use sequence "
                   "parallel")
    p.add_argument("--strategy", default="auto",
                   help="estimate this strategy string instead of choosing (e.g. zero3, fsdp:hybrid_shard, "
                   "3d:dp=2,tp=2,pp=2)")
    p.add_argument("--no-offload", action="store_true", help="never recommend CPU offload")
    p.add_argument("--intra-node-gbps", type=_positive_float, default=150.0,
                   help="GB/s between GPUs of a node (default: %(default)s)")
    p.add_argument("--inter-node-gbps", type=_positive_float, default=12.5,
                   help="GB/s between nodes (default: %(default)s, 100 Gb/s)")
    p.set_defaults(handler=functools.partial(_run_plan, p))


def _run_plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if (args.params is None) == (args.model is None):
        parser.error("give exactly one of --params or --model")
    if (args.seq is None) != (args.batch is None):
        parser.error("--seq and --batch go together (activations need both)")
    node = args.gpus_per_node or min(args.gpus, 8)
    if node > args.gpus or args.gpus % node:
        parser.error(f"--gpus-per-node {node} must divide --gpus {args.gpus}")
    import importlib

    from shardwise.estimate import activation_geometry  # torch: only now that the command line is known to be good
    from shardwise.planner import Links, Workload, model_facts, plan

    model, psi, facts = None, args.params, None
    if args.model is not None:
        module, _, name = args.model.partition(":")
        try:
            model = getattr(importlib.import_module(module), name)()
        except Exception as exc:  # noqa: BLE001 - the user's code: one line naming what failed
            return _fail("plan", f"cannot build --model {args.model}: {type(exc).__name__}: {exc}")
        facts = model_facts(model)
        psi = facts.num_params
    geometry = None
    if args.seq is not None:
        geometry = activation_geometry(model, psi, args.seq, args.batch, hidden_size=args.hidden,
                                       num_layers=args.layers, num_heads=args.heads, vocab_size=args.vocab)
    hidden = args.hidden or (facts.hidden_size if facts else None)
    work = Workload(psi, args.dtype, args.optimizer, geometry, args.activation_checkpointing, args.attention,
                    args.sequence_parallel, hidden)
    links = Links(args.gpus, node, args.gpu_mem * 1e9, intra_node_gbps=args.intra_node_gbps,
                  inter_node_gbps=args.inter_node_gbps)
    allowed = {"offload": not args.no_offload}
    if facts is not None:
        allowed.update(tensor_parallel=facts.tp_plan is not None, pipeline=facts.pipeline_layers is not None,
                       max_pp=facts.pipeline_layers)
    try:
        result = plan(work, links, strategy=args.strategy, **allowed)
    except ValueError as exc:  # an unknown strategy string, sizes that do not divide, or nothing fits
        return _fail("plan", str(exc))
    print(result.explain())
    return 0


# ---- bench ----------------------------------------------------------------------------------------------------------
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


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
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
    p.add_argument("--nproc", type=_positive_int, default=2, help="gloo processes (default: %(default)s)")
    p.add_argument("--preset", choices=PRESETS, default=None, help="GPT size (default: bench; small with --quick)")
    p.add_argument("--batch-size", type=_positive_int, default=None,
                   help="sequences per rank per step (default: 8; 4 with --quick)")
    p.add_argument("--rounds", type=_positive_int, default=None, help="alternating rounds (default: 5; 3 with --quick)")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help="measured steps per row per round (default: 4; 3 with --quick)")
    p.add_argument("--no-memory", action="store_true", help="skip the separate memory run of each row")
    p.set_defaults(handler=functools.partial(_run_bench, p))


def _run_bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.nproc > max_ranks("gloo"):
        parser.error(f"argument --nproc: {args.nproc} processes exceeds the limit of {max_ranks('gloo')} "
                     f"({GLOO_RANKS_PER_CPU} per CPU core x {_cpus()} cores)")
    if args.out is not None:
        out = Path(args.out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            return _fail("bench", f"cannot write the run directory {args.out}: it exists and is not an empty "
                         f"directory")
        reason = _probe_out(str(out.parent))
        if reason:
            return _fail("bench", f"cannot write the run directory {args.out}: {reason}")
    from shardwise.benchmarks import BenchConfig, run_bench  # torch: only now that the command line is good
    from shardwise.launch import LaunchError

    chosen = {"impls": args.impls, "nproc": args.nproc, "preset": args.preset, "batch_size": args.batch_size,
              "rounds": args.rounds, "steps": args.steps, "memory_steps": 0 if args.no_memory else None}
    overrides = {k: v for k, v in chosen.items() if v is not None}
    config = BenchConfig.quick(**overrides) if args.quick else BenchConfig(**overrides)
    try:
        run_bench(config, args.out)
    except LaunchError as exc:
        return _fail("bench", str(exc))
    return 0


# ---- the parser -----------------------------------------------------------------------------------------------------
_COMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (_add_demo, _add_run, _add_plan, _add_bench)


def build_parser() -> argparse.ArgumentParser:
    """The `shardwise` parser with one subparser per command."""
    parser = argparse.ArgumentParser(
        prog="shardwise", description="Train PyTorch models across many processes with every major parallelism "
        "strategy, behind one small API."
    )
    parser.add_argument("--version", action=_Version)
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

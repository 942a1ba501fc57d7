"""`shardwise check`: run a model under a strategy on CPU ranks for a few steps against one process (sw.check).

    shardwise check mymodels.py:build --batch mymodels.py:batch --strategy zero3 -n 2 --steps 3
    shardwise check mypkg.models:build --batch mypkg.data:batch --loss mypkg.train:loss --tp 2 --tp-plan llama -n 4
    shardwise check mypkg.models:build --batch mypkg.data:batch --cp 2 --ep 2 -n 4
    shardwise check --gpt --pp 2 --pp-schedule interleaved_1f1b --virtual-stages 2 -n 4   # pipeline stages too
    shardwise check --gpt --strategy zero3 -n 2          # the library's tiny GPT, a ready example
    shardwise check mymodels.py:build --batch mymodels.py:batch --wrap mytrain.py:wrap -n 2   # your own wrapping

A function is named `MODULE_OR_FILE:name`: an importable module (`mypkg.models:build`) or a Python file
(`path/to/models.py:build`, imported as a module named after the file, its folder put first on sys.path, so gloo
processes import it too). Exit code 0 when the report is OK, 1 when it differs (one line on stderr says where first)
or a function cannot be loaded or run, 2 for usage errors, which are found before torch is imported where they can.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

from .common import fail, int_at_least, max_ranks, positive_float, positive_int

__all__ = ["add_check", "CHECK_STRATEGIES", "CHECK_DP_STRATEGIES", "CHECK_TP_PLANS", "CHECK_BACKENDS",
           "CHECK_PP_SCHEDULES"]

#: What `--strategy` accepts, torch-free (tests/test_check.py checks them against shardwise.check).
CHECK_DP_STRATEGIES = ("ddp", "ddp:find_unused", "zero1", "zero2", "zero3", "fsdp", "fsdp:full_shard",
                       "fsdp:shard_grad_op", "fsdp:no_shard", "fsdp:hybrid_shard")
CHECK_TP_PLANS = ("gpt", "gpt2", "llama", "hf")
CHECK_STRATEGIES = ("none", *CHECK_DP_STRATEGIES, "distribute", "tp", *(f"tp:{p}" for p in CHECK_TP_PLANS))
CHECK_BACKENDS = ("thread", "gloo")
CHECK_PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1")


def _function_ref(text: str) -> str:
    module, sep, name = text.rpartition(":")
    if not sep or not module or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not MODULE_OR_FILE:function (e.g. mypkg.models:build or "
                                         f"models.py:build)")
    return text


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} must be a number >= 0")
    return value


def add_check(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "check",
        help="run a model under a strategy on CPU ranks for a few steps against one process; report differences",
        description="Train your model for a few steps under a strategy on CPU ranks (threads, or gloo processes) and "
        "in one process on the same global batches, and report per tensor the largest difference and the first "
        "value that differs, with its step and phase (forward, gradient, clip, update): sw.check from the command "
        "line. Exit code 0 when every value is within --rtol/--atol, 1 when one differs.",
    )
    p.add_argument("build", nargs="?", type=_function_ref, default=None, metavar="MODULE_OR_FILE:build_fn",
                   help="a zero-argument function returning a fresh torch.nn.Module")
    p.add_argument("--gpt", action="store_true",
                   help="check the library's tiny GPT on random tokens instead (a ready example)")
    p.add_argument("--batch", type=_function_ref, default=None, metavar="MODULE_OR_FILE:batch_fn",
                   help="batch_fn(step) -> the global batch: a tensor, tuple/list or dict of tensors")
    p.add_argument("--loss", type=_function_ref, default=None, metavar="MODULE_OR_FILE:loss_fn",
                   help="loss_fn(model, batch) -> scalar tensor, a mean over examples (default: the model's output "
                   "on the batch, or its .loss)")
    p.add_argument("--strategy", choices=CHECK_STRATEGIES, default="zero3", metavar="STRATEGY",
                   help=f"one of {', '.join(CHECK_STRATEGIES)}; with --tp, the data-parallel strategy over the dp "
                   f"axis (default: %(default)s)")
    p.add_argument("--wrap", type=_function_ref, default=None, metavar="MODULE_OR_FILE:wrap_fn",
                   help="wrap_fn(model, comm) -> the wrapped model: your own composition of strategies, checked "
                   "instead of --strategy")
    p.add_argument("-n", "--world-size", type=int_at_least(1, max_ranks("thread")), default=2, dest="world_size",
                   help="ranks (default: %(default)s)")
    p.add_argument("--steps", type=positive_int, default=3, help="training steps compared (default: %(default)s)")
    p.add_argument("--accumulate", type=positive_int, default=1, help="batches per optimizer step: gradient "
                   "accumulation, each loss divided by it (default: %(default)s)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size: tensor parallel over groups of "
                   "--tp ranks, then --strategy over the rest (default: %(default)s)")
    p.add_argument("--tp-plan", default=None, metavar="PLAN",
                   help=f"tensor-parallel plan: {', '.join(CHECK_TP_PLANS)} (default: the model's built-in one)")
    p.add_argument("--sequence-parallel", action="store_true", help="with --tp: sequence parallel too")
    p.add_argument("--cp", type=positive_int, default=1, help="context-parallel size: every sequence split over --cp "
                   "ranks, then --strategy over dp x cp (default: %(default)s)")
    p.add_argument("--cp-method", choices=("ring", "ulysses"), default="ring",
                   help="with --cp: ring or all-to-all (Ulysses) attention (default: %(default)s)")
    p.add_argument("--ep", type=positive_int, default=1, help="expert-parallel size: a MoE model's experts split over "
                   "--ep data-parallel ranks (default: %(default)s)")
    p.add_argument("--pp", type=positive_int, default=1, help="pipeline stages: the model split into --pp stages and "
                   "every axis applied by sw.parallelize, the batch a HuggingFace {'input_ids', 'labels'} dict or "
                   "(x, y) (default: %(default)s)")
    p.add_argument("--pp-schedule", choices=CHECK_PP_SCHEDULES, default=None,
                   help="with --pp: the pipeline schedule (default: 1f1b)")
    p.add_argument("--n-microbatches", type=positive_int, default=None,
                   help="with --pp: microbatches per step (default: sw.parallelize's, 2 x pp)")
    p.add_argument("--virtual-stages", type=positive_int, default=None,
                   help="with --pp: stages per rank (interleaved_1f1b; default 1)")
    p.add_argument("--backend", choices=CHECK_BACKENDS, default="thread",
                   help="thread ranks, or gloo processes on 127.0.0.1 (default: %(default)s)")
    p.add_argument("--max-norm", type=positive_float, default=1.0,
                   help="clip the gradient norm every step (default: %(default)s)")
    p.add_argument("--no-clip", action="store_true", help="do not clip")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed for every copy of the model "
                   "(default: %(default)s)")
    p.add_argument("--rtol", type=_non_negative_float, default=1e-5, help="relative tolerance (default: %(default)s)")
    p.add_argument("--atol", type=_non_negative_float, default=1e-6, help="absolute tolerance (default: %(default)s)")
    p.add_argument("--verbose", action="store_true", help="list every tensor, even in large models")
    p.set_defaults(handler=functools.partial(_run_check, p))


def _strategy(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    if args.gpt and (args.build is not None or args.batch is not None):
        parser.error("--gpt brings its own model and batches: give neither MODULE_OR_FILE:build_fn nor --batch")
    if not args.gpt and (args.build is None or args.batch is None):
        parser.error("give MODULE_OR_FILE:build_fn and --batch MODULE_OR_FILE:batch_fn (or --gpt for the example)")
    if args.wrap is not None:
        if (args.tp, args.cp, args.ep, args.pp) != (1, 1, 1, 1) or args.strategy != parser.get_default("strategy"):
            parser.error("--wrap is the whole strategy: give it without --strategy, --tp, --cp, --ep and --pp")
        return None  # loaded with the other functions
    if args.tp == 1 and (args.tp_plan is not None or args.sequence_parallel):
        parser.error("--tp-plan and --sequence-parallel need --tp > 1")
    if args.cp == 1 and args.cp_method != parser.get_default("cp_method"):
        parser.error("--cp-method needs --cp > 1")
    given = (("pp_schedule", args.pp_schedule), ("n_microbatches", args.n_microbatches),
             ("virtual_stages", args.virtual_stages))
    schedule = {key: value for key, value in given if value is not None}
    if args.pp == 1 and schedule:
        parser.error("--pp-schedule, --n-microbatches and --virtual-stages need --pp > 1")
    if (args.tp, args.cp, args.ep, args.pp) == (1, 1, 1, 1):
        return args.strategy
    if args.strategy not in ("none", *CHECK_DP_STRATEGIES):
        parser.error(f"with --tp, --cp, --ep or --pp, --strategy is the data-parallel strategy over the dp axis: one "
                     f"of none, {', '.join(CHECK_DP_STRATEGIES)}; got {args.strategy!r}")
    if args.tp_plan is not None and args.tp_plan not in CHECK_TP_PLANS:
        parser.error(f"--tp-plan {args.tp_plan!r} is not a built-in plan; allowed {', '.join(CHECK_TP_PLANS)}")
    plan = args.tp_plan or ("gpt" if args.gpt and args.tp > 1 else None)
    return {"tp": args.tp, "tp_plan": plan, "dp_strategy": args.strategy, "sequence_parallel": args.sequence_parallel,
            "cp": args.cp, "cp_method": args.cp_method, "ep": args.ep, "pp": args.pp, **schedule}


def _load(ref: str) -> Any:
    """The function `ref` names (MODULE_OR_FILE:name); OSError / ImportError / AttributeError name what failed."""
    import importlib

    module_name, _, name = ref.rpartition(":")
    if module_name.endswith(".py") or os.sep in module_name:
        path = os.path.abspath(module_name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no such file: {module_name}")
        folder, stem = os.path.split(path)
        stem = stem.removesuffix(".py")
        loaded = sys.modules.get(stem)
        if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") != path:
            raise ImportError(f"a module named {stem!r} is already imported from {loaded.__file__}; rename "
                              f"{module_name}")
        if folder not in sys.path:
            sys.path.insert(0, folder)  # processes (--backend gloo) import it by name, with the launcher's sys.path
        module_name = stem
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
    return getattr(module, name)


def _run_check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    strategy = _strategy(parser, args)
    from shardwise.check.spec import parse_strategy  # torch: only now that the command line is known to be good

    if strategy is not None:
        try:
            parse_strategy(strategy, args.world_size)  # sizes that do not fit (hybrid_shard, --tp) are usage errors
        except ValueError as exc:
            parser.error(str(exc).removeprefix("check: "))
    from shardwise.check import check

    try:
        if args.gpt:
            from shardwise.check.example import build_gpt, gpt_batch

            build, batch, loss = build_gpt, gpt_batch, None
        else:
            build, batch = _load(args.build), _load(args.batch)
            loss = _load(args.loss) if args.loss is not None else None
        if args.wrap is not None:
            strategy = _load(args.wrap)
    except Exception as exc:  # noqa: BLE001 - the user's code: one line naming what failed
        return fail("check", f"cannot load a function: {type(exc).__name__}: {exc}")
    try:
        report = check(build, batch, strategy=strategy, world_size=args.world_size, steps=args.steps,
                       accumulate=args.accumulate, loss_fn=loss,
                       max_norm=None if args.no_clip else args.max_norm, seed=args.seed, rtol=args.rtol,
                       atol=args.atol, backend=args.backend)
    except ValueError as exc:
        return fail("check", str(exc).removeprefix("check: "))
    print(report.text(verbose=args.verbose))
    if not report.ok:
        return fail("check", f"DIFFERS: {report.first_mismatch.describe()}")
    return 0

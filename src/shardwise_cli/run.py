"""`shardwise run`: launch a training script on local processes, supervised by shardwise's own launcher."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from .common import GLOO_RANKS_PER_CPU, cpus, fail, int_at_least, max_ranks, non_negative_int, positive_float, positive_int

def _script(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a file (give the training script to run)")
    return text


def add_run(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="launch a training script on local processes, supervised by shardwise (torchrun's job, with blame)",
        description="Start SCRIPT on --nproc local processes with the environment sw.init() reads (RANK, "
        "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; mpirun's for --backend mpi) and supervise them: when a "
        "rank fails, the others are stopped, every failed rank's traceback is printed with the rank that failed "
        "first (the root cause) named, and the exit code is non-zero. Arguments after SCRIPT go to the script.",
    )
    p.add_argument("-n", "--nproc", "--nproc-per-node", dest="nproc", type=positive_int, default=1,
                   help=f"processes on this node (default: %(default)s; at most {GLOO_RANKS_PER_CPU} per CPU core "
                   f"for gloo and mpi, {max_ranks('gloo')} here)")
    p.add_argument("--backend", choices=("gloo", "nccl", "mpi"), default=None,
                   help="what sw.init() joins with: gloo, nccl (one GPU per local rank) or mpi (ranks started by "
                   "mpirun); default: nccl when CUDA is available, else gloo")
    p.add_argument("--nnodes", type=positive_int, default=1, help="nodes in the job (default: %(default)s)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's index, 0..nnodes-1 (default: %(default)s)")
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="where node 0 hosts the rendezvous store (default: %(default)s)")
    p.add_argument("--master-port", type=int_at_least(1, 65535, "a TCP port"), default=None,
                   help="its port (default: one the OS picks; required with --nnodes > 1)")
    p.add_argument("--timeout", type=positive_float, default=60.0,
                   help="seconds to reach the store, and of heartbeat silence before a rank counts as frozen "
                   "(default: %(default)s)")
    p.add_argument("--grace", type=positive_float, default=3.0,
                   help="seconds between SIGTERM and SIGKILL when stopping ranks (default: %(default)s)")
    p.add_argument("--min", dest="min_workers", type=positive_int, default=None,
                   help="elastic job: the fewest workers it runs with (with --max; survivors of a failure keep "
                   "running and joiners are admitted; the script uses sw.elastic, see docs/elastic.md)")
    p.add_argument("--max", dest="max_workers", type=positive_int, default=None,
                   help="elastic job: the most workers it runs with")
    p.add_argument("--join", action="store_true",
                   help="add these --nproc workers to a running elastic job at --master-addr/--master-port (its "
                   "SHARDWISE_JOB_TOKEN in the environment)")
    p.add_argument("--max-restarts", type=non_negative_int, default=0,
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
                     f"({GLOO_RANKS_PER_CPU} per CPU core x {cpus()} cores)")
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
        return fail("run", str(exc).removeprefix("run: "))
    text = result.report()
    if text:
        print(text, file=sys.stderr)
    return result.exit_code

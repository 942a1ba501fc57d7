"""`shardwise demo`: train the small byte-level GPT on N local ranks, with any strategy and mesh, and report its cost.

Mechanism
---------
`run_demo(options)` calls `shardwise.launch(train_rank, nproc, options)`: N gloo processes on 127.0.0.1 (or N
threads of this process with `backend="thread"`, the fast path the tests use). Each rank starts the run its options
call for (`start_run`): a plain run wraps the whole GPT with the data-parallel strategy (plain_rank.py), any other a
`sw.parallelize` model over the mesh (mesh_rank.py); options.py says which is which. Both train a plain AdamW loop
over the rank's rows of the global batch, with a binding `sw.clip_grad_norm_(model, 1.0)`, and count their traffic.

Rank 0 draws a tqdm bar and keeps the per-step metrics; every rank returns its peak RSS and `memory_stats`. The
parent (report.py) prints a summary table and writes `<out>/<YYYYmmdd-HHMMSS>/` with `metrics.jsonl` (one line per
step), `summary.json` and `loss.png` (skipped, with a note, when matplotlib is missing). It prints the machine's
load average before and after the run and warns when it exceeds the usable cores: step times are then noise.

With `experts=E` (default 2 x ep when ep > 1) every block's MLP is a mixture of E experts, `experts_per_token` of them
per token, built with `moe_aux_loss_coef=0`: the load-balancing loss is a function of the whole batch, which
sw.parallelize computes per microbatch when a step is split into microbatches (as the demo's schedule splits it),
another loss than the one process the demo compares with; so the demo's MoE trains on the language-model loss alone.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ..benchmarks.timing import load_warning, loadavg, usable_cpus
from ..comm.base import Communicator
from ..launch import launch
from ..models.gpt import GPT
from ..planner.model_facts import model_facts
from .mesh_rank import MeshRun
from .options import DemoOptions
from .plain_rank import PlainRun
from .report import DemoSummary, format_summary, make_run_dir, summarise, write_outputs

__all__ = ["run_demo", "train_rank", "start_run", "COMM_TIMEOUT_S"]

# Seconds a collective may wait. Generous because a 2-core machine shared with other jobs can stall a rank for
# many seconds (spawn, torch import, corpus read); a rank that dies is still reported at once by launch().
COMM_TIMEOUT_S = 300.0


def start_run(comm: Communicator, options: DemoOptions) -> PlainRun | MeshRun:
    """This rank's run, built and ready to step: plain or through the mesh (options.uses_mesh)."""
    return MeshRun(comm, options) if options.uses_mesh else PlainRun(comm, options)


def train_rank(comm: Communicator, options: DemoOptions) -> dict[str, Any]:
    """Body of one rank: build, train `options.steps` steps (fewer after an early stop), return what report reads."""
    run = start_run(comm, options)
    while not run.done:
        run.step()
    return run.result()


def model_size(options: DemoOptions) -> tuple[int, int]:
    """(parameters, of which in experts) of the run's GPT, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        meta = GPT(options.gpt_config())
        return meta.num_parameters(), model_facts(meta).expert_params


def tokens_per_step(options: DemoOptions) -> int:
    """Tokens of one global batch: tp, pp and cp ranks share their dp slice."""
    return options.batch_size * options.gpt_config().seq_len * options.dp


def announce(options: DemoOptions) -> None:
    """The lines printed before the ranks start: the model, the strategy over its mesh, the batch, the load."""
    num_params, expert_params = model_size(options)
    seq_len = options.gpt_config().seq_len
    over = f"{options.nproc} {options.backend} rank(s)"
    if options.uses_mesh:
        cp = f" x cp {options.cp}" if options.cp > 1 else ""
        ep = (f" (ep {options.ep} borrowed from dp{' x cp' if options.cp > 1 else ''}, "
              f"edp {options.dp * options.cp // options.ep})") if options.ep > 1 else ""
        method = f", {options.cp_method} attention" if options.cp > 1 else ""
        over = (f"dp {options.dp}{cp} x tp {options.tp} x pp {options.pp}{ep} = {over}, schedule {options.schedule} "
                f"with {options.microbatches} microbatches{method}")
    if options.experts:
        print(f"mixture of experts: {options.experts} experts per block, {options.experts_per_token} per token, "
              f"{expert_params / 1e6:.2f}M of the parameters in experts; moe_aux_loss_coef=0 (a load-"
              f"balancing loss would be computed per microbatch, and the demo compares with one process on the "
              f"whole batch)", flush=True)
    if options.planned:
        print(f"--strategy auto: the planner chose {options.strategy}\n{options.planned}", flush=True)
    print(f"shardwise demo: GPT {options.preset!r} ({num_params / 1e6:.2f}M params), {options.strategy} over "
          f"{over}, {options.dp} x {options.batch_size} x {seq_len} = {tokens_per_step(options):,} tokens/step, "
          f"{options.steps} steps, lr {options.lr:g}", flush=True)


def report_load(when: str) -> list[float]:
    """Print the load average (and a warning when it exceeds the usable cores); return it."""
    load = loadavg()
    print(f"load average {when}: {', '.join(f'{v:.2f}' for v in load)} (1, 5, 15 min) on {usable_cpus()} usable "
          f"cores", flush=True)
    warning = load_warning(load)
    if warning:
        print(warning, flush=True)
    return load


def launch_ranks(body: Any, options: DemoOptions, *args: Any) -> tuple[list[Any], float, list[list[float]]]:
    """Run `body(comm, *args)` on the options' ranks; (results in rank order, wall seconds, [load before, after])."""
    threads = max(1, usable_cpus() // options.nproc)
    before = report_load("before")
    started = time.perf_counter()
    results = launch(body, options.nproc, *args, backend=options.backend, threads_per_rank=threads,
                     timeout=COMM_TIMEOUT_S)
    wall = time.perf_counter() - started
    return results, wall, [before, report_load("after")]


def finish(options: DemoOptions, results: list[dict[str, Any]], wall: float, load: list[list[float]],
           run_dir: Path | None) -> DemoSummary:
    """Summarise the ranks' results, write the run directory (`run_dir`, else a new <out>/<YYYYmmdd-HHMMSS>),
    print the summary; return it."""
    num_params, expert_params = model_size(options)
    summary = summarise(options, results, num_params, tokens_per_step(options), wall, expert_params=expert_params)
    summary.load = {"before": load[0], "after": load[1], "cpus": usable_cpus()}
    if run_dir is None:
        run_dir = make_run_dir(Path(options.out))
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
    summary.run_dir = str(run_dir)
    write_outputs(run_dir, summary, results[0]["metrics"], options.label)
    print(format_summary(summary))
    print(f"run directory: {run_dir}")
    return summary


def run_demo(options: DemoOptions, run_dir: Path | None = None) -> DemoSummary:
    """Launch the ranks, print the summary table, write the run directory (`run_dir`, else a new
    <out>/<YYYYmmdd-HHMMSS>); return the summary."""
    announce(options)
    results, wall, load = launch_ranks(train_rank, options, options)
    return finish(options, results, wall, load, run_dir)

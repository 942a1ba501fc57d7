"""`shardwise demo`: train the small byte-level GPT on local ranks with any strategy and mesh, and report its cost.

    from shardwise.demo import DemoOptions, run_demo, run_compare
    summary = run_demo(DemoOptions(strategy="zero3", nproc=2, steps=50))     # or `shardwise demo --strategy zero3`
    run_compare([DemoOptions(strategy=s, nproc=2) for s in ("ddp", "zero3")])  # `shardwise demo --compare ddp,zero3`

Modules, each importing only those before it: `auto` (the planner picks a strategy for --strategy auto), `options`
(DemoOptions and its checks; which runs are plain and which go through sw.parallelize), `loop` (the learning-rate
schedule, rank 0's step log, early stopping), `plain_rank` and `mesh_rank` (one rank's run over dp alone, or over
the mesh), `report` (the summary, its formulas and the run directory), `run` (the parent: launch, summarise,
write), `compare` (several strategies trained alternating in the same processes). The command line lives in
shardwise_cli, which imports this package; this package never imports it.
"""

from .compare import run_compare
from .options import SCHEDULES, STRATEGIES, STRATEGY_ALIASES, DemoOptions
from .loop import StepLog, lr_at
from .report import DemoSummary, format_summary, make_run_dir, ring_all_reduce_bytes
from .run import run_demo, train_rank

__all__ = ["STRATEGIES", "STRATEGY_ALIASES", "SCHEDULES", "DemoOptions", "DemoSummary", "StepLog", "run_demo",
           "run_compare", "train_rank", "lr_at", "ring_all_reduce_bytes", "format_summary", "make_run_dir"]

"""The benchmark harness, in the package so that `shardwise bench` works from an install.

    from shardwise.benchmarks import BenchConfig, run_bench
    result = run_bench(BenchConfig.quick())          # or `shardwise bench --quick`
    result.run_dir                                   # results.md, results.jsonl, step_time.png, memory.png, bytes.png

Modules: `timing` (alternating rounds, medians, the slowest rank per step, JSON lines: shared with the scripts in
bench/ through bench/_common.py), `formulas` (the textbook wire bytes of each data-parallel strategy), `peers` (the
rows: shardwise's strategies, PyTorch DDP / FSDP2, DeepSpeed ZeRO where importable, the no-communication floor),
`suite` (the run), `report` (the table and the plots).
"""

from .formulas import formula_text, wire_bytes_formula
from .peers import ORDER, PEERS, Peer, missing
from .suite import BenchConfig, BenchResult, default_out, run_bench

__all__ = ["BenchConfig", "BenchResult", "ORDER", "PEERS", "Peer", "default_out", "formula_text", "missing",
           "run_bench", "wire_bytes_formula"]

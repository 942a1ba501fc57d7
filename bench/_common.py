"""What the benchmark scripts share: alternating rounds, timing, step statistics, JSON lines and the load average.

The helpers live in the package (`shardwise.benchmarks.timing`, so that `shardwise bench` works from an install);
this module re-exports them under the names the scripts import. See that module's docstring for the method:
implementations compared in the SAME processes, alternating, the order rotating every round; per step the slowest
rank; medians and deciles; per-round ratios; stdout carries JSON lines only (`emit`).

Scripts import this as `_common` (Python puts the script's folder, bench/, first on sys.path; spawned and MPI ranks
inherit that path).
"""

from __future__ import annotations

from shardwise.benchmarks.timing import (alternate, bench_corpus, comma_list, emit, gpt_config, loadavg,
                                         max_over_ranks, median, per_round_ratios, rotations, step_stats, timed)

__all__ = [
    "alternate",
    "bench_corpus",
    "comma_list",
    "emit",
    "gpt_config",
    "loadavg",
    "max_over_ranks",
    "median",
    "per_round_ratios",
    "rotations",
    "step_stats",
    "timed",
]

"""Timing for benchmarks that compare implementations in the same processes: alternating rounds, medians, the
slowest rank per step, per-round ratios, the load average, JSON lines.

Every comparison runs its implementations in the SAME processes, alternating: `alternate` runs `rounds` rounds,
each a block of `steps` steps per implementation after a barrier, the order rotating every round, so slow phases of
a noisy machine hit every implementation alike (the method of bench/README.md; a shared 2-core machine moves
single figures by 15-25%, so only ratios measured in one alternating run mean anything). Step times are taken on
every rank; `max_over_ranks` keeps, per step (and per section of a step), the slowest rank, and `step_stats` turns
them into the median and deciles. `per_round_ratios` compares two implementations round by round (blocks run back
to back), which a burst of load moves less than the ratio of overall medians. `emit` writes one JSON line.
`loadavg` and `load_warning` say how busy the machine was: a 1-minute load average above the usable cores means
other processes took turns on them, and single figures are noise (only the ratios of one alternating run hold).

The one timing harness of the project: `shardwise bench` (shardwise.benchmarks.suite), `shardwise demo --compare`
(shardwise.demo.compare) and every script in bench/ import it from here.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from ..data import ByteCorpus
from ..models.gpt import GPTConfig

__all__ = [
    "alternate",
    "bench_corpus",
    "comma_list",
    "emit",
    "gpt_config",
    "load_warning",
    "loadavg",
    "usable_cpus",
    "max_over_ranks",
    "median",
    "per_round_ratios",
    "rotations",
    "step_stats",
    "timed",
]

T = TypeVar("T")
median = statistics.median


def rotations(items: Sequence[T], rounds: int) -> Iterator[list[T]]:
    """The order of each round: round r starts with item r (mod len), so every item goes first as often."""
    for r in range(rounds):
        k = r % len(items)
        yield [*items[k:], *items[:k]]


def alternate(items: Sequence[T], rounds: int, steps: int, run: Callable[[T], Any],
              barrier: Callable[[], None]) -> None:
    """`rounds` rounds of `steps` calls `run(item)` per item, order rotating; ranks align before every block."""
    for order in rotations(items, rounds):
        for item in order:
            barrier()
            for _ in range(steps):
                run(item)


def timed(fn: Callable[[], Any], repeats: int, barrier: Callable[[], None] | None = None) -> float:
    """Median milliseconds (2 decimals) of `repeats` calls of fn, each after `barrier()` when given."""
    out = []
    for _ in range(repeats):
        if barrier is not None:
            barrier()
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return round(median(out) * 1e3, 2)


def max_over_ranks(per_rank: Sequence[Sequence[Any]]) -> list[Any]:
    """Per step, the slowest rank: `per_rank[rank][step]` is a time, or a list of section times (max per section)."""
    steps = zip(*per_rank)
    return [[max(col) for col in zip(*ranks)] if isinstance(ranks[0], (list, tuple)) else max(ranks)
            for ranks in steps]


def step_stats(totals: Sequence[float], sections: Sequence[Sequence[float]] | None = None,
               keys: Sequence[str] = ()) -> dict[str, Any]:
    """median_ms / p10_ms / p90_ms / steps of step times in seconds; with `sections` (per step, one time per key),
    also the median of each section in ms under its key."""
    ms = sorted(t * 1e3 for t in totals)
    deciles = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) > 1 else [ms[0]] * 9
    row: dict[str, Any] = {"median_ms": round(median(ms), 2), "p10_ms": round(deciles[0], 2),
                           "p90_ms": round(deciles[8], 2), "steps": len(ms)}
    if sections is not None:
        for i, key in enumerate(keys):
            row[key] = round(median(s[i] * 1e3 for s in sections), 2)
    return row


def per_round_ratios(a: Sequence[float], b: Sequence[float], steps: int, rounds: int) -> list[float]:
    """Per round, the median of a's block of `steps` times over the median of b's block."""
    return [median(a[r * steps:(r + 1) * steps]) / median(b[r * steps:(r + 1) * steps]) for r in range(rounds)]


def emit(record: dict[str, Any]) -> None:
    """One JSON line on stdout (flushed, so a long run can be followed)."""
    print(json.dumps(record), flush=True)


def loadavg() -> list[float]:
    """The 1, 5 and 15-minute load averages (2 decimals): how busy the shared machine was."""
    return [round(v, 2) for v in os.getloadavg()]


def usable_cpus() -> int:
    """The cores this process may run on (its affinity: containers, taskset), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def load_warning(load: Sequence[float], cpus: int | None = None) -> str | None:
    """A one-line warning when the 1-minute load average `load[0]` exceeds the usable cores, else None."""
    cpus = cpus or usable_cpus()
    if not load or load[0] <= cpus:
        return None
    return (f"warning: the load average {load[0]:.2f} exceeds the {cpus} usable cores: other processes share them, "
            f"so single step times are noisy; compare implementations within one alternating run, never across runs")


def comma_list(text: str, kind: Callable[[str], T] = str) -> list[T]:  # type: ignore[assignment]
    """'25,4, 1' -> [kind('25'), kind('4'), kind('1')]; empty items are dropped."""
    return [kind(v.strip()) for v in text.split(",") if v.strip()]


def bench_corpus() -> ByteCorpus:
    """The training text of every benchmark: the stdlib sources; 2 MB is plenty and loads fast."""
    return ByteCorpus(max_bytes=2_000_000)


def gpt_config(preset: str, seq_len: int | None = None, **overrides: Any) -> GPTConfig:
    """GPTConfig.preset(preset), with seq_len overridden when given (a --seq-len flag left unset is None)."""
    return GPTConfig.preset(preset, **overrides, **({} if seq_len is None else {"seq_len": seq_len}))

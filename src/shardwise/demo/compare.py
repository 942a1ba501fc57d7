"""`shardwise demo --compare ddp,zero3,...`: the same demo once per data-parallel strategy, trained alternating in the
same processes, then drawn together.

Method
------
Two runs back to back on a shared machine measure the machine as much as the strategies: a burst of load during one
of them moves its step time by 15-25%, enough to reverse which one looks faster. So the strategies are trained in
ONE launch, each rank building every strategy's run (same model, seed, data, batch and steps) and stepping them in
rounds of `BLOCK_STEPS` steps per strategy, the order rotating every round, ranks aligned by a barrier before each
block (`benchmarks.timing.alternate`, the harness `shardwise bench` and bench/ use): a slow phase hits every strategy
alike. Each strategy takes exactly the code path it takes alone (`run.start_run`): over dp alone, ddp and zero3
both wrap the whole model and run one forward and backward per step (options.py), so neither goes through a
pipeline that the other does not. The variants must agree on that path (same mesh and pipeline options); a
mixture is refused.

Output: <out>/<YYYYmmdd-HHMMSS>-compare/<strategy>/ holds each run's metrics.jsonl, summary.json and loss.png (its
summary is printed as a lone run's is); compare.md and compare.json hold one table (final loss, median step and its
ratio to the fastest, tokens/s, wire bytes per rank per step against the strategy's formula, model states per rank
against the ZeRO estimate) with the load average before and after; loss_vs_time.png draws each run's loss against its
cumulative step time on rank 0 (the strategies see the same batches, so the curves differ only by speed) and
memory.png the model states per rank, measured beside estimated (matplotlib, the `[bench]` extra). Every rank
process holds all the strategies' models at once, so the peak RSS of each summary is the comparison's, not one
strategy's; model states (memory_stats) are each strategy's own.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from ..benchmarks.timing import alternate
from ..comm.base import Communicator
from ..files import save_figure, write_text
from .options import DemoOptions
from .progress import progress_bar
from .report import DemoSummary, make_run_dir
from .run import announce, finish, launch_ranks, start_run

__all__ = ["run_compare", "compare_table", "compare_rank", "BLOCK_STEPS"]

#: Steps of one strategy per block of a round (the order of the strategies rotates every round).
BLOCK_STEPS = 5


def compare_rank(comm: Communicator, variants: list[DemoOptions], progress: bool) -> list[dict[str, Any]]:
    """Body of one rank: every variant's run built here and stepped alternating (module docstring); their results
    in the order of `variants`."""
    runs = [start_run(comm, options) for options in variants]
    bar = None
    if progress and comm.rank == 0:
        bar = progress_bar(sum(v.steps for v in variants), "compare " + ",".join(v.strategy for v in variants))

    def one(run: Any) -> None:
        if not run.done:  # an early-stopped run sits out the rest (every rank agreed on when: loop.EarlyStop)
            run.step()
            if bar is not None:
                bar.update(1)

    alternate(runs, math.ceil(max(v.steps for v in variants) / BLOCK_STEPS), BLOCK_STEPS, one, comm.barrier)
    if bar is not None:
        bar.close()
    return [run.result() for run in runs]


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.2f}"


def compare_table(summaries: list[DemoSummary]) -> str:
    """A markdown table, one line per strategy."""
    fastest = min(s.median_step_ms for s in summaries)
    lines = ["| strategy | final loss (mean of last 10) | median step (ms) | x fastest | tokens/s | wire MiB/step/rank "
             "| formula | model states MiB/rank | estimate |", "|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for s in summaries:
        steady = max(s.wire_bytes_per_step) if s.wire_bytes_per_step else 0
        formula = f"{s.formula} = {_mib(s.formula_wire_bytes)}" if s.formula_wire_bytes is not None else "n/a"
        states = max(r["memory"]["model_states"] for r in s.ranks)
        lines.append(f"| {s.options['strategy']} | {s.final_loss_mean_last:.4f} | {s.median_step_ms:,.1f} "
                     f"| {s.median_step_ms / fastest:.2f} | {s.tokens_per_s:,.0f} | {_mib(steady)} | {formula} "
                     f"| {_mib(states)} | {_mib(s.estimate_model_states)} |")
    return "\n".join(lines)


def _method(variants: list[DemoOptions], load: list[list[float]]) -> str:
    from ..benchmarks.timing import load_warning, usable_cpus

    text = (f"Method: the strategies trained alternating in the same {variants[0].nproc} {variants[0].backend} "
            f"rank(s), {BLOCK_STEPS} steps each per round, the order rotating every round; step times are rank 0's, "
            f"median over each strategy's steps. Every rank process holds every strategy's model, so a summary's peak "
            f"RSS is the comparison's; model states are each strategy's own. Load average (1 min) "
            f"{load[0][0]:.2f} before, {load[1][0]:.2f} after, on {usable_cpus()} usable cores.")
    warning = load_warning(load[0]) or load_warning(load[1])
    return text + (f"\n\n{warning[0].upper()}{warning[1:]}." if warning else "")


def _plots(folder: Path, summaries: list[DemoSummary], curves: dict[str, list[dict[str, Any]]]) -> str:
    try:
        import matplotlib
    except ImportError:
        return "Plots were not drawn: matplotlib is not installed (pip install 'shardwise[bench]')."
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, metrics in curves.items():
        elapsed, total = [], 0.0
        for m in metrics:
            total += m["step_ms"] / 1e3
            elapsed.append(total)
        ax.plot(elapsed, [m["loss"] for m in metrics], lw=1.2, label=name)
    ax.set_xlabel("training time (s, sum of rank 0's step times)")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(f"shardwise demo --compare: GPT {summaries[0].options['preset']}, "
                 f"{summaries[0].options['nproc']} {summaries[0].options['backend']} ranks, alternating")
    ax.grid(alpha=0.3)
    ax.legend(title="strategy")
    fig.tight_layout()
    save_figure(fig, folder / "loss_vs_time.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(summaries) + 2), 4))
    names = [s.options["strategy"] for s in summaries]
    xs = list(range(len(summaries)))
    mib = 2**20
    ax.bar([x - 0.2 for x in xs], [max(r["memory"]["model_states"] for r in s.ranks) / mib for s in summaries], 0.4,
           label="model states per rank (measured)")
    ax.bar([x + 0.2 for x in xs], [(s.estimate_model_states or 0) / mib for s in summaries], 0.4,
           label="ZeRO estimate (fp32 AdamW)")
    ax.set_xticks(xs)
    ax.set_xticklabels(names, rotation=20, ha="right")
    ax.set_xlabel("strategy")
    ax.set_ylabel("MiB per rank")
    ax.set_title("memory per rank by strategy")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, folder / "memory.png", dpi=110)
    plt.close(fig)
    return ""


def run_compare(variants: list[DemoOptions]) -> list[DemoSummary]:
    """Run every variant (DemoOptions differing in strategy) alternating, print and write the comparison; return
    the summaries. ValueError when the variants are fewer than two, repeat a strategy, or differ in anything but
    the strategy (and dp_shard, which only fsdp:hybrid_shard takes)."""
    if len({v.strategy for v in variants}) != len(variants) or len(variants) < 2:
        raise ValueError(f"demo: compare needs at least two distinct strategies; got "
                         f"{[v.strategy for v in variants]}")
    first = dataclasses.replace(variants[0], strategy="ddp", dp_shard=None, planned=None)
    for v in variants[1:]:
        if dataclasses.replace(v, strategy="ddp", dp_shard=None, planned=None) != first:
            raise ValueError(f"demo: compare needs variants that differ only in strategy; {v.strategy!r} differs "
                             f"from {variants[0].strategy!r} in more")
    for options in variants:
        announce(options)
    ranked = [dataclasses.replace(v, progress=False) for v in variants]  # one bar for all: compare_rank's
    results, wall, load = launch_ranks(compare_rank, variants[0], ranked, variants[0].progress)
    folder = make_run_dir(Path(variants[0].out))
    folder = folder.rename(folder.with_name(folder.name + "-compare"))
    summaries, curves = [], {}
    for i, options in enumerate(variants):
        run_dir = folder / options.strategy.replace(":", "-")
        summary = finish(options, [rank[i] for rank in results], wall, load, run_dir)
        summaries.append(summary)
        curves[options.strategy] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    table = compare_table(summaries)
    method = _method(variants, load)
    note = _plots(folder, summaries, curves)
    write_text(folder / "compare.md", f"# shardwise demo --compare\n\n{table}\n\n{method}\n"
               + (f"\n{note}\n" if note else ""))
    write_text(folder / "compare.json", json.dumps({"method": method, "runs": [s.as_dict() for s in summaries]},
                                                   indent=2) + "\n")
    print(table)
    print(method)
    if note:
        print(note)
    print(f"comparison directory: {folder}")
    return summaries

"""`shardwise demo --compare ddp,zero3,...`: the same demo once per data-parallel strategy, drawn together.

Each strategy runs as its own `run_demo` (same model, seed, data, batch and steps; see demo.py), one after the
other, into <out>/<YYYYmmdd-HHMMSS>-compare/<strategy>/. Then one table compares them (final loss, median step,
tokens/s, wire bytes per rank per step against the strategy's formula, model states per rank against the ZeRO
estimate), written as compare.md and compare.json, and two plots: loss_vs_time.png (each run's loss against its
cumulative step time on rank 0: the strategies see the same batches, so the curves differ only by speed) and
memory.png (model states per rank, measured beside estimated; matplotlib, the `[bench]` extra).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .demo import DemoOptions, DemoSummary, run_demo
from .demo_report import make_run_dir
from .files import save_figure, write_text

__all__ = ["run_compare", "compare_table"]


def _mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.2f}"


def compare_table(summaries: list[DemoSummary]) -> str:
    """A markdown table, one line per strategy."""
    lines = ["| strategy | final loss (mean of last 10) | median step (ms) | tokens/s | wire MiB/step/rank | formula "
             "| model states MiB/rank | estimate |", "|---|---:|---:|---:|---:|---|---:|---:|"]
    for s in summaries:
        steady = max(s.wire_bytes_per_step) if s.wire_bytes_per_step else 0
        formula = f"{s.formula or '2(N-1)/N x G'} = {_mib(s.formula_wire_bytes)}" if s.formula_wire_bytes else "n/a"
        states = max(r["memory"]["model_states"] for r in s.ranks)
        lines.append(f"| {s.options['strategy']} | {s.final_loss_mean_last:.4f} | {s.median_step_ms:,.1f} "
                     f"| {s.tokens_per_s:,.0f} | {_mib(steady)} | {formula} | {_mib(states)} "
                     f"| {_mib(s.estimate_model_states)} |")
    return "\n".join(lines)


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
                 f"{summaries[0].options['nproc']} {summaries[0].options['backend']} ranks")
    ax.grid(alpha=0.3)
    ax.legend()
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
    ax.set_ylabel("MiB per rank")
    ax.set_title("memory per rank by strategy")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, folder / "memory.png", dpi=110)
    plt.close(fig)
    return ""


def run_compare(variants: list[DemoOptions]) -> list[DemoSummary]:
    """Run every variant (DemoOptions differing in strategy), print and write the comparison; return the summaries."""
    if len({v.strategy for v in variants}) != len(variants) or len(variants) < 2:
        raise ValueError(f"demo: compare needs at least two distinct strategies; got "
                         f"{[v.strategy for v in variants]}")
    folder = make_run_dir(Path(variants[0].out))
    folder = folder.rename(folder.with_name(folder.name + "-compare"))
    summaries, curves = [], {}
    for options in variants:
        run_dir = folder / options.strategy.replace(":", "-")
        summary = run_demo(options, run_dir)
        summaries.append(summary)
        curves[options.strategy] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    table = compare_table(summaries)
    note = _plots(folder, summaries, curves)
    write_text(folder / "compare.md", f"# shardwise demo --compare\n\n{table}\n" + (f"\n{note}\n" if note else ""))
    write_text(folder / "compare.json", json.dumps([s.as_dict() for s in summaries], indent=2) + "\n")
    print(table)
    if note:
        print(note)
    print(f"comparison directory: {folder}")
    return summaries

"""The run directory of `shardwise bench`: results.md (a markdown table), results.jsonl, and three plots.

Plots (matplotlib, the `[bench]` extra; without it the table says how to get them), each with a legend and its
units: step_time.png, the median step per row with its 10th-90th percentile range, coloured by library, and the
no-communication floor as a line; memory.png, per row the model states measured beside the ZeRO estimate, and the
peak RSS the row added; bytes.png, wire bytes per rank per step, measured (shardwise) or the textbook formula
(peers), beside the formula.

The floor (`floor_check`): the "local" row does each rank's work of a data-parallel row (its batch, forward,
backward, AdamW over every parameter) with no communication, so it should be the fastest row. When a row beats it
the report says why: within the run's noise (the two p10-p90 ranges overlap), or a strategy that shards the
optimizer step (ZeRO: each rank updates 1/N of the parameters, less work than the floor's whole update, which cheap
same-host communication can more than pay for), or, with neither, that the run's figures are not to be trusted.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from ..files import save_figure, write_text

__all__ = ["BenchResult", "write_report", "markdown_table", "floor_check", "PLOTS"]

#: The plot files a run directory holds when matplotlib is installed.
PLOTS = ("step_time.png", "memory.png", "bytes.png")
_MATPLOTLIB = "pip install 'shardwise[bench]' (matplotlib)"
#: Strategies whose ranks each run the optimizer step over 1/N of the parameters (ZeRO's partitioned optimizer).
SHARDED_OPTIMIZER = ("zero1", "zero2", "zero3")
_COLORS = {"shardwise": "#4c72b0", "torch": "#dd8452", "deepspeed": "#55a868"}


@dataclasses.dataclass
class BenchResult:
    """What `run_bench` (suite.py) measured and this module writes: the run directory, the rows (one dict each, as
    results.jsonl holds them; a row that did not run has status "missing" and its install line), and the run's header
    (configuration, machine)."""

    run_dir: Path
    rows: list[dict[str, Any]]
    header: dict[str, Any]


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:,.2f}"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One line per row: step time, throughput, wire bytes against the formula, memory against the estimate."""
    lines = ["| row | implementation | median step (ms) | p10-p90 | tokens/s | x floor | wire MiB/step/rank "
             "| formula | model states MiB/rank | estimate | peak RSS added MiB | loss |",
             "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['row']} | {r['label']} | not run: {r['reason']}; install: `{r['install']}` "
                         f"| | | | | {r['formula']} | | {_mib(r['estimate_model_states'])} | | |")
            continue
        wire = r["wire_bytes"] if r["wire_bytes"] is not None else r["formula_wire_bytes"]
        source = "" if r["wire_bytes_source"] == "measured" else " (formula)"
        floor = "" if r.get("vs_floor") is None else f"{r['vs_floor']:.2f}"
        lines.append(
            f"| {r['row']} | {r['label']} | {r['median_ms']:,.1f} | {r['p10_ms']:,.1f}-{r['p90_ms']:,.1f} "
            f"| {r['tokens_per_s']:,} | {floor} | {_mib(wire)}{source} | {r['formula']} = "
            f"{_mib(r['formula_wire_bytes'])} | {_mib(r.get('model_states'))} | {_mib(r['estimate_model_states'])} "
            f"| {_mib(r.get('peak_rss_delta'))} | {r['loss']:.4f} |")
    return "\n".join(lines)


def floor_check(rows: list[dict[str, Any]]) -> str:
    """Whether the no-communication floor ("local") is the fastest row of those that ran, and if not, why (the
    module docstring)."""
    ok = [r for r in rows if r["status"] == "ok"]
    floor = next((r for r in ok if r["row"] == "local"), None)
    if floor is None:
        return "Floor: the no-communication row did not run (--impls without local), so no row is checked against it."
    faster = sorted((r for r in ok if r is not floor and r["median_ms"] < floor["median_ms"]),
                    key=lambda r: r["median_ms"])
    if not faster:
        return (f"Floor: the no-communication row is the fastest ({floor['median_ms']:,.1f} ms), as it should be: "
                f"every other row does its work plus communication.")
    why = []
    for r in faster:
        gap = f"{r['row']} ({r['median_ms']:,.1f} ms, {1 - r['median_ms'] / floor['median_ms']:.0%} under it)"
        if r["p90_ms"] >= floor["p10_ms"]:
            why.append(f"{gap} is within this run's noise: its p10-p90 range overlaps the floor's")
        elif r["strategy"] in SHARDED_OPTIMIZER:
            why.append(f"{gap} shards the optimizer step: each rank updates 1/N of the parameters, less work than "
                       f"the floor's whole AdamW step, and same-host communication costs less than it saves")
        else:
            why.append(f"{gap} beats it with no mechanism that explains it: do not trust this run's figures "
                       f"(see the load average)")
    return (f"Floor: the no-communication row ({floor['median_ms']:,.1f} ms) is not the fastest: "
            + "; ".join(why) + ".")


def _markdown(result: BenchResult, plots_note: str) -> str:
    h = result.header
    c = h["config"]
    missing = [r for r in result.rows if r["status"] != "ok"]
    parts = [
        "# shardwise bench",
        "",
        f"GPT preset `{c['preset']}` ({h['num_params']:,} parameters, seq {h['seq_len']}), {c['nproc']} gloo "
        f"processes of one thread, {c['batch_size']} sequences per rank ({h['tokens_per_step']:,} tokens/step), "
        f"AdamW fp32 lr {c['lr']:g}; {c['warmup']} warm-up steps, then {c['rounds']} rounds x {c['steps']} steps "
        f"per row, alternating; memory runs of {c['memory_steps']} steps per row in fresh processes.",
        f"torch {h['torch']}, Python {h['python']}, {h['cpus']} CPUs; load average before {h['loadavg_before']}, "
        f"after {h['loadavg_after']}; wall {h['wall_s']} s; started {h['started']}.",
        *([f"**{h['load_warning'][0].upper()}{h['load_warning'][1:]}.**"] if h.get("load_warning") else []),
        "",
        markdown_table(result.rows),
        "",
        *([h["floor_check"], ""] if h.get("floor_check") else []),
        "Step time: per step the slowest rank, median (and 10th-90th percentile) over the measured steps; x floor "
        "is the ratio to the no-communication row. Wire bytes: per rank per step, counted by shardwise's CommStats "
        "(ring cost), or the textbook formula for peers it cannot count; G = fp32 gradient bytes, N = ranks. Model "
        "states: params + grads + optimizer state this rank holds after a step (shardwise: sw.memory_stats; "
        "others: their tensors' storages), against sw.estimate_memory (fp32 AdamW, 16 bytes per parameter "
        "unsharded). Peak RSS added: the process's peak above its peak before the model was built. The loss of "
        "each row's last step on rank 0 (same data and init: the distributed rows agree; the floor trains each "
        "rank on its own batch). A shared machine moves single figures by 15-25%: compare rows of one run.",
    ]
    if missing:
        parts += ["", "## Not run", ""]
        parts += [f"- {r['row']} ({r['label']}): {r['reason']}. Install: `{r['install']}`" for r in missing]
    if plots_note:
        parts += ["", plots_note]
    return "\n".join(parts) + "\n"


def _plots(result: BenchResult) -> str:
    """Draw PLOTS into the run directory; returns a note when they cannot be drawn."""
    try:
        import matplotlib
    except ImportError:
        return f"Plots were not drawn: matplotlib is not installed ({_MATPLOTLIB})."
    matplotlib.use("Agg")  # no display; must precede pyplot's import
    import matplotlib.pyplot as plt

    ok = [r for r in result.rows if r["status"] == "ok"]
    names = [r["row"] for r in ok]
    colors = [_COLORS.get(r["library"], _COLORS["torch"]) for r in ok]
    title = (f"GPT {result.header['config']['preset']} ({result.header['num_params'] / 1e6:.1f}M), "
             f"{result.header['config']['nproc']} gloo ranks")
    xs = range(len(ok))

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(ok) + 2), 4))
    medians = [r["median_ms"] for r in ok]
    errors = [[m - r["p10_ms"] for m, r in zip(medians, ok)], [r["p90_ms"] - m for m, r in zip(medians, ok)]]
    ax.bar(xs, medians, yerr=errors, color=colors, capsize=3)
    from matplotlib.patches import Patch

    handles = [Patch(color=_COLORS[lib], label=lib) for lib in _COLORS if lib in {r["library"] for r in ok}]
    floor = next((r["median_ms"] for r in ok if r["row"] == "local"), None)
    if floor is not None:
        handles.append(ax.axhline(floor, color="gray", ls="--", lw=1, label="no-communication floor"))
    ax.legend(handles=handles, fontsize=8, title="library", title_fontsize=8)
    ax.set_ylabel("step time (ms, median; bars p10-p90)")
    ax.set_title(f"step time per strategy: {title}")
    _finish(plt, fig, ax, names, result.run_dir / "step_time.png")

    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(ok) + 2), 4))
    w = 0.28
    mib = 2**20
    ax.bar([x - w for x in xs], [(r.get("model_states") or 0) / mib for r in ok], w, label="model states (measured)")
    ax.bar(list(xs), [r["estimate_model_states"] / mib for r in ok], w, label="model states (ZeRO estimate)")
    ax.bar([x + w for x in xs], [(r.get("peak_rss_delta") or 0) / mib for r in ok], w, label="peak RSS added")
    ax.set_ylabel("MiB per rank")
    ax.set_title(f"memory per strategy: {title}")
    ax.legend(fontsize=8)
    _finish(plt, fig, ax, names, result.run_dir / "memory.png")

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(ok) + 2), 4))
    w = 0.4
    # Peers' traffic cannot be counted from here: no measured bar (nan draws nothing), only the formula's.
    measured = [r["wire_bytes"] / mib if r["wire_bytes"] is not None else float("nan") for r in ok]
    ax.bar([x - w / 2 for x in xs], measured, w, label="measured (shardwise CommStats)")
    ax.bar([x + w / 2 for x in xs], [r["formula_wire_bytes"] / mib for r in ok], w, label="textbook formula")
    ax.set_ylabel("wire MiB per rank per step")
    ax.set_title(f"bytes per step: {title}")
    ax.legend(fontsize=8)
    _finish(plt, fig, ax, names, result.run_dir / "bytes.png")
    return ""


def _finish(plt: Any, fig: Any, ax: Any, names: list[str], path: Any) -> None:
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.set_xlabel("row (implementation)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)


def write_report(result: BenchResult) -> str:
    """Create the run directory and write results.jsonl, the plots and results.md; return the table."""
    result.run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"run": result.header})] + [json.dumps(row) for row in result.rows]
    write_text(result.run_dir / "results.jsonl", "\n".join(lines) + "\n")
    note = _plots(result)
    write_text(result.run_dir / "results.md", _markdown(result, note))
    return markdown_table(result.rows) + (f"\n{note}" if note else "")

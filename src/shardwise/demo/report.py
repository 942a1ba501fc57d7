"""What `shardwise demo` reports: the summary of a run (`DemoSummary`, summary.json), its check of the measured wire
bytes and model states against the strategy's formulas, the run directory (metrics.jsonl, summary.json, loss.png)
and the table printed at the end, with the wire bytes of each mesh axis (`axis_rows`)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import statistics
from pathlib import Path
from typing import Any

from ..benchmarks.formulas import estimate_key, formula_text, wire_bytes_formula
from ..estimate import estimate_memory
from ..files import save_figure, write_text
from .options import DemoOptions, demo_axes

__all__ = ["DemoSummary", "ring_all_reduce_bytes", "summarise", "make_run_dir", "write_outputs", "format_summary",
           "mesh_fields", "axis_rows"]


@dataclasses.dataclass
class DemoSummary:
    """What `run_demo` measured; `as_dict()` is what summary.json holds. Losses are global (averaged over dp).

    final_loss_mean_last: the mean loss of the last `mean_last_steps` (up to 10) steps, less noisy than the last.
    median_step_ms: median wall time of a whole iteration (batch, forward, backward, step, loss all-reduce) on
    rank 0; tokens_per_s is tokens_per_step (batch_size x seq_len x dp) over that median.
    wire_bytes_per_step: measured per-rank wire bytes of each step (all axes summed), as the
    distinct values over all ranks and steps. formula_wire_bytes: the strategy's textbook bytes per rank per step
    (`formula`: "2(N-1)/N x G" for DDP, ZeRO-1/2 and shard_grad_op, "3(N-1)/N x G" for ZeRO-3 / full_shard; see
    benchmarks.formulas) for a purely data-parallel run (tp = pp = cp = ep = 1; else None); a plain run's bytes
    leave out clipping's 4-byte norm all-reduce (plain_rank.py);
    wire_bytes_match: whether the steady steps meet it (plain DDP to the byte; others within 10%; the ZeRO-3
    family at most its formula and at least one gather fewer, since units still gathered when backward needs them
    are not gathered again). estimate_model_states: `estimate_memory` of the strategy (fp32 AdamW) for a run
    without tensor or pipeline parallel (the dense states over dp x cp, the experts' divided by ep). steps_run:
    steps trained (fewer than options.steps after an early stop); validation: [step, loss] of each evaluation;
    stopped_at: the step after which the ranks stopped, or None. load: the machine's load averages (1, 5, 15 min)
    "before" and "after" the run and its usable "cpus" (run.py warns when the 1-minute figure exceeds them).
    mesh: {dp, tp, pp} sizes (and cp, ep when > 1: options.demo_axes); wire_bytes_per_axis: the same distinct
    values per axis; ops_per_axis: rank 0's last step per axis, `CommStats.as_dict()` ({op: {calls, bytes,
    wire_bytes}}). mesh_run: the run went through sw.parallelize (options.uses_mesh). ranks: per rank, its mesh
    coords, wire_bytes_per_axis, peak_rss (bytes of the whole process; on the thread backend every rank shares one
    process) and memory (memory_stats().as_dict(): params, grads, optimizer, model_states bytes).
    """

    run_dir: str
    options: dict[str, Any]
    num_params: int
    grad_bytes: int
    first_loss: float
    final_loss: float
    final_loss_mean_last: float
    mean_last_steps: int
    median_step_ms: float
    tokens_per_step: int
    tokens_per_s: float
    wire_bytes_per_step: list[int]
    formula_wire_bytes: int | None
    wire_bytes_match: bool | None
    ranks: list[dict[str, Any]]
    wall_s: float
    mesh: dict[str, int]
    wire_bytes_per_axis: dict[str, list[int]]
    ops_per_axis: dict[str, dict[str, dict[str, int]]]
    mesh_run: bool = False
    formula: str | None = None
    estimate_model_states: int | None = None
    steps_run: int = 0
    validation: list[list[float]] = dataclasses.field(default_factory=list)
    stopped_at: int | None = None
    load: dict[str, Any] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def ring_all_reduce_bytes(grad_bytes: int, world_size: int) -> int:
    """The DDP formula: per-rank wire bytes of one ring all-reduce of all gradients, 2(N-1)/N x grad_bytes."""
    return 2 * (world_size - 1) * grad_bytes // world_size


def summarise(options: DemoOptions, results: list[dict[str, Any]], num_params: int, tokens_per_step: int,
              wall: float, *, expert_params: int = 0) -> DemoSummary:
    """The run's summary from the ranks' results: losses, step time, the wire bytes against the strategy's formula
    (DDP to the byte), the model states against `estimate_memory` (expert_params: the MoE GPT's, which ep splits)."""
    metrics = results[0]["metrics"]
    losses = [m["loss"] for m in metrics]
    step_ms = statistics.median(m["step_ms"] for m in metrics)
    grad_bytes = results[0]["grad_bytes"]
    measured = sorted({w for r in results for w in r["wire_bytes"]})
    formula: int | None = None
    match: bool | None = None
    estimate: int | None = None
    microbatches = options.microbatches or 1  # a plain run has none: the whole batch in one forward and backward
    if options.strategy == "ddp" and not options.uses_mesh:
        formula = ring_all_reduce_bytes(grad_bytes, options.nproc)
        # DDP reduces bucket by bucket and CommStats rounds each bucket's 2(N-1)/N share down to a whole byte, so
        # with N not a power of two the sum may sit up to one byte per call below the formula.
        calls = max(r["all_reduce_calls"] for r in results)
        match = all(0 <= formula - w <= calls for w in measured)
    elif options.tp * options.pp * options.cp * options.ep == 1:  # purely data parallel: the formula applies
        formula = wire_bytes_formula(options.strategy, grad_bytes, options.dp, options.dp_shard, microbatches)
        steady = [r["wire_bytes"][-1] for r in results]  # ZeRO-1/2 gather the updated parameters from step 2 on
        # The ZeRO-3 family re-gathers less than its textbook formula says: units still gathered when backward
        # needs them (the root, the last forward unit) are not gathered again; it never moves less than one step
        # with a single gather of the parameters (ZeRO-2's bytes, plus hybrid_shard's replicate all-reduce).
        floor = 0.9 * formula
        if options.strategy in ("zero3", "fsdp:full_shard", "fsdp:hybrid_shard"):
            group = options.dp_shard if options.strategy == "fsdp:hybrid_shard" else options.dp
            floor = (wire_bytes_formula(options.strategy, grad_bytes, options.dp, options.dp_shard, 1)
                     - (group - 1) / group * grad_bytes)
        match = all(floor <= w <= 1.02 * formula for w in steady)
    if options.tp * options.pp == 1:  # dense states shared over dp x cp; with ep > 1 the experts split over ep
        shards = options.dp_shard if options.strategy == "fsdp:hybrid_shard" else options.dp * options.cp
        experts = {"ep": options.ep, "expert_params": expert_params} if options.ep > 1 else {}
        estimate = int(estimate_memory(num_params, estimate_key(options.strategy), shards, mixed_precision=False,
                                       **experts).total)
    return DemoSummary(
        run_dir="",
        options=dataclasses.asdict(options),
        num_params=num_params,
        grad_bytes=grad_bytes,
        first_loss=losses[0],
        final_loss=losses[-1],
        final_loss_mean_last=statistics.fmean(losses[-10:]),
        mean_last_steps=min(10, len(losses)),
        median_step_ms=step_ms,
        tokens_per_step=tokens_per_step,
        tokens_per_s=tokens_per_step / (step_ms / 1e3),
        wire_bytes_per_step=measured,
        formula_wire_bytes=formula,
        wire_bytes_match=match,
        wall_s=wall,
        **mesh_fields(options, results),
        mesh_run=options.uses_mesh,
        formula=formula_text(options.strategy, microbatches) if formula is not None else None,
        estimate_model_states=estimate,
        steps_run=len(losses),
        validation=results[0]["validation"],
        stopped_at=results[0]["stopped_at"],
    )


def make_run_dir(out: Path) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for suffix in [""] + [f"-{i}" for i in range(1, 1000)]:
        candidate = out / f"{stamp}{suffix}"
        try:
            candidate.mkdir(parents=True)  # exist_ok=False: two runs in the same second get distinct folders
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"demo: could not create a fresh run directory under {out}")


def write_outputs(run_dir: Path, summary: DemoSummary, metrics: list[dict[str, Any]], label: str) -> None:
    write_text(run_dir / "metrics.jsonl", "".join(json.dumps(record) + "\n" for record in metrics))
    write_text(run_dir / "summary.json", json.dumps(summary.as_dict(), indent=2) + "\n")
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed; skipping loss.png (pip install matplotlib)")
        return
    matplotlib.use("Agg")  # no display needed; must precede pyplot's import
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], lw=1.2, label=f"training loss, {label}")
    ax.set_xlabel("step (optimizer steps)")
    ax.set_ylabel("loss (nats/byte, mean over dp ranks)")
    ax.legend()
    ax.set_title(f"shardwise demo: {label}, GPT {summary.options['preset']}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, run_dir / "loss.png", dpi=110)
    plt.close(fig)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def format_summary(s: DemoSummary) -> str:
    """The summary table the demo prints: losses, step time, the wire bytes per mesh axis (against the strategy's
    formula for a purely data-parallel run), memory per rank."""
    rows = [
        ("loss (first -> final)", f"{s.first_loss:.3f} -> {s.final_loss:.3f}  (mean of last "
                                  f"{s.mean_last_steps}: {s.final_loss_mean_last:.3f})"),
        ("median step time", f"{s.median_step_ms:,.1f} ms"),
        ("throughput", f"{s.tokens_per_s:,.0f} tokens/s  ({s.tokens_per_step:,} tokens/step)"),
    ]
    if s.stopped_at is not None or s.validation:
        last = f"{s.validation[-1][1]:.3f} at step {int(s.validation[-1][0])}" if s.validation else "none"
        stop = (f"stopped early after step {s.stopped_at} (patience {s.options['early_stop']})"
                if s.stopped_at is not None else f"trained all {s.steps_run} steps")
        rows.append(("validation loss", f"{last}; best {min(v[1] for v in s.validation):.3f}; {stop}"))
    rows += axis_rows(s)
    if s.formula_wire_bytes is not None:
        steady = max(s.wire_bytes_per_step)
        clip = "; clipping's 4-byte norm all-reduce not counted" if not s.mesh_run else ""
        ratio = f"measured/formula {steady / s.formula_wire_bytes:.3f}  " if s.formula_wire_bytes else ""
        rows.append((f"  formula {s.formula}", f"{s.formula_wire_bytes:,}  (G = grads {s.grad_bytes:,} B{clip}); "
                     f"{ratio}{'MATCH' if s.wire_bytes_match else 'MISMATCH'}"))
    shared = s.options["backend"] == "thread"
    for r in s.ranks:
        m = r["memory"]
        rss = _mib(r["peak_rss"]) + (" (shared process)" if shared else "")
        coords = ", ".join(f"{a} {r['coords'][a]}" for a in s.mesh)
        where = f" ({coords})" if s.mesh_run else ""
        against = (f" vs estimate {_mib(s.estimate_model_states)} ({m['model_states'] / s.estimate_model_states:.3f})"
                   if s.estimate_model_states else "")
        rows.append((f"rank {r['rank']}{where} memory", f"peak RSS {rss}; model states {_mib(m['model_states'])}"
                                                 f"{against} (params {_mib(m['params'])}, grads {_mib(m['grads'])}, "
                                                 f"optimizer {_mib(m['optimizer'])})"))
    rows.append(("wall time", f"{s.wall_s:.1f} s"))
    if s.load:
        rows.append(("load average (1 min)", f"{s.load['before'][0]:.2f} before, {s.load['after'][0]:.2f} after, on "
                                             f"{s.load['cpus']} usable cores"))
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 60)
    return "\n".join([line, *(f"{k:<{width}}  {v}" for k, v in rows), line])


def mesh_fields(options: DemoOptions, results: list[dict[str, Any]]) -> dict[str, Any]:
    """DemoSummary's per-rank and per-axis fields from the ranks' results (of either rank body): ranks (coords,
    per-axis wire bytes: the distinct values in the order the steps first gave them, peak RSS, memory), mesh
    sizes, wire_bytes_per_axis (distinct values over all ranks, sorted), ops_per_axis; per `demo_axes`."""
    axes = demo_axes(options)
    return {
        "ranks": [{"rank": r["rank"], "coords": r["coords"],
                   "wire_bytes_per_axis": {a: list(dict.fromkeys(r["wire_bytes_per_axis"][a])) for a in axes},
                   "peak_rss": r["peak_rss"], "memory": r["memory"]} for r in results],
        "mesh": {a: getattr(options, a) for a in axes},
        "wire_bytes_per_axis": {a: sorted({w for r in results for w in r["wire_bytes_per_axis"][a]}) for a in axes},
        "ops_per_axis": results[0]["ops_per_axis"],
    }


def axis_rows(s: DemoSummary) -> list[tuple[str, str]]:
    """Summary rows: per mesh axis, the wire bytes one rank sent per step, by pp rank (stages hold different
    layers, so their traffic differs; the ranks of one stage send the same), and rank 0's operations. The
    steady value comes first; values of earlier steps follow in brackets (ZeRO-1/2 all-gather the updated
    parameters at the start of the next step, so the first step has no gather). The ep axis's bytes follow the
    routing, which differs by rank and step: its row gives their range."""
    rows = []
    for axis in s.mesh:  # demo_axes: dp, tp, pp, and cp, ep when > 1
        # dp = 1 still reduces dense gradients when cp > 1: over the dp x cp ranks, counted on dp
        if s.mesh[axis] == 1 and not any(s.wire_bytes_per_axis[axis]):
            rows.append((f"{axis} wire bytes/step", f"0  ({axis} = 1)"))
            continue
        by_stage: dict[int, dict[int, None]] = {}
        for r in s.ranks:
            by_stage.setdefault(r["coords"]["pp"], {}).update(dict.fromkeys(r["wire_bytes_per_axis"][axis]))
        values = []
        for _, seen in sorted(by_stage.items()):
            if axis == "ep" and len(seen) > 1:
                values.append(f"{min(seen):,} to {max(seen):,} (as the tokens were routed)")
                continue
            *early, steady = seen
            values.append(f"{steady:,}" + (f" (first steps: {', '.join(f'{w:,}' for w in early)})" if early else ""))
        text = values[0] if len(values) == 1 else " | ".join(f"pp {p}: {v}" for p, v in enumerate(values))
        ops = ", ".join(f"{op} x{c['calls']}" for op, c in s.ops_per_axis[axis].items())
        over = "; over dp x cp" if axis == "dp" and s.mesh.get("cp", 1) > 1 else ""
        rows.append((f"{axis} wire bytes/step", f"{text} per rank  (rank 0: {ops}{over})"))
    return rows

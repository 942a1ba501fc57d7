"""`shardwise demo`: train the small byte-level GPT data-parallel on N local ranks and report what it cost.

Mechanism
---------
`run_demo(options)` calls `shardwise.launch(train_rank, nproc, options)`: N gloo processes on 127.0.0.1 (or N
threads of this process with `backend="thread"`, the fast path the tests use). Every rank builds the same
`GPT(GPTConfig.preset(preset), seed=seed)`, wraps it with `shardwise.DDP`, and runs a plain AdamW loop over its
rows of the global batch (`ShardedSampler`: `batch_size` rows per rank, so a step sees `batch_size * nproc`
sequences). The learning rate warms up linearly, then decays along a cosine to a tenth of its peak.

Per step each rank counts the traffic DDP issued inside forward + backward + optimizer step with
`comm.stats.measure()`, and compares it with the textbook cost of data parallelism: a ring all-reduce of every
trainable gradient byte, 2(N-1)/N x grad_bytes per rank per step (Li et al., VLDB 2020). The GPT ties its
embedding and output matrices; that shared Parameter has one gradient and is reduced once, so grad_bytes counts
unique parameters (`model.parameters()` already yields a shared Parameter once). The loss that is logged is the
global one: each rank's loss is all-reduced (AVG) after the measured block, so that 4-byte collective does not
pollute the DDP count.

Rank 0 draws a tqdm bar and keeps the per-step metrics; every rank returns its peak RSS and `memory_stats`. The
parent prints a summary table and writes `<out>/<YYYYmmdd-HHMMSS>/` with `metrics.jsonl` (one line per step),
`summary.json` and `loss.png` (skipped, with a note, when matplotlib is missing).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .comm.base import Communicator, ReduceOp
from .ddp import DDP
from .whole.memory import memory_stats, peak_rss_bytes
from .models.gpt import GPT, GPTConfig
from .launch import launch

__all__ = ["STRATEGIES", "DemoOptions", "DemoSummary", "run_demo", "train_rank", "lr_at"]

#: Strategies the demo can train with (more join as they land: zero1/2/3, fsdp, tp, pp, ...).
STRATEGIES = ("ddp",)
# Seconds a collective may wait. Generous because a 2-core machine shared with other jobs can stall a rank for
# many seconds (spawn, torch import, corpus read); a rank that dies is still reported at once by launch().
COMM_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    """Everything one demo run needs; picklable, since gloo ranks receive it in a spawned process.

    nproc: number of ranks. strategy: one of STRATEGIES. steps: optimizer steps.
    data: corpus path for `ByteCorpus` (None: the Python standard library's sources).
    preset: `GPTConfig.preset` name. batch_size: sequences per rank per step (seq_len comes from the preset).
    lr: peak learning rate of AdamW. warmup: steps of linear warmup (None: 10% of steps, at most 50).
    seed: model init and data order. out: parent folder of the run directory.
    backend: "gloo" (processes) or "thread" (threads of this process). progress: draw rank 0's tqdm bar.
    """

    nproc: int = 2
    strategy: str = "ddp"
    steps: int = 200
    data: str | None = None
    preset: str = "small"
    batch_size: int = 8
    lr: float = 3e-3
    warmup: int | None = None
    seed: int = 0
    out: str = "runs"
    backend: str = "gloo"
    progress: bool = True

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"demo: strategy={self.strategy!r} is not supported; allowed {STRATEGIES}")
        for name in ("nproc", "steps", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"demo: {name}={value!r} must be an int >= 1")
        if not self.lr > 0:
            raise ValueError(f"demo: lr={self.lr!r} must be a positive number")

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else min(50, max(1, self.steps // 10))


@dataclasses.dataclass
class DemoSummary:
    """What `run_demo` measured; `as_dict()` is what summary.json holds. Losses are global (averaged over ranks).

    final_loss_mean_last: the mean loss of the last `mean_last_steps` (up to 10) steps, less noisy than the last.
    median_step_ms: median wall time of a whole iteration (batch, forward, backward, step, loss all-reduce) on
    rank 0; tokens_per_s is tokens_per_step (batch_size x seq_len x nproc) over that median.
    wire_bytes_per_step: measured per-rank all-reduce wire bytes of each step, as the distinct values seen over
    all ranks and steps (one value when every step cost the same). formula_wire_bytes: 2(N-1)/N x grad_bytes.
    ranks: per rank, peak_rss (bytes of the whole process; on the thread backend every rank shares one process)
    and memory (memory_stats().as_dict(): params, grads, optimizer, model_states bytes).
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
    formula_wire_bytes: int
    wire_bytes_match: bool
    ranks: list[dict[str, Any]]
    wall_s: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def lr_at(step: int, options: DemoOptions) -> float:
    """Linear warmup to `lr` over the warmup steps, then cosine decay to lr / 10 at the last step."""
    warmup = options.warmup_steps
    if step < warmup:
        return options.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, options.steps - 1 - warmup)
    return options.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def ring_all_reduce_bytes(grad_bytes: int, world_size: int) -> int:
    """The DDP formula: per-rank wire bytes of one ring all-reduce of all gradients, 2(N-1)/N x grad_bytes."""
    return 2 * (world_size - 1) * grad_bytes // world_size


# ---- one rank -------------------------------------------------------------------------------------------------------
def train_rank(comm: Communicator, options: DemoOptions) -> dict[str, Any]:
    """Body of one rank: build, wrap, train `options.steps` steps; return memory figures and (rank 0) metrics."""
    from .data import ByteCorpus, ShardedSampler  # the corpus is read inside each rank, not pickled over

    config = GPTConfig.preset(options.preset)
    model = GPT(config, seed=options.seed)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    model = DDP(model, comm)
    opt = torch.optim.AdamW(model.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=0.01)
    corpus = ByteCorpus(options.data)
    sampler = ShardedSampler(corpus, options.batch_size, config.seq_len, rank=comm.rank, world_size=comm.size,
                             seed=options.seed)
    global_tokens = options.batch_size * config.seq_len * comm.size
    lead = comm.rank == 0
    bar = _progress_bar(options) if lead else None
    metrics: list[dict[str, Any]] = []
    wire: list[int] = []
    calls = 0
    for step in range(options.steps):
        lr = lr_at(step, options)
        for group in opt.param_groups:
            group["lr"] = lr
        start = time.perf_counter()
        x, y = next(sampler)
        with comm.stats.measure() as step_stats:
            loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # local: grads are already averaged
            opt.step()
            opt.zero_grad(set_to_none=False)  # keep .grad as views of DDP's buckets
        global_loss = loss.detach().clone()
        comm.all_reduce(global_loss, ReduceOp.AVG)
        seconds = time.perf_counter() - start
        wire.append(step_stats.wire_bytes("all_reduce"))
        calls = max(calls, step_stats.calls("all_reduce"))
        if lead:
            record = {"step": step, "loss": global_loss.item(), "lr": lr, "step_ms": seconds * 1e3,
                      "tokens_per_s": global_tokens / seconds, "wire_bytes": wire[-1]}
            metrics.append(record)
            if bar is not None:
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
                bar.update(1)
    if bar is not None:
        bar.close()
    return {
        "rank": comm.rank,
        "grad_bytes": grad_bytes,
        "wire_bytes": wire,
        "all_reduce_calls": calls,
        "peak_rss": peak_rss_bytes(),
        "memory": memory_stats(model, opt).as_dict(),
        "metrics": metrics if lead else None,
    }


def _progress_bar(options: DemoOptions) -> Any:
    if not options.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=options.steps, desc=f"{options.strategy} x{options.nproc}", unit="step", file=sys.stderr,
                dynamic_ncols=True)


# ---- the parent -----------------------------------------------------------------------------------------------------
def run_demo(options: DemoOptions) -> DemoSummary:
    """Launch the ranks, print the summary table, write the run directory; return the summary."""
    config = GPTConfig.preset(options.preset)
    with torch.device("meta"):  # counts parameters without allocating or drawing them
        num_params = GPT(config).num_parameters()
    tokens_per_step = options.batch_size * config.seq_len * options.nproc
    print(f"shardwise demo: GPT {options.preset!r} ({num_params / 1e6:.2f}M params), {options.strategy} over "
          f"{options.nproc} {options.backend} rank(s), {options.nproc} x {options.batch_size} x {config.seq_len} = "
          f"{tokens_per_step:,} tokens/step, {options.steps} steps, lr {options.lr:g}", flush=True)
    threads = max(1, (os.cpu_count() or 1) // options.nproc)
    started = time.perf_counter()
    results = launch(train_rank, options.nproc, options, backend=options.backend, threads_per_rank=threads,
                     timeout=COMM_TIMEOUT_S)
    wall = time.perf_counter() - started
    summary = _summarise(options, results, num_params, tokens_per_step, wall)
    run_dir = _make_run_dir(Path(options.out))
    summary.run_dir = str(run_dir)
    _write_outputs(run_dir, summary, results[0]["metrics"])
    print(format_summary(summary))
    print(f"run directory: {run_dir}")
    return summary


def _summarise(options: DemoOptions, results: list[dict[str, Any]], num_params: int, tokens_per_step: int,
               wall: float) -> DemoSummary:
    metrics = results[0]["metrics"]
    losses = [m["loss"] for m in metrics]
    step_ms = statistics.median(m["step_ms"] for m in metrics)
    grad_bytes = results[0]["grad_bytes"]
    formula = ring_all_reduce_bytes(grad_bytes, options.nproc)
    measured = sorted({w for r in results for w in r["wire_bytes"]})
    # DDP reduces bucket by bucket and CommStats rounds each bucket's 2(N-1)/N share down to a whole byte, so
    # with N not a power of two the sum may sit up to one byte per call below the formula.
    calls = max(r["all_reduce_calls"] for r in results)
    match = all(0 <= formula - w <= calls for w in measured)
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
        ranks=[{"rank": r["rank"], "peak_rss": r["peak_rss"], "memory": r["memory"]} for r in results],
        wall_s=wall,
    )


def _make_run_dir(out: Path) -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for suffix in [""] + [f"-{i}" for i in range(1, 1000)]:
        candidate = out / f"{stamp}{suffix}"
        try:
            candidate.mkdir(parents=True)  # exist_ok=False: two runs in the same second get distinct folders
            return candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"demo: could not create a fresh run directory under {out}")


def _write_outputs(run_dir: Path, summary: DemoSummary, metrics: list[dict[str, Any]]) -> None:
    with open(run_dir / "metrics.jsonl", "w") as fh:
        for record in metrics:
            fh.write(json.dumps(record) + "\n")
    (run_dir / "summary.json").write_text(json.dumps(summary.as_dict(), indent=2) + "\n")
    try:
        import matplotlib
    except ImportError:
        print("note: matplotlib is not installed; skipping loss.png (pip install matplotlib)")
        return
    matplotlib.use("Agg")  # no display needed; must precede pyplot's import
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([m["step"] for m in metrics], [m["loss"] for m in metrics], lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte, mean over ranks)")
    opts = summary.options
    ax.set_title(f"shardwise demo: {opts['strategy']} x{opts['nproc']}, GPT {opts['preset']}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=110)
    plt.close(fig)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def format_summary(s: DemoSummary) -> str:
    """The summary table the demo prints."""
    measured = ", ".join(f"{w:,}" for w in s.wire_bytes_per_step)
    rows = [
        ("loss (first -> final)", f"{s.first_loss:.3f} -> {s.final_loss:.3f}  (mean of last "
                                  f"{s.mean_last_steps}: {s.final_loss_mean_last:.3f})"),
        ("median step time", f"{s.median_step_ms:,.1f} ms"),
        ("throughput", f"{s.tokens_per_s:,.0f} tokens/s  ({s.tokens_per_step:,} tokens/step)"),
        ("all-reduce wire bytes/step", f"measured {measured} per rank"),
        ("  formula 2(N-1)/N x grads", f"{s.formula_wire_bytes:,}  (grads {s.grad_bytes:,} B)  "
                                       f"{'MATCH' if s.wire_bytes_match else 'MISMATCH'}"),
    ]
    shared = s.options["backend"] == "thread"
    for r in s.ranks:
        m = r["memory"]
        rss = _mib(r["peak_rss"]) + (" (shared process)" if shared else "")
        rows.append((f"rank {r['rank']} memory", f"peak RSS {rss}; model states {_mib(m['model_states'])} "
                                                 f"(params {_mib(m['params'])}, grads {_mib(m['grads'])}, "
                                                 f"optimizer {_mib(m['optimizer'])})"))
    rows.append(("wall time", f"{s.wall_s:.1f} s"))
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 60)
    return "\n".join([line, *(f"{k:<{width}}  {v}" for k, v in rows), line])

"""`shardwise demo`: train the small byte-level GPT on N local ranks, with any strategy and mesh, and report its cost.

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

Any other configuration (a ZeRO / FSDP strategy, tp or pp > 1, any pipeline, tensor-parallel or activation
checkpointing option) runs `demo_hybrid.train_mesh_rank` instead: `sw.parallelize` over `Mesh(comm, dp, tp, pp)`, its traffic measured per mesh
axis (see that module). There is no single textbook formula for a composed step, so only the pure-DDP run is
checked against one.

Rank 0 draws a tqdm bar and keeps the per-step metrics; every rank returns its peak RSS and `memory_stats`. The
parent prints a summary table and writes `<out>/<YYYYmmdd-HHMMSS>/` with `metrics.jsonl` (one line per step),
`summary.json` and `loss.png` (skipped, with a note, when matplotlib is missing).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from shardwise_cli import SCHEDULES  # the command line's vocabulary, spelled where it needs no torch

from .benchmarks.formulas import estimate_key, formula_text, wire_bytes_formula
from .comm.base import Communicator, ReduceOp
from .ddp import DDP
from .demo_auto import choose_strategy
from .demo_hybrid import (EarlyStop, StepLog, axis_rows, check_mesh_options, dp_size, lr_at, mesh_fields,
                          split_corpus, train_mesh_rank)
from .estimate import estimate_memory
from .hybrid import DP_STRATEGIES
from .launch import launch
from .models.gpt import GPT, GPTConfig
from .whole.memory import memory_stats, peak_rss_bytes

__all__ = ["STRATEGIES", "STRATEGY_ALIASES", "SCHEDULES", "DemoOptions", "DemoSummary", "StepLog", "run_demo", "train_rank", "lr_at"]

#: Data-parallel strategies the demo can train with (`sw.parallelize`'s dp_strategy values).
STRATEGIES = DP_STRATEGIES
#: Other names of a strategy the demo accepts (Lightning's "fsdp" is full sharding).
STRATEGY_ALIASES = {"fsdp": "fsdp:full_shard"}
# Seconds a collective may wait. Generous because a 2-core machine shared with other jobs can stall a rank for
# many seconds (spawn, torch import, corpus read); a rank that dies is still reported at once by launch().
COMM_TIMEOUT_S = 300.0


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"demo: {name}={value!r} must be an int >= 1")


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    """Everything one demo run needs; picklable, since gloo ranks receive it in a spawned process.

    nproc: number of ranks (None: dp x tp x pp). strategy: one of STRATEGIES. steps: optimizer steps (about two
    minutes of the "small" preset on 2 cores, for DDP x2 and for dp2 x tp2 x pp2 on 8 thread ranks alike).
    data: corpus path for `ByteCorpus` (None: the Python standard library's sources).
    preset: `GPTConfig.preset` name. batch_size: sequences per dp rank per step (seq_len comes from the preset).
    lr: peak learning rate of AdamW. warmup: steps of linear warmup (None: 10% of steps, at most 50).
    seed: model init and data order. out: parent folder of the run directory.
    backend: "gloo" (processes) or "thread" (threads of this process); None: thread when tp or pp > 1, else gloo.
    progress: draw rank 0's tqdm bar.
    dp, tp, pp: the mesh (dp None: nproc // (tp x pp), or 2 ranks of DDP when tp = pp = 1 and nproc is None).
    dp_shard: shard-group size within dp for strategy "fsdp:hybrid_shard" (required there, refused elsewhere).
    schedule: pipeline schedule (SCHEDULES); virtual_stages: stages per pp rank (interleaved_1f1b needs >= 2).
    microbatches: per step (None: 2 x pp); must divide batch_size. sequence_parallel: needs tp > 1.
    activation_checkpointing: recompute the blocks in backward.
    early_stop: patience, in evaluations without improvement, after which every rank stops (None: train all
    steps); the last 10% of the corpus is then held out. eval_every: steps between evaluations; eval_batches:
    held-out batches per evaluation; min_delta: how much lower than the best a validation loss must be to count.
    Resolved fields (nproc, dp, backend, microbatches) hold their values after construction; an
    inconsistent combination raises ValueError naming the numbers.
    """

    nproc: int | None = None
    strategy: str = "ddp"
    steps: int = 200
    data: str | None = None
    preset: str = "small"
    batch_size: int = 8
    lr: float = 3e-3
    warmup: int | None = None
    seed: int = 0
    out: str = "runs"
    backend: str | None = None
    progress: bool = True
    dp: int | None = None
    tp: int = 1
    pp: int = 1
    dp_shard: int | None = None
    schedule: str = "1f1b"
    microbatches: int | None = None
    virtual_stages: int = 1
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    early_stop: int | None = None
    eval_every: int = 10
    eval_batches: int = 4
    min_delta: float = 0.0
    memory_gb: float | None = None
    planned: str | None = None  # the planner's explanation when strategy was "auto" (resolved here)

    def __post_init__(self) -> None:
        if self.strategy in STRATEGY_ALIASES:
            object.__setattr__(self, "strategy", STRATEGY_ALIASES[self.strategy])
        if self.memory_gb is not None and not (isinstance(self.memory_gb, (int, float)) and self.memory_gb > 0):
            raise ValueError(f"demo: memory_gb={self.memory_gb!r} must be a positive number of GB per rank")
        if self.strategy == "auto":  # the planner chooses, once, before any rank starts (demo_auto)
            for name in ("tp", "pp"):
                _check_int(name, getattr(self, name))
            dp = dp_size(self.nproc, self.dp, self.tp, self.pp)
            strategy, why = choose_strategy(self.preset, dp, self.tp, self.pp, self.memory_gb)
            object.__setattr__(self, "strategy", strategy)
            object.__setattr__(self, "planned", why)
        if self.strategy not in STRATEGIES:
            raise ValueError(f"demo: strategy={self.strategy!r} is not supported; allowed "
                             f"{STRATEGIES + tuple(STRATEGY_ALIASES) + ('auto',)}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"demo: schedule={self.schedule!r} is not supported; allowed {SCHEDULES}")
        for name in ("steps", "batch_size", "tp", "pp", "virtual_stages", "eval_every", "eval_batches"):
            _check_int(name, getattr(self, name))
        for name in ("nproc", "dp", "microbatches", "dp_shard", "early_stop"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name))
        if not self.lr > 0:
            raise ValueError(f"demo: lr={self.lr!r} must be a positive number")
        if not self.min_delta >= 0:
            raise ValueError(f"demo: min_delta={self.min_delta!r} must be a number >= 0")
        resolve = functools.partial(object.__setattr__, self)  # frozen: resolved once, here
        resolve("dp", dp_size(self.nproc, self.dp, self.tp, self.pp))
        resolve("nproc", self.dp * self.tp * self.pp)
        # Thread ranks for a model split over tp or pp: dp2 x tp2 x pp2 is 8 ranks, and 8 processes would each load
        # torch (about 0.4 GiB of RSS apiece) and spawn for seconds on 2 cores; threads share one process.
        resolve("backend", self.backend or ("thread" if self.tp * self.pp > 1 else "gloo"))
        if self.uses_mesh:
            resolve("microbatches", self.microbatches or 2 * self.pp)
            check_mesh_options(self)

    @property
    def uses_mesh(self) -> bool:
        """True unless this is the plain DDP run: DDP over dp only, with no pipeline or tensor-parallel option."""
        return (self.tp * self.pp > 1 or self.strategy != "ddp" or self.microbatches is not None
                or self.activation_checkpointing or self.sequence_parallel or self.dp_shard is not None
                or self.schedule != "1f1b" or self.virtual_stages != 1)

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else min(50, max(1, self.steps // 10))

    @property
    def label(self) -> str:
        """A short name of the run: "ddp x2", or the strategy and mesh, e.g. "zero1 dp2 x tp2 x pp2"."""
        if not self.uses_mesh:
            return f"{self.strategy} x{self.nproc}"
        return f"{self.strategy} dp{self.dp} x tp{self.tp} x pp{self.pp}"


@dataclasses.dataclass
class DemoSummary:
    """What `run_demo` measured; `as_dict()` is what summary.json holds. Losses are global (averaged over dp).

    final_loss_mean_last: the mean loss of the last `mean_last_steps` (up to 10) steps, less noisy than the last.
    median_step_ms: median wall time of a whole iteration (batch, forward, backward, step, loss all-reduce) on
    rank 0; tokens_per_s is tokens_per_step (batch_size x seq_len x dp) over that median.
    wire_bytes_per_step: measured per-rank wire bytes of each step (all axes summed; DDP: its all-reduce), as the
    distinct values over all ranks and steps. formula_wire_bytes: the strategy's textbook bytes per rank per step
    (`formula`: "2(N-1)/N x G" for DDP, ZeRO-1/2 and shard_grad_op, "3(N-1)/N x G" for ZeRO-3 / full_shard; see
    benchmarks.formulas) for a purely data-parallel run (tp = pp = 1; else None); wire_bytes_match: whether the
    steady steps meet it (DDP to the byte; sharded strategies within 10%; the ZeRO-3 family at most its
    formula and at least one gather fewer, since units still gathered when backward needs them are not gathered
    again). estimate_model_states: `estimate_memory` of the strategy (fp32 AdamW) for a
    purely data-parallel run. steps_run: steps trained (fewer than options.steps after an early stop);
    validation: [step, loss] of each evaluation; stopped_at: the step after which the ranks stopped, or None.
    mesh: {dp, tp, pp} sizes; wire_bytes_per_axis: the same distinct values per axis; ops_per_axis: rank 0's last
    step per axis, `CommStats.as_dict()` ({op: {calls, bytes, wire_bytes}}). mesh_run: the run went through
    sw.parallelize (anything but plain DDP). ranks: per rank, its mesh coords, wire_bytes_per_axis, peak_rss (bytes
    of the whole process; on the thread backend every rank shares one process) and memory
    (memory_stats().as_dict(): params, grads, optimizer, model_states bytes).
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

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
    corpus, held = split_corpus(ByteCorpus(options.data), options)
    sampler = ShardedSampler(corpus, options.batch_size, config.seq_len, rank=comm.rank, world_size=comm.size,
                             seed=options.seed)
    stopper = EarlyStop(options, held, comm, comm, comm.rank, config.seq_len, lambda x, y: model(x, y))
    log = StepLog(options, comm.rank, options.batch_size * config.seq_len * comm.size)
    wire: list[int] = []
    calls = 0
    ops: dict[str, dict[str, int]] = {}
    for step in range(options.steps):
        lr = log.set_lr(opt, step)
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
        ops = step_stats.as_dict()
        log.record(step, global_loss.item(), lr, seconds, wire_bytes=wire[-1])
        if stopper.should_stop(step, model):
            break
    return {
        "rank": comm.rank,
        "grad_bytes": grad_bytes,
        "wire_bytes": wire,
        "all_reduce_calls": calls,
        "coords": {"dp": comm.rank, "tp": 0, "pp": 0},
        "wire_bytes_per_axis": {"dp": wire, "tp": [0] * len(wire), "pp": [0] * len(wire)},
        "ops_per_axis": {"dp": ops, "tp": {}, "pp": {}},
        "peak_rss": peak_rss_bytes(),
        "memory": memory_stats(model, opt).as_dict(),
        "metrics": log.close(),
        "validation": stopper.history,
        "stopped_at": stopper.stopped_at,
    }


# ---- the parent -----------------------------------------------------------------------------------------------------
def run_demo(options: DemoOptions, run_dir: Path | None = None) -> DemoSummary:
    """Launch the ranks, print the summary table, write the run directory (`run_dir`, else a new
    <out>/<YYYYmmdd-HHMMSS>); return the summary."""
    config = GPTConfig.preset(options.preset)
    with torch.device("meta"):  # counts parameters without allocating or drawing them
        num_params = GPT(config).num_parameters()
    tokens_per_step = options.batch_size * config.seq_len * options.dp  # tp and pp ranks share their dp slice
    body: Any = train_rank
    over = f"{options.nproc} {options.backend} rank(s)"
    if options.uses_mesh:
        body = train_mesh_rank
        over = (f"dp {options.dp} x tp {options.tp} x pp {options.pp} = {over}, schedule {options.schedule} with "
                f"{options.microbatches} microbatches")
    if options.planned:
        print(f"--strategy auto: the planner chose {options.strategy}\n{options.planned}", flush=True)
    print(f"shardwise demo: GPT {options.preset!r} ({num_params / 1e6:.2f}M params), {options.strategy} over "
          f"{over}, {options.dp} x {options.batch_size} x {config.seq_len} = "
          f"{tokens_per_step:,} tokens/step, {options.steps} steps, lr {options.lr:g}", flush=True)
    threads = max(1, (os.cpu_count() or 1) // options.nproc)
    started = time.perf_counter()
    results = launch(body, options.nproc, options, backend=options.backend, threads_per_rank=threads,
                     timeout=COMM_TIMEOUT_S)
    wall = time.perf_counter() - started
    summary = _summarise(options, results, num_params, tokens_per_step, wall)
    if run_dir is None:
        run_dir = _make_run_dir(Path(options.out))
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
    summary.run_dir = str(run_dir)
    _write_outputs(run_dir, summary, results[0]["metrics"], options.label)
    print(format_summary(summary))
    print(f"run directory: {run_dir}")
    return summary


def _summarise(options: DemoOptions, results: list[dict[str, Any]], num_params: int, tokens_per_step: int,
               wall: float) -> DemoSummary:
    metrics = results[0]["metrics"]
    losses = [m["loss"] for m in metrics]
    step_ms = statistics.median(m["step_ms"] for m in metrics)
    grad_bytes = results[0]["grad_bytes"]
    measured = sorted({w for r in results for w in r["wire_bytes"]})
    formula: int | None = None
    match: bool | None = None
    estimate: int | None = None
    if not options.uses_mesh:
        formula = ring_all_reduce_bytes(grad_bytes, options.nproc)
        # DDP reduces bucket by bucket and CommStats rounds each bucket's 2(N-1)/N share down to a whole byte, so
        # with N not a power of two the sum may sit up to one byte per call below the formula.
        calls = max(r["all_reduce_calls"] for r in results)
        match = all(0 <= formula - w <= calls for w in measured)
    elif options.tp * options.pp == 1:  # purely data parallel: the strategy's own formula applies
        formula = wire_bytes_formula(options.strategy, grad_bytes, options.dp, options.dp_shard, options.microbatches)
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
    if options.tp * options.pp == 1:
        shards = options.dp_shard if options.strategy == "fsdp:hybrid_shard" else options.dp
        estimate = int(estimate_memory(num_params, estimate_key(options.strategy), shards,
                                       mixed_precision=False).total)
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
        formula=formula_text(options.strategy, options.microbatches or 1) if formula is not None else None,
        estimate_model_states=estimate,
        steps_run=len(losses),
        validation=results[0]["validation"],
        stopped_at=results[0]["stopped_at"],
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


def _write_outputs(run_dir: Path, summary: DemoSummary, metrics: list[dict[str, Any]], label: str) -> None:
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
    ax.set_ylabel("loss (nats/byte, mean over dp ranks)")
    ax.set_title(f"shardwise demo: {label}, GPT {summary.options['preset']}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=110)
    plt.close(fig)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def format_summary(s: DemoSummary) -> str:
    """The summary table the demo prints: the pure-DDP run's all-reduce against its formula, any other run's
    wire bytes per mesh axis."""
    measured = ", ".join(f"{w:,}" for w in s.wire_bytes_per_step)
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
    if not s.mesh_run:
        rows += [
            ("all-reduce wire bytes/step", f"measured {measured} per rank"),
            ("  formula 2(N-1)/N x grads", f"{s.formula_wire_bytes:,}  (grads {s.grad_bytes:,} B)  "
                                           f"{'MATCH' if s.wire_bytes_match else 'MISMATCH'}"),
        ]
    else:
        rows += axis_rows(s)
        if s.formula_wire_bytes is not None:
            steady = max(s.wire_bytes_per_step)
            rows.append((f"  formula {s.formula}", f"{s.formula_wire_bytes:,}  (G = grads {s.grad_bytes:,} B); "
                         f"measured/formula {steady / s.formula_wire_bytes:.3f}  "
                         f"{'MATCH' if s.wire_bytes_match else 'MISMATCH'}"))
    shared = s.options["backend"] == "thread"
    for r in s.ranks:
        m = r["memory"]
        rss = _mib(r["peak_rss"]) + (" (shared process)" if shared else "")
        where = f" (dp {r['coords']['dp']}, tp {r['coords']['tp']}, pp {r['coords']['pp']})" if s.mesh_run else ""
        against = (f" vs estimate {_mib(s.estimate_model_states)} ({m['model_states'] / s.estimate_model_states:.3f})"
                   if s.estimate_model_states else "")
        rows.append((f"rank {r['rank']}{where} memory", f"peak RSS {rss}; model states {_mib(m['model_states'])}"
                                                 f"{against} (params {_mib(m['params'])}, grads {_mib(m['grads'])}, "
                                                 f"optimizer {_mib(m['optimizer'])})"))
    rows.append(("wall time", f"{s.wall_s:.1f} s"))
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 60)
    return "\n".join([line, *(f"{k:<{width}}  {v}" for k, v in rows), line])

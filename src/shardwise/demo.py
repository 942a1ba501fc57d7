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

Any other configuration (a ZeRO / FSDP strategy, tp, pp, cp or ep > 1, a mixture of experts, any pipeline,
tensor-parallel or activation checkpointing option) runs `demo_hybrid.train_mesh_rank` instead: `sw.parallelize`
over `Mesh(comm, dp, cp=cp, ep=ep, tp=tp, pp=pp)`, its traffic measured per mesh axis (see that module). There is no
single textbook formula for a composed step, so only the purely data-parallel runs are checked against one.

With `experts=E` (default 2 x ep when ep > 1) every block's MLP is a mixture of E experts, `experts_per_token` of them
per token, built with `moe_aux_loss_coef=0`: sw.parallelize refuses a load-balancing loss, which its pipeline's
per-microbatch loss would leave out, so the demo's MoE trains on the language-model loss alone.

Rank 0 draws a tqdm bar and keeps the per-step metrics; every rank returns its peak RSS and `memory_stats`. The
parent (demo_report.py) prints a summary table and writes `<out>/<YYYYmmdd-HHMMSS>/` with `metrics.jsonl` (one line per step),
`summary.json` and `loss.png` (skipped, with a note, when matplotlib is missing).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from pathlib import Path
from typing import Any

import torch
from shardwise_cli import SCHEDULES  # the command line's vocabulary, spelled where it needs no torch

from .comm.base import Communicator, ReduceOp
from .ddp import DDP
from .demo_auto import choose_strategy
from .demo_hybrid import EarlyStop, StepLog, check_mesh_options, dp_size, lr_at, split_corpus, train_mesh_rank
from .demo_report import DemoSummary, format_summary, make_run_dir, ring_all_reduce_bytes, summarise, write_outputs
from .hybrid import DP_STRATEGIES
from .launch import launch
from .models.gpt import GPT, GPTConfig
from .planner.model_facts import model_facts
from .whole.memory import memory_stats, peak_rss_bytes

__all__ = ["STRATEGIES", "STRATEGY_ALIASES", "SCHEDULES", "DemoOptions", "DemoSummary", "StepLog", "run_demo", "train_rank",
           "lr_at", "ring_all_reduce_bytes", "format_summary"]

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

    nproc: number of ranks (None: dp x cp x tp x pp). strategy: one of STRATEGIES. steps: optimizer steps (about two
    minutes of the "small" preset on 2 cores, for DDP x2 and for dp2 x tp2 x pp2 on 8 thread ranks alike).
    data: corpus path for `ByteCorpus` (None: the Python standard library's sources).
    preset: `GPTConfig.preset` name. batch_size: sequences per dp rank per step (seq_len comes from the preset).
    lr: peak learning rate of AdamW. warmup: steps of linear warmup (None: 10% of steps, at most 50).
    seed: model init and data order. out: parent folder of the run directory.
    backend: "gloo" (processes) or "thread" (threads of this process); None: thread when tp, pp, cp or ep > 1, else
    gloo.
    progress: draw rank 0's tqdm bar.
    dp, tp, pp: the mesh (dp None: nproc // (cp x tp x pp), or 2 ranks of DDP when tp = pp = cp = 1 and nproc is
    None). cp: context-parallel ranks splitting each sequence (cp_method "ring" or "ulysses"); ep: expert-parallel
    ranks, borrowed from dp x cp (the world is dp x cp x tp x pp). experts: E experts per MoE block (None: 0, the
    dense GPT, with ep = 1, else 2 x ep); experts_per_token: k.
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
    cp: int = 1
    ep: int = 1
    experts: int | None = None
    experts_per_token: int = 2
    cp_method: str = "ring"

    def __post_init__(self) -> None:
        if self.strategy in STRATEGY_ALIASES:
            object.__setattr__(self, "strategy", STRATEGY_ALIASES[self.strategy])
        if self.memory_gb is not None and not (isinstance(self.memory_gb, (int, float)) and self.memory_gb > 0):
            raise ValueError(f"demo: memory_gb={self.memory_gb!r} must be a positive number of GB per rank")
        for name in ("cp", "ep", "experts_per_token"):
            _check_int(name, getattr(self, name))
        if self.experts is None:
            object.__setattr__(self, "experts", 0 if self.ep == 1 else 2 * self.ep)
        if isinstance(self.experts, bool) or not isinstance(self.experts, int) or self.experts < 0:
            raise ValueError(f"demo: experts={self.experts!r} must be an int >= 0 (0: the dense GPT)")
        if self.strategy == "auto":  # the planner chooses, once, before any rank starts (demo_auto)
            for name in ("tp", "pp"):
                _check_int(name, getattr(self, name))
            dp = dp_size(self.nproc, self.dp, self.tp, self.pp, cp=self.cp)
            if self.ep > 1:  # nothing to choose: sw.parallelize trains split experts with DDP only
                strategy, why = "ddp", (f"ep={self.ep}: the experts are split over ranks of the data-parallel "
                                        f"group, which only DDP composes with (ZeRO / FSDP do not shard experts)")
            else:
                strategy, why = choose_strategy(self.preset, dp * self.cp, self.tp, self.pp, self.memory_gb,
                                                config=self.gpt_config())
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
        resolve("dp", dp_size(self.nproc, self.dp, self.tp, self.pp, cp=self.cp))
        resolve("nproc", self.dp * self.cp * self.tp * self.pp)
        # Thread ranks for a model split over tp, pp, cp or ep: dp2 x tp2 x pp2 is 8 ranks, and 8 processes would
        # each load torch (about 0.4 GiB of RSS apiece) and spawn for seconds on 2 cores; threads share one process.
        resolve("backend", self.backend or ("thread" if self.tp * self.pp * self.cp * self.ep > 1 else "gloo"))
        if self.uses_mesh:
            resolve("microbatches", self.microbatches or 2 * self.pp)
            check_mesh_options(self)

    @property
    def uses_mesh(self) -> bool:
        """True unless this is the plain DDP run: DDP over dp only, with no pipeline or tensor-parallel option."""
        return (self.tp * self.pp * self.cp * self.ep > 1 or self.strategy != "ddp" or self.microbatches is not None
                or self.activation_checkpointing or self.sequence_parallel or self.dp_shard is not None
                or self.schedule != "1f1b" or self.virtual_stages != 1 or bool(self.experts)
                or self.cp_method != "ring")

    def gpt_config(self) -> GPTConfig:
        """The demo's GPT: the preset, with `experts` MoE experts per block when asked (moe_aux_loss_coef=0: see the
        module docstring)."""
        if not self.experts:
            return GPTConfig.preset(self.preset)
        return GPTConfig.preset(self.preset, n_experts=self.experts, experts_per_token=self.experts_per_token,
                                moe_aux_loss_coef=0.0)

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else min(50, max(1, self.steps // 10))

    @property
    def label(self) -> str:
        """A short name of the run: "ddp x2", or the strategy and mesh, e.g. "zero1 dp2 x tp2 x pp2"."""
        if not self.uses_mesh:
            return f"{self.strategy} x{self.nproc}"
        cp = f" x cp{self.cp}" if self.cp > 1 else ""
        ep = f", ep{self.ep}" if self.ep > 1 else ""
        return f"{self.strategy} dp{self.dp}{cp} x tp{self.tp} x pp{self.pp}{ep}"


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
    config = options.gpt_config()
    with torch.device("meta"):  # counts parameters without allocating or drawing them
        meta = GPT(config)
        num_params = meta.num_parameters()
        expert_params = model_facts(meta).expert_params
    tokens_per_step = options.batch_size * config.seq_len * options.dp  # tp, pp and cp ranks share their dp slice
    body: Any = train_mesh_rank if options.uses_mesh else train_rank
    over = f"{options.nproc} {options.backend} rank(s)"
    if options.uses_mesh:
        cp = f" x cp {options.cp}" if options.cp > 1 else ""
        ep = (f" (ep {options.ep} borrowed from dp{' x cp' if options.cp > 1 else ''}, "
              f"edp {options.dp * options.cp // options.ep})") if options.ep > 1 else ""
        method = f", {options.cp_method} attention" if options.cp > 1 else ""
        over = (f"dp {options.dp}{cp} x tp {options.tp} x pp {options.pp}{ep} = {over}, schedule {options.schedule} "
                f"with {options.microbatches} microbatches{method}")
    if options.experts:
        print(f"mixture of experts: {options.experts} experts per block, {options.experts_per_token} per token, "
              f"{expert_params / 1e6:.2f}M of the parameters in experts; moe_aux_loss_coef=0 (sw.parallelize "
              f"refuses a load-balancing loss, which its pipeline would leave out)", flush=True)
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
    summary = summarise(options, results, num_params, tokens_per_step, wall, expert_params=expert_params)
    if run_dir is None:
        run_dir = make_run_dir(Path(options.out))
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
    summary.run_dir = str(run_dir)
    write_outputs(run_dir, summary, results[0]["metrics"], options.label)
    print(format_summary(summary))
    print(f"run directory: {run_dir}")
    return summary



"""The options of one `shardwise demo` run (`DemoOptions`) and their checks: the strategy, the mesh, the pipeline and
mixture-of-experts settings, resolved once in the parent before any rank starts.

A run is *plain* or *mesh* (`DemoOptions.uses_mesh`). Plain: the world is the data-parallel group and nothing else
splits the model (tp = pp = cp = ep = 1, the dense GPT, no pipeline, tensor-parallel or checkpointing option); every
strategy, DDP, ZeRO-1/2/3 and FSDP alike, then wraps the whole model directly (plain_rank.py), one forward and one
backward per step: the loop a user writes. Mesh: anything else goes through `sw.parallelize` over a
`Mesh(comm, dp, cp, ep, tp, pp)` (mesh_rank.py). So two strategies that differ in nothing else always take the same
path: a comparison of ddp and zero3 over dp only measures the strategies, not a pipeline wrapped around one of them.

The command line (shardwise_cli) spells the same vocabulary without importing torch; tests/test_reliability_cli.py
checks that the two agree. This package never imports the command line.
"""

from __future__ import annotations

import dataclasses
import functools

from ..context_parallel import METHODS as CP_METHODS
from ..hybrid import DP_STRATEGIES
from ..models.gpt import GPTConfig
from ..pipeline.schedules import check_schedule_args
from .auto import choose_strategy

__all__ = ["DemoOptions", "STRATEGIES", "STRATEGY_ALIASES", "SCHEDULES", "AXES", "ALL_AXES", "demo_axes", "dp_size",
           "check_mesh_options"]

#: Data-parallel strategies the demo can train with (`sw.parallelize`'s dp_strategy values).
STRATEGIES = DP_STRATEGIES
#: Other names of a strategy the demo accepts (Lightning's "fsdp" is full sharding).
STRATEGY_ALIASES = {"fsdp": "fsdp:full_shard"}
#: Pipeline schedules the demo offers (zb_h1 is left out: parallelize allows it with DDP only).
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
AXES = ("dp", "tp", "pp")  # a 3-D run's axes (cp = ep = 1), in Mesh's rank order: tp fastest, then dp, pp
ALL_AXES = ("dp", "cp", "ep", "tp", "pp")  # every axis a run may report, in the order the summary shows them


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"demo: {name}={value!r} must be an int >= 1")


@dataclasses.dataclass(frozen=True)
class DemoOptions:
    """Everything one demo run needs; picklable, since gloo ranks receive it in a spawned process.

    nproc: number of ranks (None: dp x cp x tp x pp). strategy: one of STRATEGIES. steps: optimizer steps (DDP x2 of the
    "small" preset: 246 s on the 2-core development machine at load 6-8).
    data: corpus path for `ByteCorpus` (None: the Python standard library's sources).
    preset: `GPTConfig.preset` name. batch_size: sequences per dp rank per step (seq_len comes from the preset).
    lr: peak learning rate of AdamW. warmup: steps of linear warmup (None: 10% of steps, at most 50).
    seed: model init and data order. out: parent folder of the run directory.
    backend: "gloo" (processes) or "thread" (threads of this process); None: thread when tp, pp, cp or ep > 1, else
    gloo.
    progress: draw rank 0's tqdm bar.
    dp, tp, pp: the mesh (dp None: nproc // (cp x tp x pp), or 2 ranks when tp = pp = cp = 1 and nproc is None).
    cp: context-parallel ranks splitting each sequence (cp_method "ring" or "ulysses"); ep: expert-parallel
    ranks, borrowed from dp x cp (the world is dp x cp x tp x pp). experts: E experts per MoE block (None: 0, the
    dense GPT, with ep = 1, else 2 x ep); experts_per_token: k.
    dp_shard: shard-group size within dp for strategy "fsdp:hybrid_shard" (required there, refused elsewhere).
    schedule: pipeline schedule (SCHEDULES); virtual_stages: stages per pp rank (interleaved_1f1b needs >= 2).
    microbatches: per step (None: 2 x pp on a mesh run; a plain run has no pipeline and runs the whole batch at
    once); must divide batch_size. sequence_parallel: needs tp > 1.
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
        if self.strategy == "auto":  # the planner chooses, once, before any rank starts (auto.py)
            for name in ("tp", "pp"):
                _check_int(name, getattr(self, name))
            dp = dp_size(self.nproc, self.dp, self.tp, self.pp, cp=self.cp)
            if self.ep > 1:  # the demo's planner compares whole-model data parallel, not split experts
                strategy, why = "ddp", (f"ep={self.ep}: --strategy auto compares data-parallel strategies over "
                                        f"whole models, not experts split over ep; the demo keeps DDP (name "
                                        f"zero1/2/3 or fsdp:full_shard / shard_grad_op to shard the states)")
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
        """True when the run needs sw.parallelize: a mesh axis other than dp, a mixture of experts, or any pipeline,
        tensor-parallel or checkpointing option. False for every strategy over dp alone (the module docstring)."""
        return (self.tp * self.pp * self.cp * self.ep > 1 or self.microbatches is not None
                or self.activation_checkpointing or self.sequence_parallel
                or self.schedule != "1f1b" or self.virtual_stages != 1 or bool(self.experts)
                or self.cp_method != "ring")

    def gpt_config(self) -> GPTConfig:
        """The demo's GPT: the preset, with `experts` MoE experts per block when asked (moe_aux_loss_coef=0: the
        load-balancing loss is a function of the whole batch, which sw.parallelize computes per microbatch when the
        demo's microbatches, 2 x pp per step by default, split it)."""
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


def demo_axes(options: DemoOptions) -> tuple[str, ...]:
    """The axes a run reports: dp, tp and pp always; cp and ep when they are > 1."""
    return tuple(a for a in ALL_AXES if a in AXES or getattr(options, a) > 1)


def dp_size(nproc: int | None, dp: int | None, tp: int, pp: int, *, cp: int = 1) -> int:
    """The dp size of a demo run: dp itself, else nproc // (cp x tp x pp), else 1 with tp, pp or cp > 1 (2, the
    2-rank data-parallel run, without); raises ValueError naming the numbers when nproc is given and is not
    dp x cp x tp x pp."""
    names = "cp x tp x pp" if cp > 1 else "tp x pp"
    sizes = (cp, tp, pp) if cp > 1 else (tp, pp)
    rest = cp * tp * pp
    if dp is None:
        if nproc is None:
            dp = 1 if rest > 1 else 2
        elif nproc % rest:
            raise ValueError(f"demo: nproc={nproc} is not a multiple of {names} = {' x '.join(map(str, sizes))} = "
                             f"{rest}")
        else:
            dp = nproc // rest
    if nproc is not None and nproc != dp * rest:
        raise ValueError(f"demo: dp x {names} = {' x '.join(map(str, (dp, *sizes)))} = {dp * rest} ranks, but "
                         f"nproc={nproc}; nproc must be their product (or leave it out)")
    return dp


def check_mesh_options(options: DemoOptions) -> None:
    """Raise ValueError, with the numbers to fix, for what the strategy or `parallelize` would refuse on every rank
    at once."""
    if options.strategy == "fsdp:hybrid_shard":
        if options.dp_shard is None or options.dp % options.dp_shard:
            raise ValueError(f"demo: strategy='fsdp:hybrid_shard' needs dp_shard, a divisor of dp={options.dp}; "
                             f"got dp_shard={options.dp_shard}")
    elif options.dp_shard is not None:
        raise ValueError(f"demo: dp_shard={options.dp_shard} only applies to strategy='fsdp:hybrid_shard'")
    if not options.uses_mesh:
        return
    config = GPTConfig.preset(options.preset)
    _check_five_axes(options, config)
    if config.n_heads % options.tp:
        raise ValueError(f"demo: tp={options.tp} must divide the {options.preset!r} preset's n_heads={config.n_heads}")
    layers = config.n_layers + 2  # GPT.pipeline_layers(): the embedding, each block, the head
    if options.pp * options.virtual_stages > layers:
        raise ValueError(f"demo: pp x virtual_stages = {options.pp} x {options.virtual_stages} stages, but the "
                         f"{options.preset!r} preset has {layers} pipeline layers")
    if options.sequence_parallel and options.tp == 1:
        raise ValueError("demo: sequence_parallel needs tp > 1")
    if options.batch_size % options.microbatches:
        raise ValueError(f"demo: batch_size={options.batch_size} (sequences per dp rank) does not split into "
                         f"microbatches={options.microbatches}; use a batch size that is a multiple of it")
    check_schedule_args("demo", options.schedule, options.pp, options.microbatches, options.virtual_stages)


def _check_five_axes(options: DemoOptions, config: GPTConfig) -> None:
    """The context-, expert-parallel and mixture-of-experts options (docs/hybrid.md, "Five axes")."""
    cp, ep, experts, k = options.cp, options.ep, options.experts, options.experts_per_token
    if options.cp_method not in CP_METHODS:
        raise ValueError(f"demo: cp_method={options.cp_method!r} is not supported; allowed {CP_METHODS}")
    if cp > 1 and config.seq_len % (2 * cp):
        raise ValueError(f"demo: cp={cp} splits each sequence into 2 x cp = {2 * cp} zigzag chunks, but the "
                         f"{options.preset!r} preset's seq_len={config.seq_len} is not a multiple of it")
    if cp > 1 and options.cp_method == "ulysses" and (config.n_heads // options.tp) % cp:
        raise ValueError(f"demo: cp_method='ulysses' needs cp={cp} to divide the {options.preset!r} preset's "
                         f"n_heads={config.n_heads} / tp={options.tp} (the heads of each tensor-parallel rank); use "
                         f"cp_method='ring'")
    if experts and k > experts:
        raise ValueError(f"demo: experts_per_token={k} must be at most experts={experts}")
    if ep > 1:
        if not experts:
            raise ValueError(f"demo: ep={ep} splits the experts of a mixture of experts; give experts > 0")
        if experts % ep:
            raise ValueError(f"demo: ep={ep} must divide experts={experts}")
        if (options.dp * cp) % ep:
            raise ValueError(f"demo: ep={ep} must divide dp x cp = {options.dp} x {cp} = {options.dp * cp} (expert "
                             f"parallel borrows its ranks from the data- and context-parallel ones)")
        if options.strategy == "fsdp:hybrid_shard":
            raise ValueError(f"demo: ep={ep} with strategy='fsdp:hybrid_shard' is not supported (its shard groups "
                             f"cut across the ranks holding the same experts, edp); use ddp, zero1, zero2, zero3, "
                             f"fsdp:full_shard or fsdp:shard_grad_op")

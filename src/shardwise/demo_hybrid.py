"""The demo's rank body for any mesh and data-parallel strategy: `sw.parallelize` over `Mesh(comm, dp, cp=, ep=, tp=,
pp=)`.

Also here, so that demo.py imports this module and never the other way round: the options checks a mesh run
needs, the summary rows per axis, and the loop bookkeeping both rank bodies share (`lr_at`, `StepLog`).

Mechanism
---------
Every rank builds the same `GPT(GPTConfig.preset(preset), seed=seed)`, lays the world out as `Mesh(comm, dp, tp,
pp)` (tp fastest, then dp, then pp) and hands both to `parallelize`: tensor parallel over `mesh.tp` (the "gpt" plan,
sequence parallel if asked), the pipeline split over `mesh.pp` with the chosen schedule, activation checkpointing,
then the data-parallel strategy (DDP, ZeRO-1/2/3, FSDP) over `mesh.dp`. Rank 0 prints `model.describe()` first.
With cp > 1 the attention is context-parallel over `mesh.cp` (ring or Ulysses) and dense gradients average over
dp x cp (`mesh.dp_cp`); with ep > 1 the MoE GPT's experts are split over `mesh.ep` and their gradients average over
`mesh.edp` (docs/hybrid.md, "Five axes").

Each step, a rank feeds its dp slice of the global batch (`ShardedSampler` with rank = mesh.coords.dp and
world_size = dp: tp and pp peers read the same rows), and runs `model.step(x, y)` (every microbatch's forward and
backward, the dp reduction once), `clip_grad_norm_` (the global norm over dp, tp and pp) and the AdamW step. The
traffic of that block is counted per mesh axis (`stats.measure()` of the axis's communicators, nested): dp carries
gradient reductions and ZeRO / FSDP parameter gathers, tp the activations and their gradients inside the split
layers, pp the activations and gradients between stages (counted on the sender) and the tied embedding's
gradient; clipping adds a 4-byte all-reduce on each. The loss `step` returns is its dp group's mean; the logged
loss is its AVG over `mesh.dp`, all-reduced after the measured block so that it does not count as training traffic.

An axis's traffic does not all go through `mesh.dp`, `mesh.tp` or `mesh.pp` themselves: FSDP hybrid_shard
reduces and gathers over shard and replicate groups split from dp (one pair per stage), and a pipeline of more
than two ranks sums its tied embedding over a group split from pp. `CommStats` counts per Communicator, so
`axis_groups` collects every group the model declares (shardwise.layout: its strategies' communicators and its
placements' groups), puts each on the one axis along which its ranks' coordinates vary, and the step is measured
on all of them (`CommStats.merge` sums an axis).

Five axes. A run with cp or ep > 1 reports those axes too (`demo_axes`; a 3-D run keeps dp, tp, pp only). The
mesh's own groups are placed by identity: cp carries the ring's K/V blocks (or Ulysses' all-to-alls) and the loss
average over the sequence's chunks, ep the experts' all-to-alls; the data-parallel reductions stay on dp whichever
group carries them (`mesh.dp`, `mesh.dp_cp` for dense gradients under cp, `mesh.edp` for the experts' gradients,
and the MoE routing statistics, summed over dp x cp). Any other declared group whose ranks differ in dp or cp only
is data-parallel too (FSDP hybrid_shard's groups split from dp x cp). The ep group's ranks can differ in cp only
(ep <= cp), so coordinates alone could not tell it from a cp group: identity does.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import layout
from .comm.base import Communicator, CommStats, ReduceOp
from .consensus import agree
from .context_parallel import METHODS as CP_METHODS
from .hybrid import parallelize
from .mesh import Mesh
from .models.gpt import GPT, GPTConfig, lm_loss
from .pipeline.schedules import check_schedule_args
from .whole.clip import clip_grad_norm_
from .whole.memory import memory_stats, peak_rss_bytes

if TYPE_CHECKING:
    from .demo import DemoOptions, DemoSummary

__all__ = ["train_mesh_rank", "axis_groups", "demo_axes", "dp_size", "check_mesh_options", "mesh_fields", "axis_rows",
           "lr_at",
           "StepLog", "EarlyStop", "split_corpus"]

AXES = ("dp", "tp", "pp")  # a 3-D run's axes (cp = ep = 1), in Mesh's rank order: tp fastest, then dp, pp
ALL_AXES = ("dp", "cp", "ep", "tp", "pp")  # every axis a run may report, in the order the summary shows them


def demo_axes(options: DemoOptions) -> tuple[str, ...]:
    """The axes a run reports: dp, tp and pp always; cp and ep when they are > 1."""
    return tuple(a for a in ALL_AXES if a in AXES or getattr(options, a) > 1)


def dp_size(nproc: int | None, dp: int | None, tp: int, pp: int, *, cp: int = 1) -> int:
    """The dp size of a demo run: dp itself, else nproc // (cp x tp x pp), else 1 with tp, pp or cp > 1 (2, the
    2-rank DDP run, without); raises ValueError naming the numbers when nproc is given and is not dp x cp x tp x
    pp."""
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
    """Raise ValueError, with the numbers to fix, for what `parallelize` would refuse on every rank at once."""
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
    if options.strategy == "fsdp:hybrid_shard":
        if options.dp_shard is None or options.dp % options.dp_shard:
            raise ValueError(f"demo: strategy='fsdp:hybrid_shard' needs dp_shard, a divisor of dp={options.dp}; "
                             f"got dp_shard={options.dp_shard}")
    elif options.dp_shard is not None:
        raise ValueError(f"demo: dp_shard={options.dp_shard} only applies to strategy='fsdp:hybrid_shard'")
    if options.batch_size % options.microbatches:
        raise ValueError(f"demo: batch_size={options.batch_size} (sequences per dp rank) does not split into "
                         f"microbatches={options.microbatches}; use a batch size that is a multiple of it")
    check_schedule_args("demo", options.schedule, options.pp, options.microbatches, options.virtual_stages)


def _check_five_axes(options: DemoOptions, config: GPTConfig) -> None:
    """The context-, expert-parallel and mixture-of-experts options (docs/hybrid.md, "Five axes")."""
    cp, ep, experts, k = options.cp, options.ep, options.experts, options.experts_per_token
    if options.cp_method not in CP_METHODS:
        raise ValueError(f"demo: cp_method={options.cp_method!r} is not supported; allowed {CP_METHODS}")
    if cp > 1 and options.tp > 1:
        raise ValueError(f"demo: cp={cp} with tp={options.tp} is not supported (sw.parallelize's context-parallel "
                         f"attention runs on whole heads); use cp with dp and pp")
    if cp > 1 and config.seq_len % (2 * cp):
        raise ValueError(f"demo: cp={cp} splits each sequence into 2 x cp = {2 * cp} zigzag chunks, but the "
                         f"{options.preset!r} preset's seq_len={config.seq_len} is not a multiple of it")
    if cp > 1 and options.cp_method == "ulysses" and config.n_heads % cp:
        raise ValueError(f"demo: cp_method='ulysses' needs cp={cp} to divide the {options.preset!r} preset's "
                         f"n_heads={config.n_heads}; use cp_method='ring'")
    if experts and options.tp > 1:
        raise ValueError(f"demo: experts={experts} with tp={options.tp}: tensor parallel does not split experts (the "
                         f"'gpt' plan refuses a mixture of experts); use tp=1")
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
        if options.strategy != "ddp":
            raise ValueError(f"demo: ep={ep} needs strategy='ddp' (ZeRO / FSDP do not shard experts); got "
                             f"strategy={options.strategy!r}")


# ---- the loop bookkeeping both rank bodies share (demo.train_rank and train_mesh_rank) --------------------------
def lr_at(step: int, options: DemoOptions) -> float:
    """Linear warmup to `lr` over the warmup steps, then cosine decay to lr / 10 at the last step."""
    warmup = options.warmup_steps
    if step < warmup:
        return options.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, options.steps - 1 - warmup)
    return options.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


class StepLog:
    """The bookkeeping every rank body shares: it sets each step's learning rate (`lr_at`); rank 0 also keeps one
    metrics record per step and draws the tqdm bar (when options.progress); close() returns rank 0's records."""

    def __init__(self, options: DemoOptions, rank: int, tokens_per_step: int) -> None:
        self.options, self.lead, self.tokens_per_step = options, rank == 0, tokens_per_step
        self.metrics: list[dict[str, Any]] = []
        self.bar = None
        if self.lead and options.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=options.steps, desc=options.label, unit="step", file=sys.stderr,
                            dynamic_ncols=True)

    def set_lr(self, opt: torch.optim.Optimizer, step: int) -> float:
        lr = lr_at(step, self.options)
        for group in opt.param_groups:
            group["lr"] = lr
        return lr

    def record(self, step: int, loss: float, lr: float, seconds: float, **wire: int) -> None:
        """Rank 0 keeps {step, loss, lr, step_ms, tokens_per_s, **wire} and advances its bar."""
        if not self.lead:
            return
        record = {"step": step, "loss": loss, "lr": lr, "step_ms": seconds * 1e3,
                  "tokens_per_s": self.tokens_per_step / seconds, **wire}
        self.metrics.append(record)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}")
            self.bar.update(1)

    def close(self) -> list[dict[str, Any]] | None:
        if self.bar is not None:
            self.bar.close()
        return self.metrics if self.lead else None


#: The share of the corpus held out for validation when early stopping is on (its last bytes).
VALIDATION_FRACTION = 0.1


def split_corpus(corpus: Any, options: DemoOptions) -> tuple[Any, Any]:
    """(train, validation): without early stopping the whole corpus and None; with it, the first 90% to train on
    and the last 10% held out (copies of the corpus whose `tokens` are the two slices), so validation windows
    never overlap training ones."""
    if options.early_stop is None:
        return corpus, None
    import copy

    cut = int(len(corpus) * (1 - VALIDATION_FRACTION))
    train, held = copy.copy(corpus), copy.copy(corpus)
    train.tokens, held.tokens = corpus.tokens[:cut], corpus.tokens[cut:]
    return train, held


class EarlyStop:
    """Patience on a validation loss, decided by every rank together.

    Every `options.eval_every` steps the model is evaluated (eval mode, no gradients) on the same
    `options.eval_batches` held-out batches (this dp rank's rows of each), the mean is averaged over the dp group
    (`dp_comm`), and an evaluation that does not beat the best so far by more than `min_delta` counts as bad;
    after `options.early_stop` bad evaluations in a row the rank votes to stop. The vote goes through
    `sw.agree(..., comm, how="all")` over the world: every rank leaves the loop at the same step (a rank that
    stopped alone would leave its peers waiting in their next collective), and `history` keeps [step, loss].
    `evaluate(x, y)` returns the loss of one batch (the plain model's forward, or the 3-D model's predict + loss).
    """

    def __init__(self, options: DemoOptions, held: Any, comm: Communicator, dp_comm: Communicator, dp_rank: int,
                 seq_len: int, evaluate: Any) -> None:
        self.options, self.comm, self.dp_comm, self.evaluate = options, comm, dp_comm, evaluate
        self.batches = [held.batch(i, options.batch_size, seq_len, seed=options.seed, rank=dp_rank,
                                   world_size=options.dp) for i in range(options.eval_batches)] if held else []
        self.best = math.inf
        self.bad = 0
        self.history: list[list[float]] = []
        self.stopped_at: int | None = None

    @torch.no_grad()
    def validation_loss(self, model: nn.Module) -> float:
        model.eval()
        try:
            total = torch.stack([self.evaluate(x, y).detach().float() for x, y in self.batches]).mean().reshape(1)
        finally:
            model.train()
        self.dp_comm.all_reduce(total, ReduceOp.AVG)
        return float(total.item())

    def should_stop(self, step: int, model: nn.Module) -> bool:
        """After step `step`: evaluate when due, and return True (on every rank alike) when patience ran out."""
        patience = self.options.early_stop
        if patience is None or (step + 1) % self.options.eval_every:
            return False
        loss = self.validation_loss(model)
        self.history.append([step, loss])
        if loss < self.best - self.options.min_delta:
            self.best, self.bad = loss, 0
        else:
            self.bad += 1
        if agree(self.bad >= patience, self.comm, how="all"):
            self.stopped_at = step
            return True
        return False


# ---- the mesh rank body ---------------------------------------------------------------------------------------------
def axis_groups(model: nn.Module, mesh: Mesh, axes: tuple[str, ...] = AXES) -> dict[str, list[Communicator]]:
    """Per reported axis, the communicators (each once) that carry its traffic: the mesh's own groups, placed by
    identity, and the groups split from them that `model` declares, placed by the coordinates that vary among
    their ranks (see the module docstring). A group spanning several axes (other than dp and cp) is counted on
    none; parallelize makes none."""
    own = [(mesh.dp, "dp"), (mesh.dp_cp, "dp"), (mesh.edp, "dp"), (mesh.cp, "cp"), (mesh.ep, "ep"),
           (mesh.tp, "tp"), (mesh.pp, "pp")]
    found: list[Communicator | None] = []
    for record in layout.strategies(model):
        found += [*layout.record_comms(record), record.partitioned_over]
    for pl in layout.placements(model).values():
        found += [pl.box_group, pl.flat_group, *pl.replicated_over, pl.partial_grad_over, pl.tied_over]
    s = mesh.sizes
    dp, cp, tp = s["dp"], s["cp"], s["tp"]
    groups: dict[str, list[Communicator]] = {a: [] for a in axes}
    seen: set[int] = set()

    def place(comm: Communicator, axis: str | None) -> None:
        seen.add(id(comm))
        if axis in groups:
            groups[axis].append(comm)

    for comm, axis in own:
        if comm.size > 1 and id(comm) not in seen:
            place(comm, axis)
    for comm in found:
        if comm is None or comm.size == 1 or id(comm) in seen:
            continue
        coords = [{"dp": (r // (tp * cp)) % dp, "cp": (r // tp) % cp, "tp": r % tp, "pp": r // (tp * cp * dp)}
                  for r in comm.global_ranks]  # Mesh's rank order: tp fastest, then cp, dp, pp
        varying = {a for a in ("dp", "cp", "tp", "pp") if len({c[a] for c in coords}) > 1}
        if varying <= {"dp", "cp"}:  # a group split from the data-parallel ranks (module docstring)
            place(comm, "dp")
        elif len(varying) == 1:
            place(comm, varying.pop())
    return groups


def train_mesh_rank(comm: Communicator, options: DemoOptions) -> dict[str, Any]:
    """Body of one rank (see the module docstring); returns what `demo_report.summarise` reads, metrics on rank 0."""
    from .data import ByteCorpus, ShardedSampler  # the corpus is read inside each rank, not pickled over

    config = options.gpt_config()
    axes = demo_axes(options)
    mesh = Mesh(comm, dp=options.dp, cp=options.cp, ep=options.ep, tp=options.tp, pp=options.pp)
    model = GPT(config, seed=options.seed)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    model = parallelize(model, mesh, tp_plan="gpt" if options.tp > 1 else None,
                        sequence_parallel=options.sequence_parallel, pp_schedule=options.schedule,
                        n_microbatches=options.microbatches, dp_strategy=options.strategy, dp_shard=options.dp_shard,
                        virtual_stages=options.virtual_stages,
                        activation_checkpointing=options.activation_checkpointing, cp_method=options.cp_method)
    if comm.rank == 0:
        print(model.describe(), flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=0.01)
    corpus, held = split_corpus(ByteCorpus(options.data), options)
    sampler = ShardedSampler(corpus, options.batch_size, config.seq_len, rank=mesh.coords.dp,
                             world_size=options.dp, seed=options.seed)
    stopper = EarlyStop(options, held, comm, mesh.dp, mesh.coords.dp, config.seq_len,
                        lambda x, y: lm_loss(model.predict(x), y))
    groups = axis_groups(model, mesh, axes)
    log = StepLog(options, comm.rank, options.batch_size * config.seq_len * options.dp)
    wire: list[int] = []
    per_axis: dict[str, list[int]] = {a: [] for a in axes}
    ops: dict[str, dict[str, dict[str, int]]] = {}
    held: dict[str, int] = {}
    for step in range(options.steps):
        lr = log.set_lr(opt, step)
        start = time.perf_counter()
        x, y = next(sampler)
        with contextlib.ExitStack() as stack:
            counted = {a: [stack.enter_context(c.stats.measure()) for c in groups[a]] for a in axes}
            loss = model.step(x, y)
            clip_grad_norm_(model, 1.0)
            opt.step()
            if step == 0:  # model states are at their peak now (gradients and optimizer state both held)
                held = memory_stats(model, opt).as_dict()
            opt.zero_grad()
        global_loss = loss.detach().clone()
        mesh.dp.all_reduce(global_loss, ReduceOp.AVG)
        seconds = time.perf_counter() - start
        totals = {a: functools.reduce(CommStats.merge, counted[a], CommStats()) for a in axes}
        ops = {a: totals[a].as_dict() for a in axes}
        for axis in axes:
            per_axis[axis].append(totals[axis].wire_bytes())
        wire.append(sum(per_axis[a][-1] for a in axes))
        log.record(step, global_loss.item(), lr, seconds, wire_bytes=wire[-1],
                   **{f"wire_bytes_{a}": per_axis[a][-1] for a in axes})
        if stopper.should_stop(step, model):
            break
    return {
        "rank": comm.rank,
        "coords": {a: getattr(mesh.coords, a) for a in axes},
        "grad_bytes": grad_bytes,
        "wire_bytes": wire,
        "wire_bytes_per_axis": per_axis,
        "ops_per_axis": ops,
        "peak_rss": peak_rss_bytes(),
        "memory": {**held, "peak_rss": peak_rss_bytes()},
        "metrics": log.close(),
        "validation": stopper.history,
        "stopped_at": stopper.stopped_at,
    }


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

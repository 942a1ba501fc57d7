"""One rank of a mesh demo run: `sw.parallelize` over `Mesh(comm, dp, cp=, ep=, tp=, pp=)` (options.py says which runs
take this path: any axis but dp, a mixture of experts, or a pipeline, tensor-parallel or checkpointing option).

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

`MeshRun` is one such run on one rank, stepped from outside (`step()` until `done`, then `result()`), as
plain_rank.PlainRun is, so that `demo --compare` alternates mesh runs the same way (compare.py).
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import Any

import torch
from torch import nn

from .. import layout
from ..comm.base import Communicator, CommStats, ReduceOp
from ..hybrid import parallelize
from ..mesh import Mesh
from ..models.gpt import GPT, lm_loss
from ..whole.clip import clip_grad_norm_
from ..whole.memory import memory_stats, peak_rss_bytes
from .loop import EarlyStop, StepLog, split_corpus
from .options import AXES, DemoOptions, demo_axes

__all__ = ["MeshRun", "axis_groups"]


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

class MeshRun:
    """One rank of a mesh run (module docstring): build in __init__, `step()` until `done`, then `result()`."""

    def __init__(self, comm: Communicator, options: DemoOptions) -> None:
        from ..data import ByteCorpus, ShardedSampler  # the corpus is read inside each rank, not pickled over

        self.comm, self.options = comm, options
        config = options.gpt_config()
        self.axes = demo_axes(options)
        self.mesh = mesh = Mesh(comm, dp=options.dp, cp=options.cp, ep=options.ep, tp=options.tp, pp=options.pp)
        model = GPT(config, seed=options.seed)
        self.grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self.model = model = parallelize(
            model, mesh, tp_plan="gpt" if options.tp > 1 else None, sequence_parallel=options.sequence_parallel,
            pp_schedule=options.schedule, n_microbatches=options.microbatches, dp_strategy=options.strategy,
            dp_shard=options.dp_shard, virtual_stages=options.virtual_stages,
            activation_checkpointing=options.activation_checkpointing, cp_method=options.cp_method)
        if comm.rank == 0:
            print(model.describe(), flush=True)
        self.opt = torch.optim.AdamW(model.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=0.01)
        corpus, held = split_corpus(ByteCorpus(options.data), options)
        self.sampler = ShardedSampler(corpus, options.batch_size, config.seq_len, rank=mesh.coords.dp,
                                      world_size=options.dp, seed=options.seed)
        self.stopper = EarlyStop(options, held, comm, mesh.dp, mesh.coords.dp, config.seq_len,
                                 lambda x, y: lm_loss(model.predict(x), y))
        self.groups = axis_groups(model, mesh, self.axes)
        self.log = StepLog(options, comm.rank, options.batch_size * config.seq_len * options.dp)
        self.wire: list[int] = []
        self.per_axis: dict[str, list[int]] = {a: [] for a in self.axes}
        self.ops: dict[str, dict[str, dict[str, int]]] = {}
        self.held: dict[str, int] = {}
        self.step_index = 0
        self.done = False

    def step(self) -> None:
        """One optimizer step (module docstring); sets `done` after the last step or an early stop."""
        step, model, opt, axes = self.step_index, self.model, self.opt, self.axes
        lr = self.log.set_lr(opt, step)
        start = time.perf_counter()
        x, y = next(self.sampler)
        with contextlib.ExitStack() as stack:
            counted = {a: [stack.enter_context(c.stats.measure()) for c in self.groups[a]] for a in axes}
            loss = model.step(x, y)
            clip_grad_norm_(model, 1.0)
            opt.step()
            if step == 0:  # model states are at their peak now (gradients and optimizer state both held)
                self.held = memory_stats(model, opt).as_dict()
            opt.zero_grad()
        global_loss = loss.detach().clone()
        self.mesh.dp.all_reduce(global_loss, ReduceOp.AVG)
        seconds = time.perf_counter() - start
        totals = {a: functools.reduce(CommStats.merge, counted[a], CommStats()) for a in axes}
        self.ops = {a: totals[a].as_dict() for a in axes}
        for axis in axes:
            self.per_axis[axis].append(totals[axis].wire_bytes())
        self.wire.append(sum(self.per_axis[a][-1] for a in axes))
        self.log.record(step, global_loss.item(), lr, seconds, wire_bytes=self.wire[-1],
                        **{f"wire_bytes_{a}": self.per_axis[a][-1] for a in axes})
        self.step_index += 1
        self.done = self.stopper.should_stop(step, model) or self.step_index == self.options.steps

    def result(self) -> dict[str, Any]:
        """What report.summarise reads; metrics on rank 0."""
        return {
            "rank": self.comm.rank,
            "coords": {a: getattr(self.mesh.coords, a) for a in self.axes},
            "grad_bytes": self.grad_bytes,
            "wire_bytes": self.wire,
            "wire_bytes_per_axis": self.per_axis,
            "ops_per_axis": self.ops,
            "peak_rss": peak_rss_bytes(),
            "memory": {**self.held, "peak_rss": peak_rss_bytes()},
            "metrics": self.log.close(),
            "validation": self.stopper.history,
            "stopped_at": self.stopper.stopped_at,
        }

"""One rank of a plain demo run: a data-parallel strategy wrapping the whole GPT over the world (options.py says which
runs are plain).

Mechanism
---------
Every rank builds the same `GPT(GPTConfig.preset(preset), seed=seed)` and wraps it with the strategy exactly as a
user would: `sw.DDP(model, comm)`, `sw.ZeRO(model, comm, stage=k)` or `sw.FSDP(model, comm, sharding=...)` (with
`shard_size=dp_shard` for hybrid_shard). It then runs a plain AdamW loop over its rows of the global batch
(`ShardedSampler`: `batch_size` rows per rank, so a step sees `batch_size * nproc` sequences): forward and backward of
the whole batch at once, `sw.clip_grad_norm_` (the global norm, whichever way the gradients are sharded), the
optimizer step and zero_grad. The learning rate warms up linearly, then decays along a cosine to a tenth of its peak
(loop.lr_at).

Traffic. The step is measured (`CommStats.measure()`) on every communicator the wrapped model declares
(shardwise.layout: the strategy's groups, e.g. hybrid_shard's shard and replicate groups split from the world), all
counted on the dp axis. The clip's 4-byte norm all-reduce is measured apart and left out, so that the step's bytes
are the strategy's own: DDP's ring all-reduce of every gradient byte, 2(N-1)/N x grad_bytes per rank (Li et al.,
VLDB 2020), ZeRO-3's extra parameter gathers (Rajbhandari et al., SC 2020), which report.py checks against their
formulas. The GPT ties its embedding and output matrices; that shared Parameter has one gradient and is reduced once,
so grad_bytes counts unique parameters. The logged loss is the global one: each rank's loss is all-reduced (AVG)
after the measured block.

`PlainRun` is one such run on one rank, stepped from outside (`step()` until `done`, then `result()`), so that
`demo --compare` can alternate several runs in the same processes (compare.py); run.train_rank steps one alone.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from torch import nn

from .. import layout
from ..comm.base import Communicator, ReduceOp
from ..ddp import DDP
from ..models.gpt import GPT
from ..sharding import FSDP, ZeRO
from ..whole.clip import clip_grad_norm_
from ..whole.memory import memory_stats, peak_rss_bytes
from .loop import EarlyStop, StepLog, split_corpus
from .options import DemoOptions

__all__ = ["PlainRun", "wrap_data_parallel", "declared_groups"]


def wrap_data_parallel(model: nn.Module, comm: Communicator, strategy: str, dp_shard: int | None) -> nn.Module:
    """`model` wrapped with `strategy` (a DemoOptions strategy) over `comm`, with the strategy's defaults."""
    if strategy == "ddp":
        return DDP(model, comm)
    if strategy.startswith("zero"):
        return ZeRO(model, comm, stage=int(strategy[-1]))
    sharding = strategy.split(":", 1)[1]
    return FSDP(model, comm, sharding=sharding, shard_size=dp_shard if sharding == "hybrid_shard" else None)


def declared_groups(model: nn.Module, comm: Communicator) -> list[Communicator]:
    """`comm` and every other communicator of more than one rank that `model` declares (its strategies' and its
    placements' groups), each once: where a data-parallel strategy's traffic goes."""
    found: list[Communicator | None] = [comm]
    for record in layout.strategies(model):
        found += [*layout.record_comms(record), record.partitioned_over]
    for pl in layout.placements(model).values():
        found += [pl.box_group, pl.flat_group, *pl.replicated_over, pl.partial_grad_over, pl.tied_over]
    groups: dict[int, Communicator] = {}
    for c in found:
        if c is not None and c.size > 1:
            groups.setdefault(id(c), c)
    return list(groups.values())


class PlainRun:
    """One rank of a plain run (module docstring): build in __init__, `step()` until `done`, then `result()`."""

    def __init__(self, comm: Communicator, options: DemoOptions) -> None:
        from ..data import ByteCorpus, ShardedSampler  # the corpus is read inside each rank, not pickled over

        self.comm, self.options = comm, options
        config = options.gpt_config()
        model = GPT(config, seed=options.seed)
        self.grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        self.model = wrap_data_parallel(model, comm, options.strategy, options.dp_shard)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=0.01)
        corpus, held = split_corpus(ByteCorpus(options.data), options)
        self.sampler = ShardedSampler(corpus, options.batch_size, config.seq_len, rank=comm.rank,
                                      world_size=comm.size, seed=options.seed)
        self.stopper = EarlyStop(options, held, comm, comm, comm.rank, config.seq_len, lambda x, y: self.model(x, y))
        self.log = StepLog(options, comm.rank, options.batch_size * config.seq_len * comm.size)
        self.groups = declared_groups(self.model, comm)
        self.wire: list[int] = []
        self.calls = 0
        self.ops: dict[str, dict[str, int]] = {}
        self.held: dict[str, int] = {}
        self.step_index = 0
        self.done = False

    def step(self) -> None:
        """One optimizer step (module docstring); sets `done` after the last step or an early stop."""
        step, model, opt = self.step_index, self.model, self.opt
        lr = self.log.set_lr(opt, step)
        start = time.perf_counter()
        x, y = next(self.sampler)
        with contextlib.ExitStack() as stack:
            counted = [stack.enter_context(c.stats.measure()) for c in self.groups]
            loss = model(x, y)
            loss.backward()
            with contextlib.ExitStack() as clip_stack:
                clipping = [clip_stack.enter_context(c.stats.measure()) for c in self.groups]
                clip_grad_norm_(model, 1.0)
            opt.step()
            if step == 0:  # model states are at their peak now (gradients and optimizer state both held)
                self.held = memory_stats(model, opt).as_dict()
            opt.zero_grad()
        global_loss = loss.detach().clone()
        self.comm.all_reduce(global_loss, ReduceOp.AVG)
        seconds = time.perf_counter() - start
        self.wire.append(sum(c.wire_bytes() for c in counted) - sum(c.wire_bytes() for c in clipping))
        all_reduces = sum(c.calls("all_reduce") for c in counted) - sum(c.calls("all_reduce") for c in clipping)
        self.calls = max(self.calls, all_reduces)
        self.ops = _without(_merged(counted), _merged(clipping))
        self.log.record(step, global_loss.item(), lr, seconds, wire_bytes=self.wire[-1])
        self.step_index += 1
        self.done = self.stopper.should_stop(step, model) or self.step_index == self.options.steps

    def result(self) -> dict[str, Any]:
        """What report.summarise reads; metrics on rank 0."""
        zeros = [0] * len(self.wire)
        return {
            "rank": self.comm.rank,
            "grad_bytes": self.grad_bytes,
            "wire_bytes": self.wire,
            "all_reduce_calls": self.calls,
            "coords": {"dp": self.comm.rank, "tp": 0, "pp": 0},
            "wire_bytes_per_axis": {"dp": self.wire, "tp": zeros, "pp": zeros},
            "ops_per_axis": {"dp": self.ops, "tp": {}, "pp": {}},
            "peak_rss": peak_rss_bytes(),
            "memory": {**self.held, "peak_rss": peak_rss_bytes()},
            "metrics": self.log.close(),
            "validation": self.stopper.history,
            "stopped_at": self.stopper.stopped_at,
        }


def _merged(stats: list[Any]) -> dict[str, dict[str, int]]:
    """{op: {calls, bytes, wire_bytes}} summed over several CommStats."""
    out: dict[str, dict[str, int]] = {}
    for s in stats:
        for op, counts in s.as_dict().items():
            into = out.setdefault(op, dict.fromkeys(counts, 0))
            for key, value in counts.items():
                into[key] += value
    return out


def _without(total: dict[str, dict[str, int]], part: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """`total` less `part`, op by op; an op left with no call is dropped."""
    out = {}
    for op, counts in total.items():
        left = {key: value - part.get(op, {}).get(key, 0) for key, value in counts.items()}
        if left["calls"]:
            out[op] = left
    return out

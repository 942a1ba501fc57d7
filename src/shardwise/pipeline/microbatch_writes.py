"""Buffers a pipeline stage's forward writes, under more than one microbatch: refused, or chosen knowingly.

A pipeline cuts each step's batch into microbatches (GPipe, Huang et al. 2019), so every forward of a stage runs once
per microbatch. A buffer the forward writes is then written m times per step, each time from 1/m of the batch: a step
counter counts m, spectral norm's power iteration runs m times, a running mean or an EMA codebook follows the
microbatches. None of it is one process's step on the whole batch, and nothing fails. BatchNorm layers have their own
check (batch_norm_split.MicrobatchStatistics).

`MicrobatchBufferWrites` watches the first training step of a pipeline with more than one microbatch: each rank notes
its stages' buffers (tensor and version counter) before the step and compares after it, and one all-reduce (MAX) of
a flag over the pipeline ranks makes every rank raise when any stage's forward wrote one, naming it where it is
local. Control traffic, not counted in `comm.stats`. `buffer_writes="local"` (the option of `sw.parallelize` and of
`Pipeline`) accepts the per-microbatch writes knowingly; `n_microbatches=1` keeps one process's batch.
"""

from __future__ import annotations

import torch
from torch import nn

from ..buffer_writes import WatchedBuffers
from ..comm.base import Communicator, ReduceOp
from ..comm.uncounted import uncounted

__all__ = ["MicrobatchBufferWrites"]


class MicrobatchBufferWrites:
    """`before()` and `after()` around a training step's schedule (module docstring)."""

    def __init__(self, local: dict[str, nn.Module], n_microbatches: int, comm: Communicator, who: str,
                 buffer_writes: str | None) -> None:
        self.comm, self.who, self.n = comm, who, n_microbatches
        self.watched = {s: WatchedBuffers(stage) for s, stage in local.items()}
        self.active = n_microbatches > 1 and buffer_writes != "local"
        self.noted: dict[str, dict[str, tuple[int, int]]] | None = None

    def before(self) -> None:
        if self.active:
            self.noted = {s: watched.note() for s, watched in self.watched.items()}

    def after(self) -> None:
        if not self.active or self.noted is None:
            return
        written = []
        for s, watched in self.watched.items():
            named = watched.named()
            written += [f"stage {s}: {name}" for (name, _), moved in
                        zip(named, WatchedBuffers.written(self.noted[s], named)) if moved]
        self.active, self.noted = False, None
        flag = torch.tensor([1.0 if written else 0.0], device=self.comm.device)
        if self.comm.size > 1:
            with uncounted(self.comm):
                self.comm.all_reduce(flag, ReduceOp.MAX)
        if flag.item() > 0:
            what = f"buffer {written[0]!r}" if written else "a buffer of another pipeline rank's stage"
            raise ValueError(
                f"{self.who}: {what} was written by the forward of each of the {self.n} microbatches of this step "
                f"(a counter, a running statistic, spectral norm's power iteration): {self.n} writes from 1/{self.n} "
                f"of the batch each, where one process writes once from the whole batch. Use n_microbatches=1, or "
                f"buffer_writes='local' to accept the per-microbatch writes knowingly")

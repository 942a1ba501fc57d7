"""Collectives that `comm.stats` does not count: shardwise's own consistency checks.

`comm.stats` (CommStats) is what a strategy moves, and the demo and the benchmarks compare it to each strategy's
formula to the byte. The checks that keep a run honest (the ranks' optimizer hyperparameters every 20th step,
optimizer_agreement.py; the buffers a training forward wrote, buffer_writes.py; a tensor-parallel model's first
replicated gradients, tensor_parallel/replica_grads.py) are control traffic, few bytes or once: they run inside
`uncounted(comm)`, which restores the counts afterwards.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from .base import Communicator

__all__ = ["uncounted"]


@contextlib.contextmanager
def uncounted(comm: Communicator) -> Iterator[None]:
    """Run the block's collectives on `comm` without counting them in `comm.stats` (synchronous collectives of
    this rank only: a measurement open around the block still sees everything else)."""
    before = comm.stats.snapshot()
    try:
        yield
    finally:
        comm.stats.ops = before.ops

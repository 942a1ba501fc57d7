"""Where a tensor-parallel model's forward is in a parallel region: its dropout masks are then each rank's own.

Why. Between a column-parallel layer whose output stays split and the next row-parallel layer, each rank of the
group holds its own part of the activations: its attention heads, its MLP columns. A dropout there (attention
probabilities, an MLP's hidden dropout: T5's, GPT-2's attention dropout) drops out different elements of the model on
every rank, and one process draws an independent mask for each of them. The group's shared stream
(dropout_stream.py) would give every rank the same mask at the same local position, so head h of rank 0 and head h of
rank 1 were always dropped alike: masks still Bernoulli(1 - p) per element, but correlated across ranks, which one
process never does. Megatron-LM forks a generator seeded per tensor-parallel rank for these regions
(``get_cuda_rng_tracker().fork()``, Shoeybi et al. 2019, section 3), and its model code says where a region starts.

Mechanism. `mark_regions` (called by tensor_parallel.parallelize without sequence parallelism, whose regions are all
split and drawn per rank already) hooks the layers that open a region (column-parallel, output not gathered) and those
that close one (row-parallel); the thread's place in the group (its rank + 1) is current from the end of an opening
layer's forward to the start of a closing one's, and nowhere else: every outermost call of the model starts outside
(dropout_stream's enter and leave call `leave`). A draw in a region mixes that place into the stream's seed before
recording it, so an activation-checkpointing recompute replays the rank's own seed wherever it starts. Under
torch.compile the hooks run eagerly at a graph break (compiled.eager_while_traced), as the draws themselves do, so a
compiled model draws the eager one's masks. A region left open where
the activations are replicated again (a model that drops out a replicated tensor between the two layers) would give
the replicated parameters different gradients, which tensor parallel's check of the first steps reports by name
(tensor_parallel/replica_grads.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from torch import nn

from .compiled import eager_while_traced

__all__ = ["leave", "mark_regions", "place"]


class _Region(threading.local):
    def __init__(self) -> None:
        self.place = 0  # this thread's place in the group (rank + 1) inside a parallel region, 0 outside


_region = _Region()


def place() -> int:
    """This thread's place in its tensor-parallel group (rank + 1) inside a parallel region, else 0."""
    return _region.place


def leave() -> None:
    """Outside any parallel region (an outermost call of the model begins or ends)."""
    _region.place = 0


def mark_regions(opening: Iterable[nn.Module], closing: Iterable[nn.Module], rank: int) -> None:
    """Hook the layers that open a parallel region (their output is this rank's split) and those that close one
    (their input is): draws between them are this rank's own (module docstring)."""

    def opened(module: nn.Module, args: Any, output: Any) -> None:
        _region.place = rank + 1

    def closed(module: nn.Module, args: Any) -> None:
        _region.place = 0

    opened, closed = eager_while_traced(opened), eager_while_traced(closed)
    for module in opening:
        module.register_forward_hook(opened)
    for module in closing:
        module.register_forward_pre_hook(closed)

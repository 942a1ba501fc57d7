"""Parameters a sharded model keeps whole on every rank and averages DDP's way (`replicated_params`, and weights
tied across tensor-parallel ranks): in no unit, reduced once at the end of backward."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..comm.base import Communicator, ReduceOp
from ..graph_gradients import average_when_building_graph
from ..unused import used_anywhere

__all__ = ["ReplicatedParams"]


class ReplicatedParams:
    """The trainable ones of `params`, averaged over `comms` (the shard group, then the replica group)."""

    def __init__(self, params: tuple[nn.Parameter, ...], comms: tuple[Communicator | None, ...],
                 handles: list[Any]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.comms = tuple(c for c in comms if c is not None and c.size > 1)
        # torch.autograd.grad(..., create_graph=True) gets the data-parallel average (graph_gradients.py)
        handles += [p.register_hook(average_when_building_graph(self.comms)) for p in self.params]

    def reduce(self) -> None:
        """Average the gradients over the groups; one that no rank used keeps `grad = None` (a small all-reduce of
        flags first, only when there are such parameters)."""
        if not self.params or not self.comms:
            return
        used = used_anywhere([p.grad is not None for p in self.params], self.comms, self.params[0].device)
        for p, was_used in zip(self.params, used):
            if not was_used:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            for comm in self.comms:
                comm.all_reduce(p.grad, ReduceOp.AVG)

"""Reentrant activation checkpointing under the sharding engine (ZeRO 1/2/3, FSDP).

torch.utils.checkpoint(..., use_reentrant=True) (and HuggingFace's gradient_checkpointing_enable with
use_reentrant=True) runs the backward of each checkpointed call as a backward pass of its own. A module used more
than once per forward (a looped or recurrent block: HRM's L-module, a weight-shared encoder) then receives its
gradient in several passes; the engine had reduced the unit after the first and the rest was lost: half the block's
gradient, silently (ZeRO-1/2/3 and FSDP; `sw.DDP` already refused, as torch DDP does). Now the late gradient raises,
naming the parameter and use_reentrant=False. Checkpointing each module once (reentrant or not), and a block used
twice without reentrant checkpointing, train like one process (AdamW with weight decay)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardwise as sw

STRATEGIES = {
    "zero1": lambda model, comm: sw.ZeRO(model, comm, stage=1),
    "zero2": lambda model, comm: sw.ZeRO(model, comm, stage=2),
    "zero3": lambda model, comm: sw.ZeRO(model, comm, stage=3, wrap=nn.Sequential),
    "fsdp": lambda model, comm: sw.FSDP(model, comm, wrap=nn.Sequential),
}


class Looped(nn.Module):
    """An input layer, a block applied `uses` times (each call checkpointed), an output layer."""

    def __init__(self, uses: int, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.out = nn.Linear(16, 1)
        self.uses, self.reentrant = uses, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(self.uses):
            h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.out(h)


def batch(step):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


def loss_fn(model, x):
    return model(x).square().mean()


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_block_used_twice_under_reentrant_checkpointing_is_refused_naming_it(strategy):
    with pytest.raises(sw.LaunchError) as raised:
        sw.check(lambda: Looped(2, reentrant=True), batch, strategy=STRATEGIES[strategy], world_size=2, steps=1,
                 loss_fn=loss_fn, optimizer=adamw)
    message = str(raised.value)
    assert "parameter 'block.0." in message and "received a gradient after its unit's gradients were reduced" \
        in message and "use_reentrant=False" in message


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("uses,reentrant", [(1, True), (2, False)], ids=["once-reentrant", "twice-non-reentrant"])
def test_what_the_engine_reduces_once_matches_one_process(strategy, uses, reentrant):
    report = sw.check(lambda: Looped(uses, reentrant), batch, strategy=STRATEGIES[strategy], world_size=2, steps=2,
                      loss_fn=loss_fn, optimizer=adamw)
    assert report.ok, str(report)

"""A unit's gathered parameter saved for backward outside the unit's forward matches one process under ZeRO-3/FSDP.

A regulariser computed in a forward hook (`(w @ w.T - I).pow(2).sum()`), or a parent's forward reading a child
unit's weight, saves the gathered parameter in a node autograd runs before the unit's backward hook gathers it
again. Before, that node read freed storage ("setStorage ... out of bounds", without prefetch) or a buffer the
prefetching all-gather was still writing: uninitialised values, NaN or a silently wrong step, more often under load
(sharding/outside_reads.py has the mechanism)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from tests.parity import assert_state_close, mlp_batch, small_mlp, train_mlp

WRAPS = {
    "zero3-per-layer": lambda m, c: sw.ZeRO(m, c, stage=3, wrap=nn.Linear),
    "zero3-per-layer-no-prefetch": lambda m, c: sw.ZeRO(m, c, stage=3, wrap=nn.Linear, prefetch=False),
    "fsdp-per-layer": lambda m, c: sw.FSDP(m, c, wrap=nn.Linear),
    "fsdp-per-layer-checkpointed": lambda m, c: sw.FSDP(m, c, wrap=nn.Linear, activation_checkpointing=True),
    "zero2-per-layer": lambda m, c: sw.ZeRO(m, c, stage=2, wrap=nn.Linear),
}


def orthogonality(w: torch.Tensor) -> torch.Tensor:
    return (w @ w.T - torch.eye(w.shape[0])).pow(2).sum()


class Regularised(nn.Module):
    """small_mlp with an orthogonality penalty on its middle layer, added in one of three places."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.body = small_mlp()
        self.where = where
        self.penalties: list[torch.Tensor] = []
        if where == "hook-before-wrapping":
            self.body[2].register_forward_hook(lambda m, i, o: self.penalties.append(orthogonality(m.weight)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        if self.where == "parent-forward":  # the last unit's weight, read after it ran
            out = out + 0.1 * orthogonality(self.body[4].weight)
        return out


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.penalties.clear()
    handle = None
    if model.where == "hook-after-wrapping":
        handle = model.body[2].register_forward_hook(
            lambda m, i, o: model.penalties.append(orthogonality(m.weight)))
    loss = ((model(x) - y) ** 2).mean() + 1e-2 * sum(model.penalties)
    if handle is not None:
        handle.remove()
    return loss


def train(model: nn.Module, rank: int = 0, world: int = 1) -> nn.Module:
    return train_mlp(model, loss_of, rank, world)


@pytest.mark.parametrize("where", ["hook-after-wrapping", "hook-before-wrapping", "parent-forward"])
@pytest.mark.parametrize("name", list(WRAPS))
def test_a_parameter_saved_outside_its_unit_matches_one_process(name, where):
    want = train(Regularised(where)).state_dict()

    def body(comm):
        model = train(WRAPS[name](Regularised(where), comm), comm.rank, comm.size)
        return {k: v.clone() for k, v in sw.full_state_dict(model).items()}

    for got in sw.launch(body, 2):
        assert_state_close(got, want)


def test_the_hooks_are_gone_after_forward_and_leave_a_checkpoint_region_alone():
    """Outside the forward no saved-tensor hook of ours stays installed; inside a torch.utils.checkpoint region
    around the whole model ours are not installed over checkpoint's, which still recomputes correctly."""
    want = train(Regularised("hook-before-wrapping")).state_dict()

    def body(comm):
        model = sw.ZeRO(Regularised("hook-before-wrapping"), comm, stage=3, wrap=nn.Linear)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
        for step in range(4):
            x, y = mlp_batch(step, comm.rank, comm.size)
            model.penalties.clear()
            out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
            assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
            (((out - y) ** 2).mean() + 1e-2 * model.penalties[0]).backward()
            opt.step()
            opt.zero_grad()
        return {k: v.clone() for k, v in sw.full_state_dict(model).items()}

    for got in sw.launch(body, 2):
        assert_state_close(got, want)

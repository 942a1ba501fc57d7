"""Parameters that get no gradient in a step: the engine copies each parameter's first gradient of a cycle into
its slice of the flat buffer instead of zeroing the whole buffer first, and zeroes only what nothing wrote (padding,
frozen and unused parameters) before the reduction. A stale slice (last step's reduction scratch in a kept ZeRO-1
buffer, or fresh uninitialised memory) would show up here as a wrong update of the unused parameter."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw


class Branchy(nn.Module):
    """A trunk always used, a branch used only on even steps (its gradient is None on odd ones), a frozen layer,
    and an odd parameter count so that the flat buffer has padding."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(7, 7)
        self.branch = nn.Linear(7, 7)
        self.frozen = nn.Linear(7, 7)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(7, 1)
        # Values from a private generator: thread ranks build their models at the same time, and the global RNG
        # (torch.manual_seed) is shared between threads.
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        h = torch.tanh(self.frozen(self.trunk(x)))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h).pow(2).mean()


def _data(step: int, rank: int, world: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + micro)
    x = torch.randn(4 * world, 7, generator=g)
    return x[4 * rank : 4 * (rank + 1)]


STEPS, MICRO = 4, 2


def _train(model: nn.Module, rank: int, world: int, no_sync) -> dict[str, torch.Tensor]:
    # Plain SGD: a zero gradient and no gradient update alike, so the single-process reference needs no zero filling.
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for step in range(STEPS):
        for micro in range(MICRO):
            # The branch is used in the second micro-batch of even steps only: under no_sync its slice is first
            # written by the syncing backward, and on odd steps never.
            use = step % 2 == 0 and micro == 1
            loss = model(_data(step, rank, world, micro), use) / MICRO
            if micro < MICRO - 1:
                with no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in sw.full_state_dict(model).items()}


def _sharded(comm, stage: int) -> dict[str, torch.Tensor]:
    model = sw.ZeRO(Branchy(), comm, stage=stage, wrap=None)  # one flat buffer: padding, frozen and unused slices together
    return _train(model, comm.rank, comm.size, model.no_sync)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parameters_without_gradient_in_some_steps_match_one_process(stage):
    want = _train_whole()
    for got in sw.launch(_sharded, 2, stage):
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _train_whole() -> dict[str, torch.Tensor]:
    """One process on the global batch (both ranks' halves together)."""
    model = Branchy()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for step in range(STEPS):
        for micro in range(MICRO):
            use = step % 2 == 0 and micro == 1
            x = torch.cat([_data(step, r, 2, micro) for r in range(2)])
            (model(x, use) / MICRO).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}

"""The optimizer guard: an optimizer built before ZeRO / FSDP wrapped the model, or over another model's
parameters, raises at its first step naming the fix; correct uses (and a second, independent model with its own
optimizer) are untouched."""

from __future__ import annotations

import copy

import pytest
import torch
from parity import CONFIG, batch

import shardwise as sw
from shardwise.models import GPT


def test_optimizer_built_before_sharding_raises_at_its_first_step():
    def body(comm):
        model = GPT(CONFIG, seed=0)
        opt = torch.optim.AdamW(model.parameters())  # too early: ZeRO-3 replaces these
        model = sw.ZeRO(model, comm, stage=3)
        x, y = batch(0, comm.rank, comm.size)
        model(x, y).backward()
        with pytest.raises(ValueError, match=r"zero3 replaced when it wrapped the model .* build the optimizer "
                                             r"after wrapping, over model.parameters\(\)"):
            opt.step()

    sw.launch(body, 2)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_optimizer_over_another_model_raises(strategy):
    def body(comm):
        model = GPT(CONFIG, seed=0)
        copy_ = copy.deepcopy(model)
        model = sw.DDP(model, comm) if strategy == "ddp" else sw.ZeRO(model, comm, stage=2)
        opt = torch.optim.SGD(copy_.parameters(), lr=0.1)  # the unwrapped copy
        x, y = batch(0, comm.rank, comm.size)
        model(x, y).backward()
        with pytest.raises(ValueError, match=r"none of the optimizer's \d+ parameters has a gradient, while the "
                                             rf"{strategy} model wrapped in this thread"):
            opt.step()

    sw.launch(body, 2)


def test_correct_uses_are_untouched():
    def body(comm):
        model = sw.ZeRO(GPT(CONFIG, seed=0), comm, stage=3)
        probe = torch.nn.Linear(4, 1)  # a second model trained beside it, with its own optimizer
        opt, probe_opt = torch.optim.AdamW(model.parameters()), torch.optim.SGD(probe.parameters(), lr=0.1)
        for step in range(2):
            x, y = batch(step, comm.rank, comm.size)
            model(x, y).backward()
            probe(torch.randn(3, 4)).sum().backward()
            probe_opt.step()
            opt.step()
            opt.zero_grad()
            probe_opt.zero_grad()
        opt.step()  # nothing has a gradient anywhere: a no-op, as in PyTorch

    sw.launch(body, 2)

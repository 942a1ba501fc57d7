"""Shared pieces of the composition tests (tensor x data x pipeline): the optimizer they all use and the clipped
single-process reference. AdamW eps=1e-5 as in the tensor-parallel tests (tests/test_tensor_parallel_gpt.py says
why: splitting matmuls adds rounding noise that Adam would amplify on near-zero gradients)."""

from __future__ import annotations

import torch
from parity import CONFIG, batch

import shardwise as sw
from shardwise.models import GPT


def optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-5)


def dense_clipped(steps: int, max_norm: float, config=CONFIG) -> GPT:
    """The GPT after `steps` AdamW steps on the whole global batch, one process, clipping at `max_norm`."""
    model = GPT(config, seed=0)
    opt = optimizer(model.parameters())
    for step in range(steps):
        x, y = batch(step)
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
    return model


def load_and_resave(comm, build, name, source, target) -> None:
    """Build layout `name` (build(comm, name) returns the model first), load `source`, save it again to `target`,
    so the reloaded state can be compared tensor by tensor."""
    model = build(comm, name)[0]
    opt = optimizer(model.parameters())
    step = sw.load_checkpoint(source, model, opt, comm=comm)["step"]
    sw.save_checkpoint(target, model, opt, step=step, comm=comm)

"""Shared rank bodies of the compression tests: the optimizer they train with and the measured training loop."""

from __future__ import annotations

import torch
from parity import batch

import shardwise as sw


def sgd(params):
    # SGD, not Adam: Adam divides by sqrt(v), which turns the float noise of a ~zero gradient into a full step and
    # would hide how close the compressed gradients are (see parity.py).
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def run_steps(comm, model, steps):
    """`steps` SGD steps of `model` on this rank's slice of each global batch: (global mean losses, per-step
    CommStats of forward + backward)."""
    opt = sgd(model.parameters())
    losses, measured = [], []
    for step in range(steps):
        x, y = batch(step, comm.rank, comm.size)
        with comm.stats.measure() as m:
            loss = model(x, y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        avg = loss.detach().clone()
        comm.all_reduce(avg, sw.ReduceOp.AVG)
        losses.append(float(avg))
        measured.append(m)
    return losses, measured
